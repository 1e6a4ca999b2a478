"""A prefill/decode pair across processes (gloo on the CPU): it decodes what one engine does, its
records travel with the KV, each transport defect is reported where it did its damage, a late
transfer aborts its request, a prefill process killed mid-transfer fails the call at once, and the
workload soak drives it from the decode process: clean without faults, and a fault injected on the
prefill side mid-soak detected by the decode side and matched by the ledger.

The pairs are started once per module (process start-up is the cost) and reset before each use;
the kill test starts its own.
"""

from __future__ import annotations

import time

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.handles.pd_processes import PairFailure, start_pd_processes
from pytest_kvcanary.handles.protocol import ArgumentError
from pytest_kvcanary.handles.rank import RankContext
from pytest_kvcanary.soak.verdicts import CLEAN

from test_pd_outputs import mixed_prompts

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU processes (gloo); GPUs run the examples")

CANARY = CanaryConfig(kernels="torch", real_data="all", sweep_interval=0)
# Small pools and few rows: the decode side waits for room, the prefill side evicts.
TIGHT = {"num_slots": 200, "swa_num_slots": 96, "max_running": 3}


@pytest.fixture(scope="module")
def pair():
    handle = start_pd_processes("mha", 0, CANARY, ["cpu"])
    yield handle
    handle.close()


def fresh_prompts(seed: int, n: int, length: int = 24) -> list[list[int]]:
    """n prompts of `length` random tokens, unlike any other test's (stale bytes of the same
    tokens would be the right ones)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(1, 256, (length,), generator=gen).tolist() for _ in range(n)]


def evictions(context: RankContext) -> int:
    return next(iter(context.engines.values())).radix_cache.num_evicted


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_outputs_equal_a_single_engine_under_memory_pressure(attention):
    single = make_reference_engine(attention, "cpu", 0, **TIGHT)
    handle = start_pd_processes(attention, 0, CANARY, ["cpu"], **TIGHT)
    try:
        handle.reset(0, ())
        for seed in (0, 1):
            prompts = mixed_prompts(seed, 8)
            assert handle.generate(prompts, 12) == single.generate(prompts, 12)
        assert handle.violations() == [] and handle.healthy() and handle.transfer_aborts() == []
        _, prefill = handle.call(evictions)  # rank 0 decodes
    finally:
        handle.close()
    assert prefill > 0


def test_stale_bytes_fail_every_slot_of_the_transfer(pair):
    """The records land and the bytes do not: the first transfer's slots (1..L on a reset decode
    side) each fail their fingerprint, and nothing else does."""
    pair.reset(0, ())
    pair.arm_transport_fault("stale_bytes", transfer=0)
    prompts = fresh_prompts(0, 3)
    pair.generate(prompts, 3)
    found = pair.violations()
    assert {(v.side, v.phase, v.reasons) for v in found} == {("decode", "HEAD", ("verify_real_kv_hash",))}
    assert {(v.slot, v.position) for v in found} == {(p + 1, p) for p in range(len(prompts[0]))}


def test_logical_ids_send_the_previous_position_to_every_slot(pair):
    """Logical block p is physical slot p on the prefill side, which holds position p - 1 of the
    first request (its slots are 1..L there too): each position's record names the one before."""
    pair.reset(0, ())
    pair.arm_transport_fault("logical_ids", transfer=0)
    prompts = fresh_prompts(1, 3)
    pair.generate(prompts, 3)
    found = [v for v in pair.violations() if v.phase == "HEAD"]
    assert {v.side for v in found} == {"decode"} and {v.row for v in found} == {0}
    shifted = {(v.position, v.stored, v.expected) for v in found if v.reasons[0] == "verify_position"}
    assert shifted == {(p, p - 1, p) for p in range(1, len(prompts[0]))}


def test_a_late_transfer_aborts_only_its_request(pair):
    """The first transfer arrives after the decode side gave up on it: that request keeps the
    prefill's token only, the others decode as one engine does, and the late bytes land nowhere
    (its slots stay held until they drained), also when the next batch takes slots meanwhile."""
    prompts = fresh_prompts(2, 12)
    expected = make_reference_engine("mha", "cpu", 0).generate(prompts, 4)
    pair.reset(0, ())
    pair.set_transfer_timeout(0.5)
    pair.arm_transport_fault("late_transfer", transfer=0)
    outputs = pair.generate(prompts, 4)
    (aborted,) = pair.transfer_aborts()
    assert "transfer 0 timed out after 0.5 s" == aborted.reason
    assert outputs == [expected[0][:1], *expected[1:]]
    assert pair.violations() == [] and pair.healthy()


def test_slots_handed_on_while_a_late_transfer_still_writes_them(pair):
    """The freed_slots defect: the given-up transfer's slots go to the first request of the next
    batch, and the late bytes (and records) land over its KV. Its first decode reads the other
    prompt's token at position 0, in slot 1."""
    prompts = fresh_prompts(3, 12)
    pair.reset(0, ())
    pair.set_transfer_timeout(0.5)
    pair.arm_transport_fault("late_transfer", transfer=0)
    pair.arm_transport_fault("freed_slots", transfer=0)
    pair.generate(prompts, 4)
    found = [v for v in pair.violations() if v.phase == "HEAD"]
    tokens = {(v.slot, v.position) for v in found if "verify_token" in v.reasons}
    assert tokens == {(p + 1, p) for p in range(len(prompts[0])) if prompts[0][p] != prompts[8][p]}
    assert len({pair.request_label(v) for v in found}) == 1


def test_a_transport_fault_is_named_and_bad_arguments_are_refused(pair):
    pair.reset(0, ())
    with pytest.raises(ArgumentError, match="transport fault must be one of stale_bytes, freed_slots, logical_ids, "
                                            "late_transfer, prefill_killed; got 'torn'"):
        pair.arm_transport_fault("torn")
    with pytest.raises(ArgumentError, match="transfer must be an integer >= 0"):
        pair.arm_transport_fault("stale_bytes", transfer=-1)
    with pytest.raises(ArgumentError, match="seconds must be a number > 0; got 0"):
        pair.set_transfer_timeout(0)
    with pytest.raises(ValueError, match="prompt is empty"):  # refused before either side runs it
        pair.generate([[]], 2)
    assert pair.generate(fresh_prompts(5, 1), 2) and pair.healthy()


def test_the_prefill_process_killed_mid_transfer_fails_the_call_at_once():
    """The prefill process dies between transfer 1's KV and its records: the decode side gives up
    on every transfer not landed, decodes none of them, and the call fails in seconds with that
    account and how the process ended."""
    handle = start_pd_processes("mha", 0, CANARY, ["cpu"])
    try:
        handle.reset(0, ())
        handle.arm_transport_fault("prefill_killed", transfer=1)
        start = time.monotonic()
        with pytest.raises(PairFailure) as failure:
            handle.generate(fresh_prompts(4, 4), 4)
        assert time.monotonic() - start < 30
        message = str(failure.value)
        assert message.startswith("the prefill process is gone")
        assert "request 1 " in message and "transfer 1 never completed" in message and "rank 1 killed" in message
        assert not handle.healthy()
    finally:
        handle.close()


def test_the_soak_drives_the_pair_from_the_decode_process_and_reads_clean(pair):
    """Three rounds (shared stems, duplicates, a round larger than the pools) in generate batches:
    every output is what the oracle (a no-cache recomputation, in the decode process) picks, no
    side reports anything, and the workload moved transfers and hit the prefill side's cache."""
    pair.reset(0, ())
    before = pair.liveness()
    result = pair.run_workload(seed=2, rounds=3, shrink_trials=0)
    after = pair.liveness()
    assert result.counts()[CLEAN] == 3 and result.forwards > 200, result.summary()
    assert pair.soak_results == [result] and pair.violations() == [] and pair.healthy()
    assert after["transfers"] - before["transfers"] >= 20 and after["prefix hits"] > before["prefix hits"]
    with pytest.raises(ArgumentError, match="replay 'no workload' is not a workload a soak prints"):
        pair.run_workload(replay="no workload")  # answered by the decode process, which stays up
    assert pair.healthy()


def test_a_fault_injected_mid_soak_is_detected_in_the_decode_process(pair):
    """A bit flipped after the prefill side's stamp, at every prefill forward from the 6th on:
    the flips travel with the transfers, the decode process's HEAD reports them, the ledger
    (matched across both processes) owns every such report, and no round's verdict blames the
    canary. When the decode side frees a damaged copy (the pressure round evicts it), the prefill
    process's ledger hears it: that copy is gone."""
    spec = PerturbSpec("real_kv_post_forward", side="prefill", target_group="full", warmup_steps=6)
    pair.reset(0, (spec,))
    result = pair.run_workload(seed=3, rounds=3, shrink_trials=0)
    assert result.trustworthy and all(r.unexplained == 0 for r in result.rounds), result.summary()
    assert result.rounds[0].injected == 0 < result.rounds[1].injected
    injections = pair.injections()
    assert injections and min(i.step for i in injections) >= 6
    seen = [v for v in pair.violations() if (v.side, v.phase) == ("decode", "HEAD")]
    assert seen and all(any(i.matches(v) for i in injections) for v in seen)
    assert any(p.side == "decode" for i in injections for p in i.gone)
