"""The radix sweep: what it checks, and that it alone finds damage in KV only the cache holds."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD, PREV_SKIP, GroupKind
from kvcanary_kernels.sources import RealDataMode
from pytest_kvcanary.canary.groups import GroupState
from pytest_kvcanary.canary.seam import Capacities, CacheWalk, PoolGroup, SlotMapping
from pytest_kvcanary.canary.plans import sweep_entries
from pytest_kvcanary.canary.walk import check_walk
from pytest_kvcanary.config import PerturbSpec

from perturb_support import POOL_GROUPS, make_handle, send_waves


# Two cached sequences, FULL slots 5 -> 6 -> 7 (a request holds 5) and 9 alone.
WALK = CacheWalk(
    slots=torch.tensor([5, 6, 7, 9]),
    positions=torch.tensor([0, 1, 2, 0]),
    prev_slots=torch.tensor([PREV_CHAIN_HEAD, 5, 6, PREV_CHAIN_HEAD]),
    tokens=torch.tensor([40, 41, 42, 43]),
    locked=torch.tensor([True, False, False, False]),
)


def group(kind: GroupKind, full_to_group: torch.Tensor | None = None) -> GroupState:
    layers = [torch.zeros(16, 4)]
    mapping = SlotMapping(torch.zeros(2, 8, dtype=torch.int64), full_to_group=full_to_group)
    pool = PoolGroup(kind, layers, layers, num_slots=16, mapping=mapping,
                     window=None if full_to_group is None else 2)
    return GroupState.create(pool, RealDataMode.NONE, torch.device("cpu"), Capacities(2, 8, 8), recheck=True)


def test_sweep_entries_cover_the_walk_or_its_unlocked_part():
    full = group(GroupKind.FULL)
    e = sweep_entries(WALK, full)
    assert e.slots.numel() == 16 and not e.slots[4:].any(), "padded to the pool size with slot 0"
    assert e.slots[:4].tolist() == [5, 6, 7, 9] and e.positions[:4].tolist() == [0, 1, 2, 0]
    assert e.prev_slots[:4].tolist() == [PREV_CHAIN_HEAD, 5, 6, PREV_CHAIN_HEAD]
    assert e.tokens[:4].tolist() == [40, 41, 42, 43] and e.rows.tolist() == [-1] * 16
    unlocked = sweep_entries(WALK, full, unlocked_only=True)
    assert unlocked.slots[:4].tolist() == [6, 7, 9, 0]
    assert unlocked.prev_slots[:3].tolist() == [5, 6, PREV_CHAIN_HEAD]


def test_a_full_entry_after_the_reserved_slot_is_not_checked_against_it():
    walk = CacheWalk(slots=torch.tensor([5, 6]), positions=torch.tensor([1, 2]), prev_slots=torch.tensor([0, 5]),
                     tokens=torch.tensor([40, 41]), locked=torch.tensor([False, False]))
    e = sweep_entries(walk, group(GroupKind.FULL))
    assert e.slots[:2].tolist() == [5, 6] and e.prev_slots[:2].tolist() == [PREV_SKIP, 5]


def test_sweep_entries_keep_to_swa_resident_slots():
    """FULL slot 5 slid out of the window and 9 is a tombstone: slot 0 (skipped by the kernels)
    stands for them, and slot 6 is checked without its predecessor."""
    full_to_swa = torch.zeros(16, dtype=torch.int64)
    full_to_swa[6], full_to_swa[7] = 3, 4
    e = sweep_entries(WALK, group(GroupKind.SWA, full_to_swa))
    assert e.slots[:4].tolist() == [0, 3, 4, 0]
    assert e.prev_slots[:4].tolist() == [PREV_CHAIN_HEAD, PREV_SKIP, 3, PREV_CHAIN_HEAD]
    unlocked = sweep_entries(WALK, group(GroupKind.SWA, full_to_swa), unlocked_only=True)
    assert unlocked.slots[:3].tolist() == [3, 4, 0]
    assert unlocked.prev_slots[:3].tolist() == [PREV_SKIP, 3, PREV_CHAIN_HEAD]


@pytest.mark.parametrize("attention", POOL_GROUPS)
def test_damage_only_the_cache_holds_is_found_by_the_sweep_alone(attention):
    handle = make_handle(attention, sweep_interval=0)
    handle.reset(0, tuple(PerturbSpec("real_kv_unused_cache", target_group=g) for g in POOL_GROUPS[attention]))
    send_waves(handle, seed=0)
    injections = handle.injections()
    assert injections and all(i.status == "latent" for i in injections)
    assert handle.violations() == []  # no forward read those slots
    runtime = handle.side.runtime
    assert runtime.sweep()
    runtime.drain()
    injections = handle.injections()
    assert all(i.status == "detected" and i.detected_by.phase == "SWEEP" for i in injections), \
        [i.describe() for i in injections]
    assert {v.reasons for v in handle.violations()} == {("verify_real_kv_hash",)}


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_a_walk_returned_again_is_checked_once_and_still_swept(attention, monkeypatch):
    """An engine returns the same walk object while its cache is unchanged (or the same columns but
    the locks): the sweep checks and plans it once, and every sweep still verifies what the slots
    hold now."""
    import pytest_kvcanary.canary.plans as plans_module

    handle = make_handle(attention, sweep_interval=0)
    handle.reset(0, tuple(PerturbSpec("real_kv_unused_cache", target_group=g) for g in POOL_GROUPS[attention]))
    send_waves(handle, seed=1)
    runtime = handle.side.runtime
    checks = []
    monkeypatch.setattr(plans_module, "check_walk", lambda *args: checks.append(1) or check_walk(*args))
    walk = runtime.host.cache_walk()
    monkeypatch.setattr(runtime.host, "cache_walk", lambda: walk)
    assert runtime.sweep() and runtime.sweep()
    runtime.drain()
    assert len(checks) == 1
    found = {(v.group.lower(), v.slot) for v in handle.violations()}
    assert found and found == {(i.group, i.slot) for i in handle.injections()}
    assert runtime.log.repeats == len(handle.violations()), "the second sweep found each again"
    monkeypatch.setattr(runtime.host, "cache_walk", lambda: walk._replace(locked=walk.locked.clone()))
    assert runtime.sweep()
    assert len(checks) == 1, "a walk whose locks alone changed is not checked again"
    monkeypatch.setattr(runtime.host, "cache_walk", lambda: walk._replace(slots=walk.slots.clone()))
    assert runtime.sweep()
    assert len(checks) == 2, "a walk of other slot tensors is checked again"


def test_a_well_formed_walk_switches_no_thread_count_and_a_malformed_one_is_checked_on_one(monkeypatch):
    """The full check of a host walk is small tensors: torch's thread pool made it many times
    slower on a busy GPU host (benchmarks/RESULTS.md), so it runs on one intra-op thread; the
    switch itself costs about 0.1 ms there, so a well-formed walk (numpy's check) makes none."""
    import pytest_kvcanary.canary.walk as walk_module

    handle = make_handle("mha", sweep_interval=0)
    handle.reset(0, ())
    send_waves(handle, seed=1)
    runtime = handle.side.runtime
    full_checks = []
    check_in_full = walk_module._check_in_full
    monkeypatch.setattr(walk_module, "_check_in_full",
                        lambda *args: full_checks.append(torch.get_num_threads()) or check_in_full(*args))
    switches = []
    set_num_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: switches.append(n) or set_num_threads(n))
    before = torch.get_num_threads()
    set_num_threads(2)
    try:
        assert runtime.sweep()
        assert full_checks == [] and switches == []
        walk = runtime.host.cache_walk()
        assert walk.slots.numel() > 1
        duplicated = walk._replace(slots=torch.cat([walk.slots[:1], walk.slots[:-1]]))
        monkeypatch.setattr(runtime.host, "cache_walk", lambda: duplicated)
        assert runtime.sweep()
        assert full_checks == [1] and switches == [1, 2]
        assert torch.get_num_threads() == 2
        assert any("walk_duplicate_slot" in v.reasons for v in runtime.drain())
    finally:
        set_num_threads(before)
