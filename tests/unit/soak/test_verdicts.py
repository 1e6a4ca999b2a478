"""Each verdict, from a cause planted in the reference engine's real code paths (and none without
it): a wrong token table (the bookkeeping an adapter keeps; the KV is right) is a suspected false
alarm, shrunk to a replay that still ends in one; K/V damaged after the store is damage the canary
detects, and damage it misses when it fingerprints no real bytes (real_data none)."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine.attention import PagedKV
from pytest_kvcanary.reference_engine.engine import Engine
from pytest_kvcanary.handles.single import EngineHandle
from pytest_kvcanary.soak.runner import geometry
from pytest_kvcanary.soak.verdicts import CLEAN, DETECTED, FALSE_ALARM, MISSED
from pytest_kvcanary.soak.workload import make_workload

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
DAMAGED_POSITION = 3


def start(real_data: str = "partial") -> EngineHandle:
    handle = EngineHandle(make_reference_engine("mha", DEVICE, 0), CanaryConfig(real_data=real_data, kernels=KERNELS))
    handle.reset(0, ())
    return handle


def wrong_token_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table of tokens the canary checks against says another token at position 0 of every
    prompt that starts with an odd token; what the model reads and writes is untouched."""
    note_rows = Engine._note_rows

    def noting(engine, batch):
        note_rows(engine, batch)
        for req in batch.reqs:
            if req.prompt_ids[0] % 2:
                engine.token_table[req.row, 0] = req.prompt_ids[0] ^ 2

    monkeypatch.setattr(Engine, "_note_rows", noting)


def damaged_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 stores the K of position 3 off by one, after the forward read what it computed."""
    attend = PagedKV.__call__

    def storing(kv, layer, q, k, v, window):
        out = attend(kv, layer, q, k, v, window)
        if layer == 0:
            kv.pools.layer(0).k[kv.out_cache_loc[(kv.positions == DAMAGED_POSITION).cpu()]] += 1.0
        return out

    monkeypatch.setattr(PagedKV, "__call__", storing)


def test_a_clean_engine_gets_clean_rounds_under_pressure():
    handle = start()
    result = handle.run_workload(seed=4, rounds=3)
    engine = handle.engine
    assert result.counts()[CLEAN] == 3 and result.forwards > 50 and result.failures == []
    assert engine.radix_cache.num_evicted > 0 and engine.scheduler.num_retracted > 0, "the workload pressed the engine"
    assert handle.soak_results == [result]


def test_pages_a_host_tier_and_retraction_under_speculation_are_clean_under_pressure():
    """Pages of 16 tokens, a host-memory tier behind the radix cache and speculative decoding, on a
    pool the workload outgrows: pages go to the host and come back, running requests are retracted
    and re-prefilled with their draft, and every round is clean."""
    engine = make_reference_engine("mha", DEVICE, 0, page_size=16, host_num_slots=1024, speculative_k=3,
                                   num_slots=512)
    handle = EngineHandle(engine, CanaryConfig(kernels=KERNELS))
    handle.reset(0, ())
    result = handle.run_workload(seed=0, rounds=3)
    assert result.counts()[CLEAN] == 3 and result.forwards > 100, result.summary()
    tier = engine.host_tier
    assert tier.num_written_back > 0 and tier.num_loaded_back > 0 and engine.scheduler.num_retracted > 0


def test_the_longest_request_of_a_workload_fits_the_smallest_pool():
    """An SWA pool smaller than the FULL one, in pages: every request a pressing workload draws is
    one the engine takes (it holds a whole request in each pool; its first page is reserved)."""
    engine = make_reference_engine("swa", DEVICE, 0, page_size=16, num_slots=512, swa_num_slots=256)
    handle = EngineHandle(engine, CanaryConfig(kernels=KERNELS))
    handle.reset(0, ())
    shape = geometry(handle)
    assert shape.max_context == 241 < engine.config.model.max_context
    workload = make_workload(0, 9, shape)
    requests = [q for r in workload.rounds for q in r.requests]
    assert max(q.prompt_len + q.max_new_tokens for q in requests) == shape.max_context
    for q in requests:
        engine.encode_request(workload.prompt(q), q.max_new_tokens)


def test_a_wrong_token_table_is_a_suspected_false_alarm_shrunk_to_a_replay(monkeypatch):
    wrong_token_table(monkeypatch)
    handle = start()
    result = handle.run_workload(seed=1, rounds=2, shrink_trials=16)
    assert result.counts()[FALSE_ALARM] >= 1 and not result.trustworthy
    bad = next(r for r in result.rounds if r.verdict == FALSE_ALARM)
    assert bad.damage == [] and bad.unexplained and all("verify_token" in v or "write_token" in v for v in bad.violations)
    failure = result.failures[0]
    assert failure.reproduced and failure.requests < sum(r.requests for r in result.rounds[:failure.round + 1])
    handle.reset(0, ())
    again = handle.run_workload(replay=failure.replay, shrink_trials=0)
    assert again.rounds[-1].verdict == FALSE_ALARM
    with pytest.raises(AssertionError, match="suspected false alarm") as raised:
        result.assert_trustworthy()
    assert f"run_workload(replay={failure.replay!r})" in str(raised.value)


@pytest.mark.parametrize(("real_data", "verdict"), [("partial", DETECTED), ("none", MISSED)])
def test_kv_damaged_after_the_store_is_damage_the_canary_detects_unless_it_reads_no_bytes(monkeypatch, real_data,
                                                                                         verdict):
    damaged_store(monkeypatch)
    result = start(real_data).run_workload(seed=1, rounds=1, shrink_trials=0)
    rnd = result.rounds[0]
    assert rnd.verdict == verdict and rnd.damage, rnd
    assert (rnd.unexplained > 0) == (verdict == DETECTED)


@pytest.mark.parametrize("jitter_seed", [None, 3])
def test_a_replay_names_the_jitter_seed_its_engine_draws_timings_from(monkeypatch, jitter_seed):
    """A replay reruns only on an engine that meets the same timings: the line names its seed."""
    damaged_store(monkeypatch)
    engine = make_reference_engine("mha", DEVICE, 0, async_scheduling=True, jitter_seed=jitter_seed)
    handle = EngineHandle(engine, CanaryConfig(real_data="none", kernels=KERNELS))
    handle.reset(0, ())
    result = handle.run_workload(seed=1, rounds=1, shrink_trials=0)
    replay = [line for line in result.describe_failures() if "run_workload(replay=" in line]
    assert len(replay) == 1 and result.to_json()["timing"] == ("" if jitter_seed is None else "jitter seed 3")
    assert (", on an engine of jitter seed 3): " in replay[0]) == (jitter_seed is not None), replay
