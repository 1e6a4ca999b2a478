"""Recurrent-state bug classes of hybrid models, reintroduced into the reference engine's real code
paths: the scheduler's batch, the radix cache's checkpoint eviction and its checkpoint bookkeeping.

Each test patches one mechanism, runs a workload up to the forward that starts from a wrong state,
proves the damage without the canary (the state the request holds after that forward against a
scan of its tokens from nothing), and checks that the canary's first report names the request's
state slot, its prefix length and row, with the right reason, at the HEAD of that forward. The
same workloads without the patches are clean (test_state_workload_without_the_bug_is_clean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.reference_engine import Engine, Request
from pytest_kvcanary.reference_engine.model import DenseState, RecurrentMixer
from pytest_kvcanary.reference_engine.radix_cache import RadixCache
from pytest_kvcanary.reference_engine.scheduler import Scheduler

from scenario_support import attach_canary, first_reports, make_engine, off_greedy_reference, tokens

CHAIN = ("verify_chain_hash",)


class _RecordingState(DenseState):
    """No cache, keeping each recurrent layer's state after the whole sequence."""

    def __init__(self) -> None:
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
        zeros = u.new_zeros(mixer.width - 1, mixer.channels), u.new_zeros(mixer.heads, mixer.dim, mixer.dim)
        gated, end, _ = mixer.scan(u.float(), *zeros)
        self.states[mixer.layer] = end
        return gated


@torch.no_grad()
def state_is_off(engine: Engine, req: Request) -> bool:
    """True when the state in the request's slot (what its next forward starts from) is not the
    state a scan of its kv_len tokens from nothing computes. Independent of the canary."""
    n = req.kv_len
    positions = torch.arange(n, device=engine.device)
    recording = _RecordingState()
    engine.model(torch.tensor(req.token_ids[:n], device=engine.device), positions, _no_kv,
                 torch.full_like(positions, req.context_key), recording)
    for layer, (conv, ssm) in recording.states.items():
        pool_conv, pool_ssm = engine.states.layer(layer)
        if not (torch.allclose(pool_conv[req.state_slot], conv, rtol=1e-3, atol=1e-4)
                and torch.allclose(pool_ssm[req.state_slot], ssm, rtol=1e-3, atol=1e-4)):
            return True
    return False


def _no_kv(layer, q, k, v, window):  # the full-attention layers of a no-cache run see their own tokens
    from pytest_kvcanary.reference_engine.attention import attend
    positions = torch.arange(q.shape[0], device=q.device)
    return attend(q, k, v, positions, positions, window)


def run_until_finished(engine: Engine, prompt: list[int], max_new_tokens: int) -> Request:
    req = engine.submit(prompt, max_new_tokens)
    while not req.finished:
        engine.step()
    return req


# ---- workloads: each runs up to just after the forward that starts from the wrong state -----


def repeat_after_a_batch(engine: Engine) -> list[Request]:
    """Two prompts prefilled in one batch (step 0) write a checkpoint each; both finish. A third
    request repeats the second prompt and restores its checkpoint (the next step)."""
    prompts = [tokens(200, 12), tokens(201, 10)]
    reqs = [engine.submit(p, 2) for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
    again = engine.submit(prompts[1], 2)
    engine.step()
    return [again]


def a_b_a_under_state_pressure(engine: Engine) -> list[Request]:
    """A state pool of 5 slots (4 usable) and 2 rows: A finishes, its checkpoint cached; B, C and D
    run one after another, each leaving a checkpoint, so admitting D evicts A's. A's prompt then
    comes back (the next step)."""
    a = tokens(210, 12)
    run_until_finished(engine, a, 2)
    for i in range(3):
        run_until_finished(engine, tokens(211 + i, 11), 2)
    again = engine.submit(a, 2)
    engine.step()
    return [again]


def prompt_then_longer(engine: Engine) -> list[Request]:
    """A 12-token prompt finishes (its checkpoint after 11 tokens cached); a request whose prompt
    runs on past it is prefilled from the longest checkpoint its prefix has (the next step)."""
    first = run_until_finished(engine, tokens(220, 12), 2)
    longer = engine.submit(first.prompt_ids + tokens(221, 4), 2)
    engine.step()
    return [longer]


def speculate_until_a_rejection(engine: Engine) -> list[Request]:
    """A prompt finishes (its checkpoint cached); it comes back, restores the checkpoint and decodes
    with k = 3 proposals a step until the target rejects one, then runs one more forward (which
    starts from the state the rollback kept)."""
    prompt = tokens(230, 12)
    run_until_finished(engine, prompt, 2)
    again, drafter = engine.submit(prompt, 24), engine.drafter
    while not again.finished:
        rejected = drafter.proposed - drafter.accepted
        engine.step()
        if drafter.proposed - drafter.accepted > rejected:
            break
    assert not again.finished, "the target accepted every proposal"
    engine.step()
    return [again]


@dataclass(frozen=True)
class Scenario:
    workload: Callable[[Engine], list[Request]]
    engine: dict

    def run(self) -> tuple[Engine, CanaryRuntime, list[Request]]:
        engine = make_engine("hybrid", **self.engine)
        runtime = attach_canary(engine)
        return engine, runtime, self.workload(engine)


SCENARIOS = {
    "repeat after a batch": Scenario(repeat_after_a_batch, {}),
    "A -> B -> A under state pressure": Scenario(a_b_a_under_state_pressure, {"max_running": 2, "num_state_slots": 5}),
    "prompt, then a longer one": Scenario(prompt_then_longer, {}),
    "speculate until a rejection": Scenario(speculate_until_a_rejection, {"speculative_k": 3, "draft_layers": 2}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_state_workload_without_the_bug_is_clean(name):
    """Without a bug each running request's state is the scan of its tokens, a checkpoint was
    restored, the workload runs to completion with every output the no-cache greedy token, and the
    canary reports nothing."""
    engine, runtime, reqs = SCENARIOS[name].run()
    assert all(r.prefix_len > 0 for r in reqs), "the workload restored no checkpoint"
    assert not any(state_is_off(engine, r) for r in engine.running)
    while engine.scheduler.has_work:
        engine.step()
    assert not any(off_greedy_reference(engine, r) for r in reqs)
    assert first_reports(runtime) == (None, set())


def _expect_head(runtime: CanaryRuntime, engine: Engine, req: Request, prefix: int, reasons: tuple[str, ...]) -> None:
    """The canary's first reports: the HEAD of the forward that just ran names the request's state
    slot at the prefix length it was restored at, on its row."""
    step, found = first_reports(runtime)
    assert step == engine._steps - 1
    assert ("HEAD", "K", "STATE", reasons, req.state_slot, prefix, req.row) in found, found


def test_a_checkpoint_the_batch_never_wrote_is_restored(monkeypatch):
    """SGLang #39342: in a batch of several prefills, the forward writes only the first request's
    checkpoint, yet each request's checkpoint slot joins the radix cache. A later hit restores a
    slot that was never written for its prefix (here a fresh one: zeros, and a zero record)."""
    batch = Scheduler._batch

    def first_checkpoint_only(self, reqs, locs, is_prefill):
        out = batch(self, reqs, locs, is_prefill)
        dropped = [s if i == 0 else [] for i, s in enumerate(out.checkpoint_slots)]
        return out._replace(checkpoint_slots=dropped)

    monkeypatch.setattr(Scheduler, "_batch", first_checkpoint_only)
    engine, runtime, (again,) = SCENARIOS["repeat after a batch"].run()
    assert state_is_off(engine, again)
    _expect_head(runtime, engine, again, len(again.prompt_ids) - 1,
                 ("verify_position", "verify_chain_hash", "verify_real_kv_hash"))


def test_an_evicted_checkpoint_left_in_the_tree_is_restored(monkeypatch):
    """vLLM #50630's pattern, A -> B -> A: evicting checkpoints frees their slots but leaves the
    nodes pointing at them; a later request's state takes the slot, and A's return restores that
    request's state as its own."""
    def free_but_keep(self, n):
        nodes = sorted((self._lru_key(x) for x in self._nodes() if x.state is not None and not x.lock_ref),
                       key=lambda key: key[:2])[:n]
        self.states.free([node.state for *_, node in nodes], "checkpoint evicted")
        return len(nodes)

    monkeypatch.setattr(RadixCache, "evict_states", free_but_keep)
    engine, runtime, (again,) = SCENARIOS["A -> B -> A under state pressure"].run()
    assert state_is_off(engine, again)
    step, found = first_reports(runtime)
    assert step == engine._steps - 1
    assert any(f[:3] == ("HEAD", "K", "STATE") and f[4:] == (again.state_slot, len(again.prompt_ids) - 1, again.row)
               and set(f[3]) & {"verify_chain_hash", "verify_position"} for f in found), found


def test_a_checkpoint_filed_one_token_too_deep_is_restored(monkeypatch):
    """vLLM #47728's class, an optimistic token count: the radix cache files each checkpoint one
    token past the state it holds, so a request whose prompt runs on restores a state one token
    short and never folds that token in."""
    insert = RadixCache._insert_req

    def one_too_deep(self, req):
        if req.checkpoint is not None:
            slot, length = req.checkpoint
            req.checkpoint = (slot, length + 1)
        return insert(self, req)

    monkeypatch.setattr(RadixCache, "_insert_req", one_too_deep)
    engine, runtime, (longer,) = SCENARIOS["prompt, then a longer one"].run()
    assert state_is_off(engine, longer)
    _expect_head(runtime, engine, longer, 12, ("verify_position", "verify_chain_hash"))


def test_a_speculative_decode_that_keeps_the_state_after_every_proposal(monkeypatch):
    """vLLM #53912's class (speculative decoding on a hybrid model corrupts output): the rollback
    frees the rollback states but keeps the running one, the state after every proposal, rejected
    ones included. The next forward starts from a state of a longer prefix, with tokens the
    request never had."""
    def keep_everything(self, req, kept, n):
        self.states.free(req.rollback_slots[:n], "speculative state rolled back")
        req.rollback_slots = req.rollback_slots[n:]

    monkeypatch.setattr(Scheduler, "_roll_back_state", keep_everything)
    engine, runtime, (again,) = SCENARIOS["speculate until a rejection"].run()
    assert state_is_off(engine, again)
    step, found = first_reports(runtime)
    assert step == engine._steps - 1
    # the last forward's HEAD, at its prefix: past the prompt, short of the tokens it then kept
    assert any(f[:3] == ("HEAD", "K", "STATE") and f[4] == again.state_slot and f[6] == again.row
               and len(again.prompt_ids) < f[5] < again.kv_len and "verify_position" in f[3] for f in found), found
