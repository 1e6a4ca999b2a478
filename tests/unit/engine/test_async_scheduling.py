"""Async scheduling (`EngineConfig.async_scheduling`): each step launched before the one before it is
processed, its decode inputs taken from that step's sampled tokens on the device. Greedy outputs
equal the synchronous engine's and a no-cache recomputation over pages, the radix cache, eager and
padded decode, the host tier, sliding windows, speculative decoding and a prefill/decode pair;
the canary stays silent; a request finishing at step N keeps its row and slots until step N+1,
which still wrote them, is processed; the slots of a speculative decode's rejected positions that
the decode launched after it writes are freed only once that one is processed."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.async_steps import RUN_POINTS, WHEN_WAITED, AsyncSteps
from pytest_kvcanary.reference_engine.pd import PDPair
from pytest_kvcanary.reference_engine.scheduler import Scheduler

from test_host_tier import attach, tight


def assert_silent(runtime: CanaryRuntime) -> None:
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []


def count_overlap(monkeypatch) -> dict[str, int]:
    """Steps launched while another was in flight, and requests that retired (found finished with a
    later step launched), over the test."""
    counts = {"overlapped": 0, "retired": 0}
    launch, retire = AsyncSteps._launch, Scheduler._retire

    def counted_launch(self, batch):
        counts["overlapped"] += bool(self.launched)
        launch(self, batch)

    def counted_retire(self, req):
        counts["retired"] += 1
        retire(self, req)

    monkeypatch.setattr(AsyncSteps, "_launch", counted_launch)
    monkeypatch.setattr(Scheduler, "_retire", counted_retire)
    return counts


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="async_scheduling must be a bool; got 'yes'"):
        EngineConfig(async_scheduling="yes")
    assert EngineConfig(async_scheduling=True, speculative_k=2).speculative_k == 2, "speculation runs async too"


FEATURES = {  # (attention, EngineConfig fields, prompts' seed); "at launch": each step run when launched (CUDA's order)
    "mha-pages-retracting": ("mha", {"page_size": 4, "num_slots": 48, "max_running": 4}, 1),
    "mha-padded": ("mha", {"decode_mode": "padded", "max_running": 4}, 2),
    "swa-padded": ("swa", {"decode_mode": "padded", "max_running": 4}, 3),
    "mla-pages": ("mla", {"page_size": 2, "max_running": 3}, 4),
    "hybrid": ("hybrid", {"max_running": 3}, 5),
    "mha-graph": ("mha", {"decode_mode": "graph", "max_running": 4}, 6),
    "mha-pages-retracting at launch": ("mha", {"page_size": 4, "num_slots": 48, "max_running": 4}, 7),
    "swa-padded at launch": ("swa", {"decode_mode": "padded", "max_running": 4}, 8),
}
CUDA_ONLY = {"mha-graph"}


@pytest.mark.parametrize("feature", [pytest.param(f, marks=pytest.mark.skipif(
    f in CUDA_ONLY and not torch.cuda.is_available(), reason="CUDA graphs need CUDA")) for f in FEATURES])
def test_outputs_equal_the_sync_engine_and_the_no_cache_recomputation_with_the_canary_silent(
        feature, make_engine, random_prompts, assert_reference, monkeypatch):
    attention, fields, seed = FEATURES[feature]
    prompts = random_prompts(seed, 5)
    expected = make_engine(attention, **fields).generate(prompts, 6)
    counts = count_overlap(monkeypatch)
    engine = make_engine(attention, async_scheduling=True, **fields)
    engine._async.run_at_launch |= feature.endswith("at launch")
    runtime = attach(engine)
    outputs = engine.generate(prompts, 6)
    assert outputs == expected
    assert_reference(engine, prompts, outputs)
    assert counts["overlapped"] > 0 and counts["retired"] > 0, counts
    if feature.startswith("mha-pages-retracting"):
        assert engine.scheduler.num_retracted > 0 and engine.scheduler.num_prefix_hits > 0
    assert_silent(runtime)
    engine.reset()  # every slot and row comes back
    assert not engine.scheduler.has_work and not engine._async.launched


def test_host_tier_loads_back_under_async_scheduling(make_engine, random_prompts, assert_reference, monkeypatch):
    counts = count_overlap(monkeypatch)
    engine = make_engine("mha", async_scheduling=True, **tight(4, host_slots=128))
    runtime = attach(engine)
    a, b = random_prompts(2, 4), random_prompts(5, 4)
    engine.generate(a, 6)
    engine.generate(b, 6)
    outputs = engine.generate(a, 6)
    assert_reference(engine, a, outputs)
    assert engine.host_tier.num_loaded_back > 0 and counts["overlapped"] > 0
    assert_silent(runtime)


@pytest.mark.parametrize("speculative_k", [0, 2])
def test_a_prefill_decode_pair_with_an_async_decode_side(speculative_k, make_engine, random_prompts, assert_reference,
                                                        monkeypatch):
    prompts = random_prompts(6, 4)
    counts = count_overlap(monkeypatch)
    pair = PDPair(make_engine("mha", page_size=2, speculative_k=speculative_k),
                  make_engine("mha", page_size=2, async_scheduling=True, max_running=3, speculative_k=speculative_k))
    prefill, decode = attach(pair.prefill), attach(pair.decode)
    pair.add_transfer_listener(lambda src, dst: decode.import_records(dst, prefill.export_records(src)))
    outputs = pair.generate(prompts, 6)
    assert_reference(pair.decode, prompts, outputs)
    assert pair.num_transferred == len(prompts) and counts["overlapped"] > 0
    assert_silent(prefill)
    assert_silent(decode)


def test_a_request_finishing_at_step_n_keeps_its_row_and_slots_until_step_n_plus_1_is_processed(make_engine):
    engine = make_engine("mha", async_scheduling=True)
    freed: list[set[int]] = []
    engine.add_free_listener(lambda kind, slots, cause: freed.append(set(slots.tolist())))
    short, long = engine.submit(list(range(1, 9)), 2), engine.submit(list(range(20, 30)), 5)
    while not engine.step():  # until a step is processed in which `short` finished
        pass
    assert short.finished and len(short.output_ids) == 2
    in_flight = engine._async.launched
    assert len(in_flight) == 1 and short in in_flight[0].batch.reqs, "step N+1 still has a row for it"
    assert short in engine.scheduler.retiring and short.row >= 0 and short.ahead == 1
    held = set(engine.req_to_token_pool.read(short.row, 0, short.launched_len).tolist())
    assert not held & set(engine.pools.full.free_slots.tolist()) and not any(held & f for f in freed)
    written = engine.req_to_token_pool.read(short.row, short.kv_len, short.launched_len).tolist()
    engine.step()  # processes step N+1: its token for `short` is dropped, then it finishes
    assert short not in engine.scheduler.retiring and short.row == -1 and len(short.output_ids) == 2
    assert set(written) <= set(engine.cache_walk().slots.tolist()), "its last token's KV, written at N+1, is cached"
    while engine.scheduler.has_work:
        engine.step()
    assert long.finished and len(long.output_ids) == 5


def test_an_abort_while_its_step_is_in_flight_releases_it_once_that_step_is_processed(make_engine):
    engine = make_engine("mha", async_scheduling=True)
    req = engine.submit(list(range(1, 9)), 8)
    engine.step()  # the prefill, launched
    engine.step()  # prefill processed, first decode launched
    engine.step()  # second decode launched, first processed
    kept = list(req.output_ids)
    engine.scheduler.abort_request(req)
    assert req in engine.scheduler.retiring and req.row >= 0
    engine.step()
    assert not engine.scheduler.has_work and req.row == -1 and req.output_ids == kept


class QuietHooks:
    """Forward hooks that do nothing: a test's hooks override what they watch."""

    def before_forward(self, view) -> None:
        pass

    def kv_stored(self, kind, layer, k, v) -> None:
        pass

    def after_forward(self, view) -> None:
        pass

    def states_copied(self, src, dst) -> None:
        pass

    def end_forward(self, device_work=None) -> None:
        pass


class TokenTableAtTail(QuietHooks):
    """Forward hooks that note, at after_forward (where TAIL reads them), each written token's entry
    in the view's token table next to the input id the forward embedded there."""

    def __init__(self) -> None:
        self.pairs: list[tuple[int, int]] = []

    def after_forward(self, view) -> None:
        t = 0
        for row, prefix, extend in zip(view.rows.tolist(), view.prefix_lens.tolist(), view.extend_lens.tolist()):
            for j in range(extend):
                self.pairs.append((int(view.token_table[row, prefix + j]), int(view.input_ids[t + j])))
            t += extend


@pytest.mark.parametrize(("decode_mode", "at_launch"), [("eager", True), ("padded", True), ("eager", False)])
def test_the_token_table_holds_every_token_a_step_embeds_before_the_host_knows_it(decode_mode, at_launch, make_engine,
                                                                                 random_prompts, monkeypatch):
    """at_launch: each step runs when launched, before the host processes the one before it, as on
    CUDA: the token table has the tokens the host does not know from the step that sampled them."""
    counts = count_overlap(monkeypatch)
    engine = make_engine("mha", async_scheduling=True, decode_mode=decode_mode, max_running=4)
    engine._async.run_at_launch = at_launch
    hooks = TokenTableAtTail()
    engine.set_forward_hooks(hooks)
    engine.generate(random_prompts(7, 3), 5)
    assert counts["overlapped"] > 0 and hooks.pairs
    assert all(entry == embedded and entry >= 0 for entry, embedded in hooks.pairs)


def test_a_step_that_gathers_another_request_s_token_is_a_write_token_at_its_tail(make_engine, monkeypatch):
    """The bug: step N+1 takes each request's input from the step N output of the request before it
    in N's batch. The token table, written by N from its own rows, disagrees at N+1's TAIL."""
    carried = AsyncSteps._carried
    monkeypatch.setattr(AsyncSteps, "_carried", staticmethod(
        lambda batch, prev: [(dst, (src + 1) % len(prev.reqs)) for dst, src in carried(batch, prev)]))
    engine = make_engine("mha", async_scheduling=True)
    runtime = attach(engine)
    outputs = engine.generate([list(range(1, 9)), list(range(30, 36))], 4)
    scores = engine.score_uncached(list(zip([list(range(1, 9)), list(range(30, 36))], outputs)))
    assert any(out != s.best for out, s in zip(outputs, scores)), "the swapped tokens changed the outputs"
    runtime.drain()
    first = min(v.step for v in runtime.log.violations)
    assert {(v.phase, v.reasons[0]) for v in runtime.log.violations if v.step == first} == {("TAIL", "write_token")}


class RaiseAt(QuietHooks):
    """Forward hooks that raise in before_forward of the n-th forward."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def before_forward(self, view) -> None:
        self.seen += 1
        if self.seen == self.n:
            raise RuntimeError("hook failed")


@pytest.mark.parametrize("at_launch", [False, True])
def test_a_forward_that_raises_undoes_every_launched_step(at_launch, make_engine, random_prompts, assert_reference):
    engine = make_engine("mha", async_scheduling=True, page_size=2)
    engine._async.run_at_launch = at_launch
    engine.set_forward_hooks(RaiseAt(4))
    prompts = random_prompts(9, 3)
    reqs = [engine.submit(p, 6) for p in prompts]
    with pytest.raises(RuntimeError, match="hook failed"):
        while engine.scheduler.has_work:
            engine.step()
    assert not engine._async.launched and not engine.scheduler.running and not engine.scheduler.retiring
    assert all(r.ahead == 0 and r.row == -1 for r in reqs)
    while engine.scheduler.has_work:  # the requests, back in the queue, run to their end
        engine.step()
    assert_reference(engine, prompts, [r.output_ids for r in reqs])
    engine.reset()


def record_run_points(monkeypatch) -> list[str]:
    """Where each launched step's forward ran (Launched.runs), in launch order, over the test."""
    points: list[str] = []
    launch = AsyncSteps._launch

    def recorded(self, batch):
        launch(self, batch)
        points.append(self.launched[-1].runs)

    monkeypatch.setattr(AsyncSteps, "_launch", recorded)
    return points


@pytest.mark.parametrize("feature", ["mha-pages-retracting", "swa-padded", "mla-pages", "hybrid"])
def test_jitter_draws_where_each_step_runs_and_outputs_stay_the_sync_engine_s(
        feature, make_engine, random_prompts, assert_reference, monkeypatch):
    attention, fields, seed = FEATURES[feature]
    prompts = random_prompts(seed, 5)
    expected = make_engine(attention, **fields).generate(prompts, 6)
    points = record_run_points(monkeypatch)
    engine = make_engine(attention, async_scheduling=True, jitter_seed=seed, **fields)
    runtime = attach(engine)
    outputs = engine.generate(prompts, 6)
    assert outputs == expected
    assert_reference(engine, prompts, outputs)
    assert set(points) == set(RUN_POINTS), points
    assert_silent(runtime)


def test_a_jitter_seed_replays_its_run_points_after_a_reset_and_another_seed_draws_others(
        make_engine, random_prompts, monkeypatch):
    prompts = random_prompts(1, 5)
    fields = FEATURES["mha-pages-retracting"][1]
    points = record_run_points(monkeypatch)
    engine = make_engine("mha", async_scheduling=True, jitter_seed=4, **fields)
    first = engine.generate(prompts, 6), list(points)
    engine.reset()
    points.clear()
    assert (engine.generate(prompts, 6), points) == first
    points.clear()
    other = make_engine("mha", async_scheduling=True, jitter_seed=5, **fields).generate(prompts, 6)
    assert other == first[0] and points != first[1]
    points.clear()
    make_engine("mha", async_scheduling=True, **fields).generate(prompts, 6)
    assert set(points) == {WHEN_WAITED}, "without a seed a CPU runs each step when it is waited for"


SPECULATIVE = {  # (attention, EngineConfig fields, prompts' seed): speculative_k 3, a draft of 3 layers
    "mha": ("mha", {}, 11),
    "mha-pages-retracting": ("mha", {"page_size": 4, "num_slots": 48, "max_running": 4}, 12),
    "mla-pages": ("mla", {"page_size": 2, "max_running": 3}, 13),
    "hybrid": ("hybrid", {"max_running": 3}, 14),
    "hybrid-pages": ("hybrid", {"page_size": 2, "max_running": 3}, 15),
}
TIMINGS = ("when waited", "at launch", "jitter")


def count_moved_back(monkeypatch) -> list[int]:
    """Per step launched behind a speculative decode, the positions its requests moved back on the
    device (the proposals that decode had them write and rejected), over the test."""
    moved: list[int] = []
    follow = AsyncSteps._follow

    def counted(self, batch, prev, carried):
        ran = follow(self, batch, prev, carried)
        moved.append(sum(batch.prefix_lens) - sum(ran.prefix_lens))
        return ran

    monkeypatch.setattr(AsyncSteps, "_follow", counted)
    return moved


@pytest.mark.parametrize("timing", TIMINGS)
@pytest.mark.parametrize("feature", SPECULATIVE)
def test_speculative_decoding_under_async_scheduling_equals_the_sync_engine_with_the_canary_silent(
        feature, timing, make_engine, random_prompts, assert_reference, monkeypatch):
    """Each decode is scheduled while the one before it is in flight, placed as if that one kept
    every position it wrote, and moved back on the device by the proposals it rejected."""
    attention, fields, seed = SPECULATIVE[feature]
    fields = {"speculative_k": 3, "draft_layers": 3, **fields}
    prompts = random_prompts(seed, 5)
    expected = make_engine(attention, **fields).generate(prompts, 9)
    counts = count_overlap(monkeypatch)
    engine = make_engine(attention, async_scheduling=True, jitter_seed=seed if timing == "jitter" else None, **fields)
    engine._async.run_at_launch = timing == "at launch"
    runtime = attach(engine)
    outputs = engine.generate(prompts, 9)
    assert outputs == expected
    assert_reference(engine, prompts, outputs)
    assert counts["overlapped"] > 0 and counts["retired"] > 0, counts
    assert engine.liveness()["in-flight rollbacks"] > 0, "no decode ran behind a rejected proposal"
    assert 0 < engine.drafter.accepted < engine.drafter.proposed
    if feature == "mha-pages-retracting":
        assert engine.scheduler.num_retracted > 0 and engine.scheduler.num_prefix_hits > 0
    assert_silent(runtime)
    engine.reset()
    assert not engine.scheduler.has_work and not engine._async.launched


class FreedUnderLaunchedSteps(QuietHooks):
    """Forward hooks and a free listener that fail the step at once where a slot some launched,
    unprocessed step writes (mapping(row, prefix_len + j) of its view) is freed: at the free if the
    step ran already, else when it runs. Forwards run in launch order: the k-th runs batches[k]."""

    def __init__(self, engine, batches: list) -> None:
        self.engine, self.batches, self.written, self.freed = engine, batches, {}, {}
        engine.set_forward_hooks(self)
        engine.add_free_listener(self.heard)

    def heard(self, kind, slots, cause) -> None:
        for step in self.engine._async.launched if kind.name == "FULL" else ():
            written = self.written.get(id(step.batch), set())
            assert not set(slots.tolist()) & written, f"freed after its step ran: {cause}"
            self.freed.setdefault(id(step.batch), set()).update(slots.tolist())

    def before_forward(self, view) -> None:
        batch, table = self.batches[len(self.written)], self.engine.req_to_token_pool
        self.written[id(batch)] = set(torch.cat([table.read(r, p, p + e) for r, p, e in zip(
            view.rows.tolist(), view.prefix_lens.tolist(), view.extend_lens.tolist())]).tolist())
        assert not self.written[id(batch)] & self.freed.get(id(batch), set()), "freed before its step ran"


@pytest.mark.parametrize("at_launch", [False, True])
def test_the_slots_a_launched_step_writes_are_not_freed_before_it_is_processed(at_launch, make_engine, random_prompts,
                                                                              monkeypatch):
    """Processing a speculative decode frees the slots of its rejected positions but those the decode
    launched after it writes (it runs from where the kept ones end, over the rejected ones): those
    are rolled back once that decode is processed."""
    batches, moved = [], count_moved_back(monkeypatch)
    launch = AsyncSteps._launch

    def noted(self, batch):
        batches.append(batch)
        launch(self, batch)

    monkeypatch.setattr(AsyncSteps, "_launch", noted)
    engine = make_engine("mha", speculative_k=3, draft_layers=3, async_scheduling=True, page_size=2)
    engine._async.run_at_launch = at_launch
    checks = FreedUnderLaunchedSteps(engine, batches)
    engine.generate(random_prompts(16, 5), 9)
    assert any(moved) and len(checks.written) == len(batches)
    assert any(checks.freed.values()), "nothing was freed while a step was in flight"


def test_a_request_finishing_inside_accepted_proposals_retires_until_the_step_after_is_processed(
        make_engine, assert_reference):
    """The draft is the whole target: every proposal is accepted. `short` (5 new tokens) gets 1 from
    its prefill and 4 from its first decode (step N), finishing inside N's accepted proposals while
    step N+1, scheduled as if it still needed a token, has a position for it."""
    fields = {"speculative_k": 3, "draft_layers": 4}
    engine = make_engine("mha", async_scheduling=True, **fields)
    runtime = attach(engine)
    prompts = [list(range(1, 9)), list(range(20, 30))]
    short, long = engine.submit(prompts[0], 5), engine.submit(prompts[1], 12)
    while not engine.step():  # until a step is processed in which `short` finished
        pass
    assert short.finished and len(short.output_ids) == 5
    (in_flight,) = engine._async.launched
    assert in_flight.batch.extend_lens[in_flight.batch.reqs.index(short)] == 1, "step N+1 has one position for it"
    assert short in engine.scheduler.retiring and short.row >= 0 and short.ahead == 1
    held = set(engine.req_to_token_pool.read(short.row, 0, short.launched_len).tolist())
    assert not held & set(engine.pools.full.free_slots.tolist())
    written = engine.req_to_token_pool.read(short.row, short.kv_len, short.launched_len).tolist()
    engine.step()  # processes step N+1: its tokens for `short` are dropped, then it finishes
    assert short not in engine.scheduler.retiring and short.row == -1 and len(short.output_ids) == 5
    assert set(written) <= set(engine.cache_walk().slots.tolist()), "its last token's KV, written at N+1, is cached"
    while engine.scheduler.has_work:
        engine.step()
    outputs = [short.output_ids, long.output_ids]
    assert outputs == make_engine("mha", **fields).generate(prompts[:1], 5) + make_engine(
        "mha", **fields).generate(prompts[1:], 12)
    assert_reference(engine, prompts, outputs)
    assert engine.drafter.accepted == engine.drafter.proposed > 0
    assert_silent(runtime)
