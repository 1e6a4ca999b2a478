"""The violation ring's overflow and counters, and argument validation of sources and launches."""

from __future__ import annotations

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import COL_POSITION, COL_REASONS, COL_SLOT, COL_STEP, COL_TAG, NUM_TAGS, Reason

STAMP = (K.stamp_records, K.stamp_records_ref)
VERIFY = (K.verify_records, K.verify_records_ref)


@pytest.mark.parametrize("impl", [0, 1], ids=["kernel", "reference"])
def test_ring_overflow_keeps_the_true_total_and_stores_capacity_rows(world_factory, impl):
    w = world_factory(5, ring_capacity=3)
    a = w.add_request(10)
    w.fill_kv(a.slots)
    STAMP[impl](w.records, w.write_entries([(a, 0, 10)]), w.sources, w.ring, 0)
    w.ring.step.fill_(42)
    for slot in a.slots[2:9]:  # seven corrupted slots
        w.kv_bytes(0, slot)[0] ^= 1
    VERIFY[impl](w.records, w.verify_entries([(a, 0, 10)]), w.sources, w.ring, tag=3)
    assert w.ring.total() == 7
    stored = w.ring.read(0, 100)
    assert stored.shape[0] == 3
    for row in stored.tolist():
        assert row[COL_SLOT] in a.slots[2:9]
        assert row[COL_SLOT] == a.slots[row[COL_POSITION]]
        assert (row[COL_REASONS], row[COL_TAG], row[COL_STEP]) == (Reason.VERIFY_REAL_KV_HASH, 3, 42)
    assert len({row[COL_SLOT] for row in stored.tolist()}) == 3


def test_counters_are_per_tag_and_count_empty_launches(world):
    a = world.add_request(5)
    world.fill_kv(a.slots)
    world.stamp(world.write_entries([(a, 0, 5)], pad=3), tag=2)
    world.verify(world.verify_entries([(a, 0, 5)], pad=4), tag=7)
    world.verify(world.verify_entries([(a, 2, 5)]), tag=7)
    world.verify(world.verify_entries([]), tag=9)
    world.stamp(world.write_entries([]), tag=11)
    runs = [0] * NUM_TAGS
    slots = [0] * NUM_TAGS
    runs[2], slots[2] = 1, 5
    runs[7], slots[7] = 2, 8
    runs[9] = runs[11] = 1
    assert world.ring.kernel_runs.tolist() == runs
    assert world.ring.slot_runs.tolist() == slots
    assert world.ring.total() == 0


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tensor=_bf16(8), page_size=1, num_bytes_per_token=16, read_bytes=16), "tensor"),
        (dict(tensor=_bf16(8, 8), page_size=0, num_bytes_per_token=16, read_bytes=16), "page_size"),
        (dict(tensor=_bf16(8, 12), page_size=1, num_bytes_per_token=24, read_bytes=16), "num_bytes_per_token"),
        (dict(tensor=_bf16(8, 16), page_size=1, num_bytes_per_token=32, read_bytes=48), "read_bytes"),
        (dict(tensor=_bf16(8, 16), page_size=1, num_bytes_per_token=32, read_bytes=8), "read_bytes"),
        (dict(tensor=_bf16(8, 16), page_size=2, num_bytes_per_token=32, read_bytes=32), "row holds"),
        (dict(tensor=_bf16(8, 20)[:, :16], page_size=1, num_bytes_per_token=32, read_bytes=32), "16-byte"),
    ],
)
def test_bad_source_args_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        K.RealKvSource(**kwargs)


def _bad_launch(world, case: str):
    """(records, entries, sources, ring, tag) for a verify launch broken in one way."""
    a = world.add_request(4)
    entries = world.verify_entries([(a, 0, 4)])
    records, sources, ring, tag = world.records, world.sources, world.ring, 0
    if case == "records dtype":
        records = records.to(torch.int32)
    elif case == "records shape":
        records = records[:, :3].contiguous()
    elif case == "records strided":
        records = torch.zeros(records.shape[0], 8, dtype=torch.int64, device=records.device)[:, :4]
    elif case == "entry dtype":
        entries = entries._replace(tokens=entries.tokens.to(torch.int32))
    elif case == "entry length":
        entries = entries._replace(prev_slots=entries.prev_slots[:-1])
    elif case == "entry shape":
        entries = entries._replace(rows=entries.rows[:, None])
    elif case == "entry device":
        entries = entries._replace(positions=entries.positions.to("meta"))
    elif case == "too many sources":
        sources = sources * 5
    elif case == "source too small":
        src = sources[0]
        sources = [K.RealKvSource(src.tensor[:8], src.page_size, src.num_bytes_per_token, src.read_bytes)]
    elif case == "tag":
        tag = NUM_TAGS
    return records, entries, sources, ring, tag


BAD_LAUNCHES = {
    "records dtype": "records must be int64; got torch.int32",
    "records shape": r"records must be \[num_slots, 4\]; got \(256, 3\)",
    "records strided": "records must be contiguous",
    "entry dtype": "VerifyEntries.tokens must be int64; got torch.int32",
    "entry length": "VerifyEntries.prev_slots has length 3; VerifyEntries.slots has 4",
    "entry shape": r"VerifyEntries.rows must be 1-D and contiguous; got shape \(4, 1\)",
    "entry device": "VerifyEntries.positions is on meta",
    "too many sources": "sources holds at most 4; got 5",
    "source too small": "sources.0. covers 8 slots; records have 256",
    "tag": "launch tag must be in",
}


@pytest.mark.parametrize("case", list(BAD_LAUNCHES))
@pytest.mark.parametrize("verify", VERIFY, ids=["kernel", "reference"])
def test_bad_verify_launch_raises_naming_the_argument(world, verify, case):
    records, entries, sources, ring, tag = _bad_launch(world, case)
    with pytest.raises(ValueError, match=BAD_LAUNCHES[case]):
        verify(records, entries, sources, ring, tag)


@pytest.mark.parametrize("stamp", STAMP, ids=["kernel", "reference"])
def test_bad_stamp_entries_raise_naming_the_field(world, stamp):
    a = world.add_request(4)
    entries = world.write_entries([(a, 0, 4)])
    bad = entries._replace(seed_slots=torch.tensor([-1, -1], device=world.device))
    with pytest.raises(ValueError, match="WriteEntries.seed_slots has length 2; WriteEntries.seg_starts has 1"):
        stamp(world.records, bad, world.sources, world.ring, 0)
    bad = entries._replace(expected_tokens=entries.expected_tokens.float())
    with pytest.raises(ValueError, match="WriteEntries.expected_tokens must be int64"):
        stamp(world.records, bad, world.sources, world.ring, 0)


@pytest.mark.parametrize("tiling, message", [
    (K.Tiling(block=100, chunk=16, num_warps=4), "tiling.block must be a power of two; got 100"),
    (K.Tiling(block=128, chunk=0, num_warps=4), "tiling.chunk must be a power of two; got 0"),
])
def test_bad_tiling_raises(world, tiling, message):
    a = world.add_request(2)
    with pytest.raises(ValueError, match=message):
        K.verify_records(world.records, world.verify_entries([(a, 0, 2)]), world.sources, world.ring, 0,
                         tiling=tiling)
    with pytest.raises(ValueError, match=message):
        K.stamp_records(world.records, world.write_entries([(a, 0, 2)]), world.sources, world.ring, 0,
                        tiling=tiling)
