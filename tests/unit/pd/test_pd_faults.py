"""A fault on the prefill side after its stamp surfaces on the decode side, at HEAD of the first
decode forward; with identical prompts the radix dedup race lets it escape, and the ledger says so.

Every run has sweep_interval 0 on both sides (a prefill sweep would also see the damaged slot the
prefill radix cache keeps) and one injection: the prefill side runs one forward per batch.
"""

from __future__ import annotations

import pytest

from pytest_kvcanary.assertions import KvCanary
from pytest_kvcanary.handles.pd import PDHandle

from pd_support import LONG_WINDOW, make_handle, post_forward

# (attention, target group, window): the swa target needs a window longer than the prompts for
# every damaged SWA slot to be one the decode side reads.
CASES = [("mha", "full", 16), ("swa", "full", 16), ("swa", "swa", LONG_WINDOW)]
CASE_IDS = [f"{a}-{g}" for a, g, _ in CASES]


def assert_surfaced_on_decode(handle: PDHandle, group: str) -> None:
    """One injection, detected by the decode side at HEAD of its first forward (RECHECK, which
    compares with what HEAD read, stays silent: the forward did no damage); prefill silent."""
    (inj,) = handle.injections()
    assert inj.side == "prefill" and inj.group == group and inj.status == "detected", inj.describe()
    v = inj.detected_by
    assert (v.side, v.step, v.phase, v.group.lower(), v.reason) == ("decode", 0, "HEAD", group, "verify_real_kv_hash")
    assert [p.side for p in inj.moved_to] == ["decode"]
    violations = handle.violations()
    assert {v.phase for v in violations} == {"HEAD"} and all(
        (v.side, v.step, v.reasons, v.group.lower()) == ("decode", 0, ("verify_real_kv_hash",), group)
        for v in violations), [v.describe() for v in violations]
    assert handle.healthy()


@pytest.mark.parametrize(("attention", "group", "window"), CASES, ids=CASE_IDS)
def test_prefill_fault_surfaces_on_decode_30_of_30(attention, group, window):
    handle = make_handle(attention, window=window)
    for seed in range(30):
        handle.reset(seed, post_forward(group))
        handle.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=3)
        assert_surfaced_on_decode(handle, group)


@pytest.mark.parametrize(("attention", "group", "window"), CASES, ids=CASE_IDS)
def test_prefill_fault_surfaces_on_decode_with_triton_kernels(attention, group, window):
    handle = make_handle(attention, window=window, kernels="triton")
    handle.reset(0, post_forward(group))
    handle.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=2)
    assert_surfaced_on_decode(handle, group)


def test_swa_damage_outside_the_decode_window_stays_latent_on_prefill():
    """The decode side reads (and HEAD checks) only the last `window` SWA slots of the prompt:
    damage before them is detected nowhere, and stays latent in the prefill radix cache."""
    window = 16
    handle = make_handle("swa", window=window)
    seen = set()
    for seed in range(12):
        handle.reset(seed, post_forward("swa"))
        handle.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=3)
        prompt_len = len(handle.prompts_since_reset()[0])  # all four are as long (one-digit index)
        (inj,) = handle.injections()
        read = inj.position >= prompt_len - window
        seen.add(read)
        assert inj.status == ("detected" if read else "latent"), inj.describe()
        assert bool(handle.violations()) == read
        assert not read or inj.detected_by.side == "decode"
    assert seen == {True, False}


@pytest.mark.parametrize(("attention", "group", "window"), CASES, ids=CASE_IDS)
def test_identical_prompts_let_faults_on_duplicates_escape_by_dedup(attention, group, window):
    """The race, reproduced deterministically: a fault on the first copy's slots (which the
    prefill radix cache keeps and every copy's transfer sends) is detected; one on a duplicate's
    slot was freed by dedup before the transfer read the row, so nobody reports it."""
    handle = make_handle(attention, window=window)
    outcomes = set()
    for seed in range(12):
        handle.reset(seed, post_forward(group))
        handle.send_parallel_requests(4, max_new_tokens=3)
        (inj,) = handle.injections()
        canonical = inj.full_slot in set(handle.prefill.engine.cache_walk().slots.tolist())
        outcomes.add(canonical)
        if canonical:
            assert inj.status == "detected" and inj.detected_by.side == "decode", inj.describe()
            assert len(inj.moved_to) == 4, "each copy's transfer sends the first copy's slots"
        else:
            assert inj.status == "escaped" and "radix dedup" in inj.cause and not inj.moved_to, inj.describe()
            assert handle.violations() == []
    assert outcomes == {True, False}, "both a first-copy and a duplicate injection must occur"


def test_require_distinct_prompts_fails_at_once_on_a_real_pair():
    handle = make_handle("mha")
    canary = KvCanary(handle, ("prefill", "decode"))
    handle.reset(0, post_forward("full"))
    handle.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=2)
    canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD", require_distinct_prompts=True)
    canary.assert_no_violation(side="prefill")

    escapes = set()
    for seed in range(6):  # identical prompts: the fault lands on the first copy or on a duplicate
        handle.reset(seed, post_forward("full"))
        handle.send_parallel_requests(4, max_new_tokens=2)
        (inj,) = handle.injections()
        escapes.add(inj.status == "escaped")
        # Refused whether or not this run's fault was seen: the workload cannot be trusted.
        with pytest.raises(AssertionError, match="sent more than once since the reset.*distinct_prompts=True"):
            canary.assert_violation("verify_real_kv_hash", side="decode", require_distinct_prompts=True)
        if inj.status == "detected":
            canary.assert_violation("verify_real_kv_hash", side="decode")
            continue
        # Without the requirement the assertion explains the escape from the ledger.
        with pytest.raises(AssertionError, match="escaped: real_kv_post_forward on prefill full .*radix dedup") as info:
            canary.assert_violation("verify_real_kv_hash", side="decode")
        assert "hint: the radix cache dedups identical prompts" in str(info.value)
    assert escapes == {True, False}
