"""The runtime's readout (canary/readout.py): the slots it maps are the ones the engine's table
holds, the bytes it hands over are the pool's own and the ones the fingerprint reads, and its
counts are the runtime's."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import GroupKind, Half
from kvcanary_kernels.sources import RealDataMode
from pytest_kvcanary.canary.groups import GroupState
from pytest_kvcanary.canary.readout import GroupReadout
from pytest_kvcanary.canary.seam import Capacities, PoolGroup, SlotMapping


def _run(host) -> None:
    host.forward({0: [5, 6, 7, 8, 9], 1: [10, 11]})
    host.forward({0: [12], 1: [13, 14, 15]})


@pytest.mark.parametrize("page", [1, 4])
def test_a_mapped_slot_is_the_one_the_engines_table_holds(make_host, page):
    host = make_host(window=3, page=page)
    _run(host)
    host.full_to_swa.copy_(torch.arange(host.full_to_swa.numel()).flip(0) % 7)  # an SWA map of its own
    readout = host.runtime.readout()
    full, swa = readout.kv_groups
    assert (full.kind, swa.kind) == (GroupKind.FULL, GroupKind.SWA) and readout.group(GroupKind.SWA) is swa
    for row, length in ((0, 6), (1, 5)):
        positions = torch.arange(length)
        rows = torch.full_like(positions, row)
        expected = torch.tensor([host.slot(row, p) for p in range(length)])
        space, slots = full.slots_at(rows, positions)
        assert space.cpu().tolist() == slots.cpu().tolist() == expected.tolist()
        space, slots = swa.slots_at(rows, positions)
        assert space.cpu().tolist() == expected.tolist()
        assert slots.cpu().tolist() == host.full_to_swa.cpu()[expected].tolist()
        assert swa.group_slots(expected).tolist() == host.full_to_swa.cpu()[expected].tolist()
        for p, slot in enumerate(expected.tolist()):  # the table entry that maps each position
            assert int(host.table[row, full.column_of(p)]) == full.block_of(slot)
    assert full.slots_at(torch.tensor([5]), torch.tensor([0]))[1].tolist() == [0], "an unmapped row: slot 0"
    assert (full.page_size, full.window, swa.window, full.num_slots) == (page, 0, 3, 64)
    assert full.table is host.table and full.dtype == torch.int64


def test_a_ring_mapping_names_the_column_of_a_position_past_the_ring():
    table = torch.zeros(2, 4, dtype=torch.int64)
    table[1] = torch.tensor([3, 5, 2, 7])
    layers = [torch.zeros(32, 4, 4, dtype=torch.int64)]
    pool = PoolGroup(GroupKind.SWA, layers, layers, num_slots=128, page_size=4,
                     mapping=SlotMapping(table, page_size=4, ring=16), window=8)
    group = GroupReadout(GroupState.create(pool, RealDataMode.NONE, torch.device("cpu"), Capacities(2, 8, 64),
                                           recheck=False), None)
    positions = torch.arange(40)
    space, _ = group.slots_at(torch.ones_like(positions), positions)
    assert [int(table[1, group.column_of(p)]) for p in range(40)] == [group.block_of(s) for s in space.tolist()]
    assert group.column_of(17) == 0 and group.slots_at(torch.tensor([1]), torch.tensor([17]))[0].tolist() == [13]


@pytest.mark.parametrize("real_data", ["partial", "all"])
@pytest.mark.parametrize("page", [1, 4])
def test_slot_bytes_are_the_pools_and_the_fingerprints(make_host, real_data, page):
    host = make_host(page=page, real_data=real_data)
    _run(host)
    full = host.runtime.readout().group(GroupKind.FULL)
    assert full.fingerprinted() == {Half.K: (0, 1), Half.V: (0, 1)}
    assert all(a is b for a, b in zip(full.buffers(Half.K), host.k)) and list(full.buffers(Half.V)) == host.v
    slot = host.slot(0, 2)
    # all: every byte of the first sampled layer, partial's samples of the others
    assert full.slot_bytes(Half.V, 0, slot).sampled == tuple(range(64 if real_data == "all" else 16))
    layer = 0 if real_data == "all" else 1
    got = full.slot_bytes(Half.V, layer, slot)
    pool = host.v[layer].view(-1, 8).view(torch.uint8)[slot]  # the slot's 64 bytes, a view
    before = pool.clone()
    assert got.sampled == tuple(range(64 if real_data == "all" else 16))
    assert full.slot_bytes(Half.V, 1, slot).sampled == tuple(range(16))
    assert torch.equal(got.data, pool[:len(got.data)])
    got.data[got.sampled[-1]] ^= 0x20  # a byte the fingerprint reads, written through the view
    assert (pool ^ before).nonzero().flatten().tolist() == [got.sampled[-1]]
    host.forward({0: [16]})
    seen = {(v.phase, v.half, v.reasons, v.slot, v.position) for v in host.runtime.log.violations}
    assert seen == {("HEAD", "V", ("verify_real_kv_hash",), slot, 2)}


def test_without_real_data_nothing_is_fingerprinted_and_there_is_no_state_or_host_tier(make_host):
    host = make_host(real_data="none")
    readout = host.runtime.readout()
    full = readout.group(GroupKind.FULL)
    assert full.fingerprinted() == {} and readout.state_restores() is None and not full.host_backed
    with pytest.raises(KeyError):
        readout.group(GroupKind.STATE)
    with pytest.raises(ValueError, match="the full group has no host tier behind it"):
        full.host_slots()


def test_a_hybrid_engines_restores_are_the_state_guards_count():
    from pytest_kvcanary.adapters.reference import make_reference_engine
    from pytest_kvcanary.config import CanaryConfig
    from pytest_kvcanary.handles.single import EngineHandle

    handle = EngineHandle(make_reference_engine("hybrid", "cpu", seed=0), CanaryConfig(kernels="torch"))
    readout = handle.side.runtime.readout()
    handle.reset(0, ())
    prompt = list(range(1, 21))
    handle.generate([prompt], max_new_tokens=2)
    before = readout.state_restores()
    handle.generate([prompt + [30]], max_new_tokens=2)  # its prefix's checkpoint restored
    assert before == 0 and readout.state_restores() == handle.side.runtime.state.restores() > 0
    state = readout.group(GroupKind.STATE)
    assert list(state.buffers(Half.K)) == list(handle.engine.canary_groups()[-1].k_layers)
    handle.reset(0, ())
    assert readout.state_restores() == 0, "the readout outlives a reset"


def test_a_host_tiers_slots_positions_and_bytes():
    from pytest_kvcanary.adapters.reference import make_reference_engine
    from pytest_kvcanary.config import CanaryConfig
    from pytest_kvcanary.handles.single import EngineHandle

    engine = make_reference_engine("mha", "cpu", seed=0, page_size=4, num_slots=128, host_num_slots=1024,
                                   max_running=4)
    handle = EngineHandle(engine, CanaryConfig(kernels="torch", real_data="partial"))
    handle.reset(0, ())
    for first in range(8):  # more prompts than the pool holds: pages are written back
        handle.generate([[200 + first] + list(range(1, 40))], max_new_tokens=2)
    full = handle.side.runtime.readout().group(GroupKind.FULL)
    held = handle.side.runtime.host_records
    assert full.host_backed and torch.equal(full.host_slots(), held.live_slots(GroupKind.FULL))
    host_slot = int(full.host_slots()[0])
    assert full.host_position(Half.K, host_slot) == held.position(GroupKind.FULL, Half.K, host_slot)
    layer = full.fingerprinted()[Half.K][0]
    got = full.slot_bytes(Half.K, layer, host_slot, host=True)
    tier = next(p for p in engine.host_tier.pools if p.kind is GroupKind.FULL).k_layers[layer]
    row = tier.view(tier.shape[0], -1).view(torch.uint8)
    per_slot = row.shape[1] // 4
    assert torch.equal(got.data, row[host_slot // 4, host_slot % 4 * per_slot:][:len(got.data)])
    assert got.data.untyped_storage().data_ptr() == tier.untyped_storage().data_ptr()
