"""Speculative decoding: greedy outputs equal plain decoding with the canary on and clean over the
target and draft pools; rollback bugs reintroduced into the engine are reported at the right slot."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvcanary_kernels.records import GroupKind, Half
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, Request
from pytest_kvcanary.reference_engine.scheduler import Scheduler
from pytest_kvcanary.reference_engine.speculative import Drafter

KERNELS = "triton" if torch.cuda.is_available() else "torch"
ROLLBACK = "rejected draft position rolled back"


def attach(engine: Engine) -> CanaryRuntime:
    """Every check on (tokens, write inputs, recheck, write-through, real-KV fingerprints over whole
    slots) and a sweep every 3 forwards."""
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=3, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    return runtime


def workload(engine: Engine, seed: int, n: int = 16) -> list[Request]:
    """n requests over 3 shared stems, arriving a few at a time, 2-14 new tokens each."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 256) for _ in range(rng.randrange(6, 14))] for _ in range(3)]
    reqs = []
    while len(reqs) < n:
        for _ in range(rng.randrange(1, 4)):
            prompt = rng.choice(stems) + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 8))]
            reqs.append(engine.submit(prompt, rng.randrange(2, 15)))
        engine.step()
    while engine.scheduler.has_work:
        engine.step()
    return reqs


def run_until_reported(engine: Engine, runtime: CanaryRuntime, prompts: list[list[int]]) -> None:
    """Decode 10 tokens of each prompt, stopping after the first forward the canary reports on."""
    for prompt in prompts:
        engine.submit(prompt, 10)
    while not runtime.drain() and engine.scheduler.has_work:
        engine.step()


SHORT_PROMPTS = [list(b"speculate, then roll back %d" % i) for i in range(3)]
_rng = random.Random(0)
TIGHT_PROMPTS = [[_rng.randrange(1, 256) for _ in range(_rng.randrange(4, 12))] for _ in range(12)]


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_equal_plain_decoding_with_the_canary_clean(k, attention, make_engine, check_invariants):
    plain = [r.output_ids for r in workload(make_engine(attention, num_slots=72, max_running=5), seed=k)]
    engine = make_engine(attention, num_slots=72, max_running=5, speculative_k=k)
    runtime = attach(engine)
    causes: Counter[str] = Counter()
    engine.add_free_listener(lambda group, slots, cause: causes.update([(group, cause)]))
    assert [g.pool.kind for g in runtime.groups] == [GroupKind.FULL, GroupKind.DRAFT]
    assert set(runtime.group(GroupKind.DRAFT).halves) == ({Half.K} if attention == "mla" else {Half.K, Half.V})

    assert [r.output_ids for r in workload(engine, seed=k)] == plain
    check_invariants(engine)
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == [] and runtime.sweeps > 0
    drafter = engine.drafter
    assert 0 < drafter.accepted < drafter.proposed, (drafter.accepted, drafter.proposed)
    assert causes[(GroupKind.FULL, ROLLBACK)] == causes[(GroupKind.DRAFT, ROLLBACK)] > 0
    assert engine.radix_cache.num_evicted > 0 and engine.scheduler.num_retracted > 0
    assert engine.forward_count < make_engine(attention).forward_count + sum(len(p) for p in plain)


def test_a_rejected_draft_position_left_mapped_is_reported_by_the_token_check(make_engine, monkeypatch):
    """The bug: every proposal is kept, rejected ones included (their KV stays mapped as the
    request's), while the request's tokens are the target's predictions. The next forward's HEAD
    reports verify_token at the slot of the first rejected position."""
    engine = make_engine("mha", speculative_k=3)
    runtime = attach(engine)
    kept: list[tuple[int, int, int]] = []  # (row, position, FULL slot) of each first rejected position
    accept = Drafter.accept

    def accept_all(self, batch, input_ids, predicted):
        good = accept(self, batch, input_ids, predicted)
        out, t = [], 0
        for req, extend, tokens in zip(batch.reqs, batch.extend_lens, good):
            if len(tokens) < extend:
                position = req.kv_len + len(tokens)
                kept.append((req.row, position, int(engine.req_to_token_pool.table[req.row, position])))
            out.append(predicted[t:t + extend])
            t += extend
        return out

    monkeypatch.setattr(Drafter, "accept", accept_all)
    run_until_reported(engine, runtime, SHORT_PROMPTS)
    assert kept, "no proposal was rejected"
    first = min(v.step for v in runtime.log.violations)
    reports = {(v.phase, v.group, v.reasons, v.row, v.position, v.slot) for v in runtime.log.violations
               if v.step == first}
    row, position, slot = kept[0]
    assert ("HEAD", "FULL", ("verify_token",), row, position, slot) in reports, reports
    assert {r[2] for r in reports} == {("verify_token",)}


def test_a_slot_freed_while_still_mapped_is_reported_when_reused(make_engine, monkeypatch):
    """The bug: the rollback frees one position too early, the last accepted one, whose slot stays
    in the request's row. The next forward is handed that slot to write while the request still
    reads it there: RECHECK reports the slot, the request's row and position."""
    engine = make_engine("mha", num_slots=48, max_running=4, speculative_k=3)
    runtime = attach(engine)
    freed: dict[int, tuple[int, int]] = {}  # FULL slot -> (row, position) still mapping it

    def roll_back_one_early(self, req, kept, written):
        if kept < written:
            position = req.kv_len + kept - 1
            slots = self.req_to_token.read(req.row, position, req.kv_len + written)
            freed[int(slots[0])] = (req.row, position)
            self.pools.free(slots, ROLLBACK)

    monkeypatch.setattr(Scheduler, "_roll_back", roll_back_one_early)
    run_until_reported(engine, runtime, TIGHT_PROMPTS)
    assert runtime.log.violations, "the bug went unreported"
    first = min(v.step for v in runtime.log.violations)
    hits = {(v.phase, v.reasons, v.slot, v.row, v.position) for v in runtime.log.violations if v.step == first}
    assert hits and all(slot in freed for _, _, slot, _, _ in hits), hits
    assert hits == {("RECHECK", ("verify_real_kv_hash",), slot, *freed[slot]) for _, _, slot, _, _ in hits}


@pytest.mark.parametrize("prompts, pool", [("short", {}), ("tight", {"num_slots": 48, "max_running": 4})])
def test_the_rollback_bug_workloads_are_clean_without_the_bugs(prompts, pool, make_engine):
    engine = make_engine("mha", speculative_k=3, **pool)
    runtime = attach(engine)
    run_until_reported(engine, runtime, SHORT_PROMPTS if prompts == "short" else TIGHT_PROMPTS)
    assert not engine.scheduler.has_work and runtime.log.violations == []
    assert engine.drafter.accepted < engine.drafter.proposed


def test_speculative_decoding_config_errors():
    with pytest.raises(ValueError, match="speculative_k must be an integer >= 0; got -1"):
        EngineConfig(speculative_k=-1)
    with pytest.raises(ValueError, match="speculative_k > 0 needs attention mha, mla or hybrid and decode_mode eager; "
                                         "got attention='mha', decode_mode='padded'"):
        EngineConfig(speculative_k=2, decode_mode="padded")
    with pytest.raises(ValueError, match=r"draft_layers must be an integer in \[1, model.num_layers=4\]; got 5"):
        EngineConfig(speculative_k=2, draft_layers=5)
