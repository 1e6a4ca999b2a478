"""Historic KV-cache bug mechanisms, reintroduced into the reference engine's real code paths.

Each bug test patches one mechanism into the scheduler, the radix cache, a KV store, the
speculative drafter or the host tier, runs a workload, proves the damage without the canary (the KV a forward
reads, or the greedy outputs, against a forward with no cache at all), and checks that the
canary's first report names the damaged slot and position with the right reason, in the forward
that did or read the damage.
The same workloads without the bugs run to completion clean (test_workload_without_the_bug_is_clean).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.reference_engine import Engine, Request
from pytest_kvcanary.reference_engine.attention import PagedKV
from pytest_kvcanary.reference_engine.decode_graphs import PaddedDecodeKV
from pytest_kvcanary.reference_engine.kv_pool import page_slots
from pytest_kvcanary.reference_engine.radix_cache import CAUSE_HOST_EVICTED, RadixCache
from pytest_kvcanary.reference_engine.radix_tiers import LowerTiers
from pytest_kvcanary.reference_engine.scheduler import Scheduler
from pytest_kvcanary.reference_engine.speculative import Drafter

from scenario_support import (
    attach_canary, first_reports, kv_off_reference, make_engine, off_greedy_reference, owner_of, reports,
    tokens,
)

BOTH = ("K", "V")


def run_until_finished(engine: Engine, prompt: list[int], max_new_tokens: int, context_key: int = 0) -> Request:
    req = engine.submit(prompt, max_new_tokens, context_key)
    while not req.finished:
        engine.step()
    return req


# ---- workloads: each runs up to just after the forward a bug damages (or first reads damage in) --


def wrapped_pool(engine: Engine) -> list[Request]:
    """A finished 40-token prompt stays cached in slots 1-40 (row 0, now free, still maps them).
    Three new prompts (step 1) take slots 41-47, evict it and take 1-25: the first prompt holds the
    pool's last slot (47) at position 6 and slot 1 at position 7. Step 2 decodes them padded to 4."""
    run_until_finished(engine, tokens(0, 40), 1)
    reqs = [engine.submit(tokens(1 + i, n), 4) for i, n in enumerate((12, 10, 10))]
    engine.step()
    engine.step()
    return reqs


def reuse_after_finish(engine: Engine) -> list[Request]:
    """A request finishes (steps 0-2) leaving 12 KV tokens cached; at step 3 a reader extends
    exactly those 12 tokens, and a new 8-token request asks for slots beside it."""
    first = run_until_finished(engine, tokens(10, 10), 3)
    reader = engine.submit(first.token_ids[:12] + tokens(11, 3), 2)
    writer = engine.submit(tokens(12, 8), 2)
    engine.step()
    return [reader, writer]


def one_prefill(engine: Engine) -> list[Request]:
    """A 10-token prompt prefilled at step 0."""
    req = engine.submit(tokens(20, 10), 3)
    engine.step()
    return [req]


def same_prompt_two_contexts(engine: Engine) -> list[Request]:
    """A prompt read in context 7 finishes at step 0 and stays cached; at step 1 the same prompt
    arrives in context 9."""
    prompt = tokens(30, 12)
    run_until_finished(engine, prompt, 1, context_key=7)
    req = engine.submit(prompt, 2, context_key=9)
    engine.step()
    return [req]


def padded_decode(engine: Engine) -> list[Request]:
    """Three prompts prefilled at step 0, decoded padded to a batch of 4 at step 1."""
    reqs = [engine.submit(tokens(40 + i, n), 3) for i, n in enumerate((10, 9, 8))]
    engine.step()
    engine.step()
    return reqs


def long_decode(engine: Engine) -> list[Request]:
    """A 6-token prompt decoded past the window (4): steps 0-4, kv_len 10 after step 4, so step 5
    reads positions 6-9 in its windowed layers."""
    req = engine.submit(tokens(50, 6), 10)
    for _ in range(5):
        engine.step()
    return [req]


def first_decode(engine: Engine) -> list[Request]:
    """An 8-token prompt prefilled at step 0; step 1 decodes position 8."""
    req = engine.submit(tokens(60, 8), 3)
    engine.step()
    engine.step()
    return [req]


def first_speculative_decode(engine: Engine) -> list[Request]:
    """An 8-token prompt prefilled at step 0; step 1 drafts and verifies positions 8-11 (k = 3)."""
    req = engine.submit(tokens(70, 8), 8)
    engine.step()
    engine.step()
    return [req]


def one_page_prefix(engine: Engine) -> list[Request]:
    """Pages of 4 tokens. A 12-token prompt finishes at steps 0-1, its 12 KV tokens cached in pages
    1-3 (slots 4-15). At step 2 a request is prefilled whose cached prefix is exactly one page (the
    prompt's first 4 tokens, then tokens of its own); at step 3 one that reads the whole cached
    prompt."""
    first = run_until_finished(engine, tokens(80, 11), 2)
    one_page = engine.submit(first.prompt_ids[:4] + tokens(81, 6), 3)
    engine.step()
    reader = engine.submit(first.token_ids[:12] + tokens(82, 3), 3)
    engine.step()
    return [one_page, reader]


def host_reload(engine: Engine) -> list[Request]:
    """Pages of 4 tokens, a device pool of 11 pages and a host tier of 6. Prompts A, B, C, D of 20
    tokens (5 pages) run one after another: C pushes A to host memory, D pushes B there (A's host
    copy dropped for room, A leaving the tree). At the last step A's prompt comes back."""
    prompts = [tokens(90 + i, 20) for i in range(4)]
    for prompt in prompts:
        run_until_finished(engine, prompt, 1)
    again = engine.submit(prompts[0] + tokens(95, 1), 2)
    engine.step()
    return [again]


def retraction_under_speculation(engine: Engine) -> list[Request]:
    """Speculative decoding (k = 3) of three prompts in a pool too small for all of them: runs until
    the scheduler retracted a request that had decoded tokens of its own, then until that request
    is prefilled again (its prompt cached, what it decoded computed anew)."""
    reqs = [engine.submit(tokens(100 + i, 8), 16) for i in range(3)]
    scheduler = engine.scheduler
    for _ in range(100):
        retracted = scheduler.num_retracted
        engine.step()
        if scheduler.num_retracted > retracted and len(scheduler.waiting[0].output_ids) > 1:
            break
    victim = scheduler.waiting[0]
    while victim.row < 0:
        engine.step()
    return [r for r in reqs if r.row >= 0]


@dataclass(frozen=True)
class Scenario:
    """A workload and the engine (attention, EngineConfig fields) and canary settings it runs with."""

    workload: Callable[[Engine], list[Request]]
    attention: str = "mha"
    engine: dict = field(default_factory=dict)
    canary: dict = field(default_factory=dict)

    def run(self) -> tuple[Engine, CanaryRuntime, list[Request]]:
        """A fresh engine with the canary attached, through the workload."""
        engine = make_engine(self.attention, **self.engine)
        runtime = attach_canary(engine, **self.canary)
        return engine, runtime, self.workload(engine)


SCENARIOS = {
    "wrapped pool, padded decode": Scenario(wrapped_pool, engine={"num_slots": 48, "decode_mode": "padded"}),
    "reuse after finish": Scenario(reuse_after_finish, engine={"num_slots": 22}),
    "swa prefill": Scenario(one_prefill, "swa"),
    "same prompt, two contexts": Scenario(same_prompt_two_contexts, canary={"check_tokens": False}),
    "padded decode": Scenario(padded_decode, engine={"decode_mode": "padded"}),
    "swa long decode": Scenario(long_decode, "swa"),
    "first decode": Scenario(first_decode),
    "first speculative decode": Scenario(first_speculative_decode, engine={"speculative_k": 3}),
    "one-page prefix": Scenario(one_page_prefix, engine={"page_size": 4}),
    "host page loaded back": Scenario(host_reload, engine={"page_size": 4, "num_slots": 48, "max_running": 2,
                                                           "host_num_slots": 24}),
    "retraction under speculation": Scenario(retraction_under_speculation, engine={
        "speculative_k": 3, "num_slots": 48}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_workload_without_the_bug_is_clean(name):
    """What every bug test below measures is clean without the bug: the KV each running request
    reads equals a no-cache forward's, the workload then runs to completion with every output the
    no-cache greedy token, and the canary reports nothing."""
    engine, runtime, reqs = SCENARIOS[name].run()
    assert all(kv_off_reference(engine, r) == set() for r in engine.running)
    while engine.scheduler.has_work:
        engine.step()
    assert not any(off_greedy_reference(engine, r) for r in reqs)
    assert first_reports(runtime) == (None, set())
    assert runtime.health_problems() == []


# ---- 1. damage done inside a forward -------------------------------------------------------------


def padding_lane_slot_index_minus_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A padding lane's slot index is -1 ("no slot") and the store does not skip it: its K/V land
    in the pool's last slot, before the batch's attention reads the pool."""
    store_and_attend = PaddedDecodeKV.__call__

    def call(self, layer, q, k, v, window):
        lanes = ~self.valid
        if lanes.any():
            buf = self.pools.layer(layer)
            buf.k[-1], buf.v[-1] = k[lanes][-1], v[lanes][-1]
        return store_and_attend(self, layer, q, k, v, window)

    monkeypatch.setattr(PaddedDecodeKV, "__call__", call)


def padding_lanes_not_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store treats padding lanes as real ones: each writes the slot its mapping row (row 0,
    which no request holds any more) still lists for position 0, a stale entry."""
    init = PaddedDecodeKV.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.valid = torch.ones_like(self.valid)

    monkeypatch.setattr(PaddedDecodeKV, "__init__", __init__)


@pytest.mark.parametrize(("bug", "victim", "position"), [
    (padding_lane_slot_index_minus_1, lambda engine: engine.pools.full.num_slots - 1, 6),
    (padding_lanes_not_masked, lambda engine: int(engine.req_to_token_pool.table[0, 0]), 7),
], ids=["slot index -1", "stale mapping row"])
def test_a_padding_lane_writing_a_live_slot_is_reported_by_the_recheck_of_that_forward(monkeypatch, bug, victim,
                                                                                      position):
    bug(monkeypatch)
    engine, runtime, reqs = SCENARIOS["wrapped pool, padded decode"].run()
    slot = victim(engine)
    assert owner_of(engine, slot) == (reqs[0], position)
    # The damaged slot and, read by the same forward, the KV that forward wrote for the new token.
    assert kv_off_reference(engine, reqs[0]) == {("FULL", position), ("FULL", reqs[0].kv_len - 1)}
    assert all(kv_off_reference(engine, r) == set() for r in reqs[1:])
    assert first_reports(runtime) == (2, reports(BOTH, ("RECHECK",), "FULL", ("verify_real_kv_hash",),
                                                 [(slot, position, reqs[0].row)]))


def finish_frees_what_the_cache_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished request's own slots are freed after the radix cache took them over: they are
    cached and free at once, and the allocator hands them to another request."""
    finish = Scheduler.finish

    def finish_and_free(self, req):
        own = self.req_to_token.read(req.row, req.prefix_len, req.kv_len)
        finish(self, req)
        self.pools.free(own, "request finished")

    monkeypatch.setattr(Scheduler, "finish", finish_and_free)


def test_a_slot_owned_by_two_requests_is_reported_by_the_recheck_of_the_forward_both_use_it(monkeypatch):
    finish_frees_what_the_cache_took(monkeypatch)
    engine, runtime, (reader, writer) = SCENARIOS["reuse after finish"].run()
    table = engine.req_to_token_pool.table
    shared = table[reader.row, 10:12].tolist()  # the slots of the finished request's decoded tokens
    assert shared == table[writer.row, 6:8].tolist()  # ... which the writer was given as well
    assert {("FULL", 10), ("FULL", 11)} <= kv_off_reference(engine, reader)
    assert kv_off_reference(engine, writer) == set()
    assert first_reports(runtime) == (3, reports(BOTH, ("RECHECK",), "FULL", ("verify_real_kv_hash",),
                                                 [(shared[0], 10, reader.row), (shared[1], 11, reader.row)]))


# ---- 2. a forward writing its own new KV to the wrong place ------------------------------------


def windowed_store_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The windowed layers' store index is off by one when a forward writes several tokens: token
    i's K/V land in token i+1's slot, the last token's in the first one's."""
    store_and_attend = PagedKV.__call__

    def call(self, layer, q, k, v, window):
        loc = self.out_cache_loc
        if window is not None and loc.numel() > 1:
            self.out_cache_loc = loc.roll(-1)
        try:
            return store_and_attend(self, layer, q, k, v, window)
        finally:
            self.out_cache_loc = loc

    monkeypatch.setattr(PagedKV, "__call__", call)


def test_kv_stored_in_the_neighbouring_slot_fails_the_write_through_check_at_tail(monkeypatch):
    windowed_store_off_by_one(monkeypatch)
    engine, runtime, (req,) = SCENARIOS["swa prefill"].run()
    assert {("SWA", p) for p in range(6, 10)} <= kv_off_reference(engine, req)
    full_slots = engine.req_to_token_pool.table[req.row, :10]
    swa_slots = engine.pools.swa.full_to_swa[full_slots].tolist()
    assert first_reports(runtime) == (0, reports(BOTH, ("TAIL",), "SWA", ("write_real_kv_hash",),
                                                 [(s, p, req.row) for p, s in enumerate(swa_slots)]))


# ---- 3. a cache hit across contexts ----------------------------------------------------------------


def radix_key_ignores_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every context looks its prompts up in one tree: equal tokens hit across contexts."""
    root = RadixCache.root
    monkeypatch.setattr(RadixCache, "root", lambda self, context=0: root(self, 0))


def test_a_cache_hit_across_contexts_fails_the_chain_at_position_0_before_the_forward(monkeypatch):
    radix_key_ignores_the_context(monkeypatch)
    engine, runtime, (req,) = SCENARIOS["same prompt, two contexts"].run()
    assert {("FULL", p) for p in range(11)} <= kv_off_reference(engine, req)  # context 7's KV
    head = int(engine.req_to_token_pool.table[req.row, 0])
    assert first_reports(runtime) == (1, reports(BOTH, ("HEAD", "RECHECK"), "FULL", ("verify_chain_hash",),
                                                 [(head, 0, req.row)]))


# ---- 4. the reserved slot ----------------------------------------------------------------------------


def padding_lanes_write_garbage_into_slot_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store does not keep padding lanes out of their slot, 0, and their K/V are garbage (the
    uninitialised lanes of a padded batch; NaN here). Every lane gathers slot 0 under its mask."""
    store_and_attend = PaddedDecodeKV.__call__

    def call(self, layer, q, k, v, window):
        lanes = ~self.valid
        if lanes.any():
            buf = self.pools.layer(layer)
            garbage = torch.full_like(k[0], float("nan"))
            buf.k[0], buf.v[0] = garbage, garbage
        return store_and_attend(self, layer, q, k, v, window)

    monkeypatch.setattr(PaddedDecodeKV, "__call__", call)


def test_a_padding_write_into_the_reserved_slot_is_reported_by_the_recheck_of_that_forward(monkeypatch):
    padding_lanes_write_garbage_into_slot_0(monkeypatch)
    engine, runtime, reqs = SCENARIOS["padded decode"].run()
    assert all(off_greedy_reference(engine, r) for r in reqs)  # NaN under the mask poisons every lane
    assert first_reports(runtime) == (1, reports(BOTH, ("RECHECK",), "FULL", ("reserved_slot_written",),
                                                 [(0, -1, -1)]))


# ---- 5. a hole inside a read window ---------------------------------------------------------------------


def window_slides_one_position_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler frees the windowed layers' slots up to kv_len - window + 1: the slot of the
    position the next window starts at is freed one forward too early."""
    slide = Scheduler._slide_window

    def slide_early(self, req):
        self.radix_cache.window -= 1
        try:
            slide(self, req)
        finally:
            self.radix_cache.window += 1

    monkeypatch.setattr(Scheduler, "_slide_window", slide_early)


def test_a_slot_freed_inside_the_window_is_a_missing_slot_before_the_forward_reads_it(monkeypatch):
    window_slides_one_position_early(monkeypatch)
    engine, runtime, (req,) = SCENARIOS["swa long decode"].run()
    assert kv_off_reference(engine, req) == {("SWA", 6)}  # step 5 would read slot 0 for position 6
    assert first_reports(runtime) == (None, set())
    engine.step()
    assert first_reports(runtime) == (5, reports(BOTH, ("HEAD", "RECHECK"), "SWA", ("verify_missing_slot",),
                                                 [(0, 6, req.row)]))


# ---- 6. write_token ---------------------------------------------------------------------------------------


def decode_feeds_the_previous_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch's input is the token before each request's newest one (an input buffer not
    updated with the last sample), while the engine's bookkeeping holds the newest."""
    make_batch = Scheduler._batch

    def batch(self, reqs, locs, is_prefill):
        made = make_batch(self, reqs, locs, is_prefill)
        if is_prefill:
            return made
        stale = [r.token_ids[r.kv_len - 1] for r in reqs]
        return made._replace(input_ids=torch.tensor(stale, dtype=torch.int64))

    monkeypatch.setattr(Scheduler, "_batch", batch)


def test_a_forward_fed_another_token_than_the_engine_holds_is_a_write_token_at_tail(monkeypatch):
    decode_feeds_the_previous_token(monkeypatch)
    engine, runtime, (req,) = SCENARIOS["first decode"].run()
    fed, held = req.token_ids[7], req.token_ids[8]
    assert fed != held
    assert kv_off_reference(engine, req) == {("FULL", 8)}
    slot = int(engine.req_to_token_pool.table[req.row, 8])
    assert first_reports(runtime) == (1, reports(BOTH, ("TAIL",), "FULL", ("write_token",), [(slot, 8, req.row)]))
    assert {(v.stored, v.expected) for v in runtime.log.violations} == {(fed, held)}


# ---- 7. a draft forward at the wrong position --------------------------------------------------------


def draft_runs_one_position_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft's decode forwards run at the position after the one whose slot they write (SGLang
    #25015: the draft's positions advanced before each draft forward instead of after it): position
    p's draft KV is computed at p + 1, into p's slot."""
    step_positions = Drafter.step_positions
    monkeypatch.setattr(Drafter, "step_positions",
                        lambda self, positions, index: step_positions(self, positions, index) + 1)


def test_a_draft_forward_at_the_next_position_is_a_write_position_at_tail_of_that_forward(monkeypatch):
    draft_runs_one_position_ahead(monkeypatch)
    engine, runtime, (req,) = SCENARIOS["first speculative decode"].run()
    kept = range(8, req.kv_len)  # the positions step 1 wrote and kept: at least its first, 8
    # The draft's KV is off where it wrote, the target's is not; the target verifies every
    # proposal, so the outputs stay the no-cache greedy tokens: only the canary sees it.
    assert kv_off_reference(engine, req) == {("DRAFT", p) for p in kept}
    assert not off_greedy_reference(engine, req)
    written = engine.req_to_token_pool.table[req.row, 8:12].tolist()  # rejected ones' entries stay
    assert first_reports(runtime) == (1, reports(BOTH, ("TAIL",), "DRAFT", ("write_position",),
                                                 [(slot, 8 + j, req.row) for j, slot in enumerate(written)]))
    assert {(v.stored, v.expected) for v in runtime.log.violations if v.step == 1} == {(p + 1, p) for p in range(8, 12)}


# ---- 8. a page-aligned prefix handled as a partial page (SGLang #22819-like) ---------------------------


def aligned_prefix_continues_in_the_next_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose KV ends on a page boundary (a cached prefix of exactly one page, say) is
    treated as having a partial page open: its next positions are given the slots after the last
    prefix slot, which are the next page's, another owner's."""
    def slots(self, req, n, pages):
        ps = self.pools.page_size
        if req.kv_len % ps or not req.kv_len:
            return slots_of_the_last_page_first(self, req, n, pages)
        last = int(self.req_to_token.read(req.row, req.kv_len - 1, req.kv_len)[0])
        return torch.cat([torch.arange(last + 1, last + 1 + ps), page_slots(pages, ps)])[:n]

    slots_of_the_last_page_first = Scheduler._slots
    monkeypatch.setattr(Scheduler, "_slots", slots)


def test_a_page_aligned_prefix_writing_the_next_page_is_reported_before_a_reader_of_that_page(monkeypatch):
    """The one-page prefix's request writes its positions 4-7 over the cached page of the first
    prompt's positions 4-7 (stamping them as its own): the next request reading that page is
    reported at HEAD, before its forward reads it (every cached prefix ends on a page boundary, so
    its own new positions go astray too, after its HEAD)."""
    aligned_prefix_continues_in_the_next_page(monkeypatch)
    engine, runtime, (one_page, reader) = SCENARIOS["one-page prefix"].run()
    table = engine.req_to_token_pool
    spilled = table.read(one_page.row, 4, 8).tolist()
    assert spilled == table.read(reader.row, 4, 8).tolist() == [8, 9, 10, 11]  # the cached page of positions 4-7
    assert {("FULL", p) for p in range(4, 8)} <= kv_off_reference(engine, reader)
    # Its records say the other request's tokens, and the chain breaks where the page after begins.
    next_slot = int(table.read(reader.row, 8, 9)[0])
    places = [(slot, 4 + i, reader.row) for i, slot in enumerate(spilled)]
    assert first_reports(runtime) == (3, reports(BOTH, ("HEAD", "RECHECK"), "FULL", ("verify_token",), places)
                                      | reports(BOTH, ("HEAD", "RECHECK"), "FULL", ("verify_chain_hash",),
                                                [(next_slot, 8, reader.row)]))


# ---- 9. a host page loaded back after its host copy was freed and reused (SGLang #13483, #26728-like) --


def host_copy_freed_but_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making room in host memory frees a device-evicted leaf's host pages but leaves the node in
    the tree with them: the next write-back takes those pages for another node, and a hit on the
    stale node loads that node's KV back."""
    def evict_host(self, n):
        leaves = sorted((x for x in self._nodes() if x.value is None and not x.children and not x.lock_ref),
                        key=lambda x: (x.last_access, int(x.host_value[0])))
        for node in leaves:
            if self.host_tier.free_pages.numel() >= n:
                break
            self.host_tier.free(self._pages(node.host_value), CAUSE_HOST_EVICTED)

    monkeypatch.setattr(LowerTiers, "_evict_host", evict_host)


def test_a_host_page_reused_before_its_load_back_is_reported_before_the_forward_reads_it(monkeypatch):
    host_copy_freed_but_kept(monkeypatch)
    engine, runtime, (req,) = SCENARIOS["host page loaded back"].run()
    loaded = range(20)  # the 5 pages of A's prompt, loaded back from host memory
    slots = engine.req_to_token_pool.read(req.row, 0, 20).tolist()
    damaged = {("FULL", p) for p in loaded} & kv_off_reference(engine, req)
    assert len(damaged) >= 16  # at least 4 of the 5 host pages held B's KV by then
    step, found = first_reports(runtime)
    assert step == engine.forward_count - 1
    assert {(phase, half, slot, position, row) for phase, half, _, _, slot, position, row in found} == {
        (phase, half, slots[p], p, req.row) for phase in ("HEAD", "RECHECK") for half in BOTH for _, p in damaged}
    assert set().union(*(reasons for *_, reasons, _, _, _ in found)) <= {
        "verify_position", "verify_token", "verify_chain_hash"}


# ---- 10. a retracted speculative request re-prefilled with its draft KV at stale positions (SGLang #28254-like)


def retracted_draft_positions_not_reset(monkeypatch: pytest.MonkeyPatch) -> dict[int, tuple[int, int, int]]:
    """The draft keeps a position counter per request that retraction does not reset: when a
    retracted request is prefilled again, its draft runs the re-prefilled tokens at positions
    continuing from where its KV ended when it was retracted. Returns, per request it misplaced,
    (prefix length, tokens, shift) of that prefill."""
    stale: dict[int, int] = {}
    misplaced: dict[int, tuple[int, int, int]] = {}
    retract, prefill_positions = Scheduler._retract, Drafter.prefill_positions

    def retract_keeping_the_counter(self, req, *args, **kwargs):
        stale[req.rid] = req.kv_len
        retract(self, req, *args, **kwargs)

    def stale_positions(self, batch, positions):
        out = prefill_positions(self, batch, positions).clone()
        start = 0
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            if req.rid in stale:
                misplaced[req.rid] = (prefix, extend, stale.pop(req.rid) - prefix)
                out[start:start + extend] += misplaced[req.rid][2]
            start += extend
        return out

    monkeypatch.setattr(Scheduler, "_retract", retract_keeping_the_counter)
    monkeypatch.setattr(Drafter, "prefill_positions", stale_positions)
    return misplaced


def test_a_re_prefilled_draft_at_stale_positions_is_a_write_position_at_tail_of_that_forward(monkeypatch):
    misplaced = retracted_draft_positions_not_reset(monkeypatch)
    engine, runtime, reqs = SCENARIOS["retraction under speculation"].run()
    ((rid, (prefix, extend, shift)),) = misplaced.items()
    (req,) = [r for r in reqs if r.rid == rid]
    assert shift > 0
    # The draft's KV of the re-prefilled positions is off (the target's is not; it verifies every
    # proposal, so only the canary sees it).
    assert kv_off_reference(engine, req) == {("DRAFT", p) for p in range(prefix, prefix + extend)}
    slots = engine.req_to_token_pool.read(req.row, prefix, prefix + extend).tolist()
    assert first_reports(runtime) == (engine.forward_count - 1, reports(
        BOTH, ("TAIL",), "DRAFT", ("write_position",), [(slot, prefix + j, req.row) for j, slot in enumerate(slots)]))
    assert {v.stored - v.expected for v in runtime.log.violations} == {shift}
