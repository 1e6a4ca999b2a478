"""The violation ring's wrap-around and counters, and argument validation of sources and launches."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import COL_POSITION, COL_REASONS, COL_SLOT, COL_STEP, COL_TAG, NUM_TAGS, Reason

from kv_world import i64

VERIFY = {"kernel": K.verify_view, "reference": K.verify_view_ref}
STAMP = {"kernel": K.stamp_view, "reference": K.stamp_view_ref}
SWEEP = {"kernel": K.verify_records, "reference": K.verify_records_ref}
HASH_ROWS = {"kernel": K.source_hash_rows, "reference": K.source_hash_rows_ref}


def _flipped_world(world_factory, capacity: int, flipped: range):
    """A stamped request of 10 tokens whose KV is flipped at positions ``flipped``."""
    w = world_factory(5, ring_capacity=capacity)
    a = w.add_request(10)
    assert w.step([(a, 10)]) == []
    for p in flipped:
        w.kv_bytes(0, w.slot(a, p))[0] ^= 1
    return w, a


def _verify(w, impl: str, view, tag: int, window: int = 0) -> None:
    VERIFY[impl](w.records, w.sources, w.mapping, view, w.ring, tag, window=window, max_context=w.max_context,
                 check_tokens=True, sentinel=False)


@pytest.mark.parametrize("impl", list(VERIFY))
def test_ring_wraps_over_the_oldest_rows_and_count_keeps_counting(world_factory, impl):
    w, a = _flipped_world(world_factory, capacity=4, flipped=range(2, 6))
    view = w.head_view([a])
    w.ring.step.fill_(42)
    _verify(w, impl, view, tag=3, window=6)  # positions 4..9: two rows, claims 0 and 1
    w.ring.step.fill_(43)
    _verify(w, impl, view, tag=5, window=7)  # positions 3..9: three rows, claims 2, 3, 4
    assert int(w.ring.count) == 5
    rows = w.ring.rows.tolist()
    # Claim 4 overwrote claim 0 (rows[0]); claim 1 is still in rows[1].
    assert [(r[COL_STEP], r[COL_TAG]) for r in rows] == [(43, 5), (42, 3), (43, 5), (43, 5)]
    assert rows[1][COL_POSITION] in (4, 5)
    assert sorted(r[COL_POSITION] for r in rows if r[COL_STEP] == 43) == [3, 4, 5]
    for row in rows:
        assert row[COL_SLOT] == w.slot(a, row[COL_POSITION])
        assert row[COL_REASONS] == Reason.VERIFY_REAL_KV_HASH


@pytest.mark.parametrize("impl", list(VERIFY))
def test_one_launch_past_capacity_keeps_the_true_count(world_factory, impl):
    w, a = _flipped_world(world_factory, capacity=3, flipped=range(2, 9))
    _verify(w, impl, w.head_view([a]), tag=3)
    assert int(w.ring.count) == 7
    positions = [r[COL_POSITION] for r in w.ring.rows.tolist()]
    assert len(set(positions)) == 3 and set(positions) <= set(range(2, 9))


def test_counters_are_per_tag_and_count_empty_launches(world):
    a = world.add_request(5)
    fwd = world.forward([(a, 5)], pad_rows=3, pad_tokens=4)
    world.write(fwd)
    world.stamp(fwd.view, tag=2)
    world.commit(fwd)
    view = world.head_view([a], pad_rows=2)
    world.verify(view, tag=7)
    world.verify(view, tag=7, window=3)
    world.verify(world.head_view([]), tag=9)
    world.stamp(world.head_view([]), tag=11)
    world.sweep(K.VerifyEntries(*[i64([])] * 6), tag=13)
    runs, slots = [0] * NUM_TAGS, [0] * NUM_TAGS
    runs[2], slots[2] = 1, 5
    runs[7], slots[7] = 2, 8
    runs[9] = runs[11] = runs[13] = 1
    assert world.ring.kernel_runs.tolist() == runs
    assert world.ring.slot_runs.tolist() == slots
    assert int(world.ring.count) == 0


def test_clear_resets_every_buffer(world_factory):
    w, a = _flipped_world(world_factory, capacity=4, flipped=range(3, 4))
    w.verify(w.head_view([a]), tag=1)
    w.ring.advance_step()
    w.ring.clear()
    for name in ("rows", "count", "step", "kernel_runs", "slot_runs"):
        assert not getattr(w.ring, name).any(), name


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
        (dict(tensor=_bf16(8, 64), page_size=4, num_bytes_per_token=32, read_bytes=32, sample_bytes=3),
         "sample_bytes must be one of 1, 2, 4, 8, 16; got 3"),
        (dict(tensor=_bf16(8, 64), page_size=4, num_bytes_per_token=32, read_bytes=32, sample_bytes=2,
              sample_stride=8, token_stride=3), "multiples of sample_bytes"),
        (dict(tensor=_bf16(8, 64), page_size=4, num_bytes_per_token=32, read_bytes=32, sample_bytes=2,
              sample_stride=10, token_stride=2), "past the row's 128"),
    ],
)
def test_bad_source_args_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        K.RealKvSource(**kwargs)


def _view_launch(world, case: str) -> dict:
    """Keyword arguments of a view launch broken in one way."""
    a = world.add_request(4)
    args = dict(records=world.records, sources=world.sources, mapping=world.mapping,
                view=world.head_view([a], pad_rows=1), ring=world.ring, tag=0)
    mapping, view = args["mapping"], args["view"]
    broken = {
        "records dtype": lambda: dict(records=world.records.to(torch.int32)),
        "records shape": lambda: dict(records=world.records[:, :3].contiguous()),
        "records strided": lambda: dict(records=torch.zeros(256, 8, dtype=torch.int64, device=world.device)[:, :4]),
        "too many sources": lambda: dict(sources=world.sources * 5),
        "source too small": lambda: dict(sources=[K.RealKvSource(world.sources[0].tensor[:8], 1, 128, 128)]),
        "tag": lambda: dict(tag=NUM_TAGS),
        "table device": lambda: dict(mapping=replace(mapping, table=mapping.table.to("meta"))),
        "full_to_group device": lambda: dict(mapping=replace(mapping, full_to_group=i64([0, 1]).to("meta"))),
        "rows dtype": lambda: dict(view=replace(view, rows=view.rows.int())),
        "prefix length": lambda: dict(view=replace(view, prefix_lens=view.prefix_lens[:1])),
        "positions length": lambda: dict(view=replace(view, positions=i64([1, 2, 3]))),
        "context length": lambda: dict(view=replace(view, context_keys=i64([0, 0, 0]))),
        "extend device": lambda: dict(view=replace(view, extend_lens=view.extend_lens.to("meta"))),
        "token table": lambda: dict(view=replace(view, token_table=view.token_table[0])),
    }[case]()
    return args | broken


BAD_VIEW_LAUNCHES = {
    "records dtype": "records must be int64; got torch.int32",
    "records shape": r"records must be \[num_slots, 4\]; got \(256, 3\)",
    "records strided": "records must be contiguous",
    "too many sources": "sources holds at most 4; got 5",
    "source too small": "sources.0. covers 8 slots; records have 256",
    "tag": "launch tag must be in",
    "table device": "SlotMapping.table is on meta; records are on",
    "full_to_group device": "SlotMapping.full_to_group is on meta; records are on",
    "rows dtype": "ForwardView.rows must be int64; got torch.int32",
    "prefix length": "ForwardView.prefix_lens has length 1; expected 2",
    "positions length": "ForwardView.positions has length 3; expected 4",
    "context length": "ForwardView.context_keys has length 3; expected 2",
    "extend device": "ForwardView.extend_lens is on meta",
    "token table": "ForwardView.token_table must be a 2-D int64 tensor",
}


BAD_MAPPINGS = {
    "table dtype": (dict(table=torch.zeros(2, 3)), "SlotMapping.table must be int32 or int64; got torch.float32"),
    "table dims": (dict(table=i64([1, 2])), "SlotMapping.table must be a 2-D tensor .rows, cols.; got torch.int64 "
                                            "tensor of shape"),
    "page size": (dict(page_size=0), "SlotMapping.page_size must be an integer >= 1; got 0"),
    "ring": (dict(ring=-1), "SlotMapping.ring must be an integer >= 0; got -1"),
    "full_to_group dtype": (dict(full_to_group=i64([0, 1]).int()),
                            "SlotMapping.full_to_group must be int64; got torch.int32"),
    "full_to_group dims": (dict(full_to_group=i64([[0, 1]])), "SlotMapping.full_to_group must be 1-D"),
}


@pytest.mark.parametrize("case", list(BAD_MAPPINGS))
def test_a_bad_slot_mapping_raises_when_made_naming_the_field(case):
    kwargs, message = BAD_MAPPINGS[case]
    with pytest.raises(ValueError, match=message):
        K.SlotMapping(**{"table": i64([[0, 1]]), **kwargs})


@pytest.mark.parametrize("case", list(BAD_VIEW_LAUNCHES))
@pytest.mark.parametrize("impl", list(VERIFY))
def test_bad_view_launch_raises_naming_the_argument(world, impl, case):
    args = _view_launch(world, case)
    if case == "positions length":
        args["view"] = replace(args["view"], input_ids=i64([1, 2, 3, 4]))
    with pytest.raises(ValueError, match=BAD_VIEW_LAUNCHES[case]):
        VERIFY[impl](**args, window=0, max_context=64, check_tokens=True, sentinel=False)
    with pytest.raises(ValueError, match=BAD_VIEW_LAUNCHES[case]):
        STAMP[impl](**args, check_tokens=True, check_write_inputs=True)


@pytest.mark.parametrize("impl", list(VERIFY))
def test_bad_view_options_raise_naming_the_option(world, impl):
    args = _view_launch(world, "tag") | dict(tag=0)
    with pytest.raises(ValueError, match="window must be an integer >= 0; got -1"):
        VERIFY[impl](**args, window=-1, max_context=64, check_tokens=True, sentinel=False)
    with pytest.raises(ValueError, match="max_context must be an integer >= 1; got 0"):
        VERIFY[impl](**args, window=0, max_context=0, check_tokens=True, sentinel=False)
    with pytest.raises(ValueError, match="read_hashes has length 255; expected 256"):
        VERIFY[impl](**args, window=0, max_context=64, check_tokens=True, sentinel=False,
                     read_hashes=i64([0] * 255))
    n_tokens = args["view"].input_ids.shape[0]
    n_sources = len(args["sources"])
    extra_row = torch.zeros(n_sources + 1, n_tokens, dtype=torch.int64, device=world.device)
    with pytest.raises(ValueError, match=rf"written_source_hashes has shape \({n_sources + 1}, {n_tokens}\); "
                                         rf"expected \({n_sources} sources, >= {n_tokens} tokens\)"):
        STAMP[impl](**args, check_tokens=True, check_write_inputs=True, written_source_hashes=extra_row)
    with pytest.raises(ValueError, match="written_source_hashes must be a 2-D int64 tensor"):
        STAMP[impl](**args, check_tokens=True, check_write_inputs=True, written_source_hashes=i64([0] * n_tokens))
    with pytest.raises(ValueError, match="written_source_hashes needs >= 1 source"):
        STAMP[impl](**args | dict(sources=[]), check_tokens=True, check_write_inputs=True,
                    written_source_hashes=torch.zeros(1, n_tokens, dtype=torch.int64, device=world.device))


@pytest.mark.parametrize("impl", list(SWEEP))
def test_bad_sweep_entries_raise_naming_the_field(world, impl):
    entries = K.VerifyEntries(*[i64([1, 2, 3])] * 6)
    with pytest.raises(ValueError, match="VerifyEntries.context_keys has length 2; VerifyEntries.slots has 3"):
        SWEEP[impl](world.records, entries._replace(context_keys=i64([0, 0])), world.sources, world.ring, 0)
    with pytest.raises(ValueError, match="VerifyEntries.tokens must be int64; got torch.int32"):
        SWEEP[impl](world.records, entries._replace(tokens=entries.tokens.int()), world.sources, world.ring, 0)
    with pytest.raises(ValueError, match=r"VerifyEntries.rows must be 1-D and contiguous; got shape \(3, 1\)"):
        SWEEP[impl](world.records, entries._replace(rows=entries.rows[:, None]), world.sources, world.ring, 0)


@pytest.mark.parametrize("rows, read_bytes, out, message", [
    (_bf16(8), 16, torch.zeros(8, dtype=torch.int64), "rows must be a tensor with >= 2 dims"),
    (_bf16(4, 16), 24, torch.zeros(4, dtype=torch.int64), "RealKvSource.read_bytes must be a positive multiple of 16"),
    (_bf16(4, 16), 48, torch.zeros(4, dtype=torch.int64), r"<= num_bytes_per_token \(32\); got 48"),
    (_bf16(4, 20)[:, :16], 32, torch.zeros(4, dtype=torch.int64), "16-byte"),
    (_bf16(4, 16), 32, torch.zeros(3, dtype=torch.int64), "out has length 3; expected 4"),
    (_bf16(4, 16), 32, torch.zeros(4, dtype=torch.int32), "out must be int64; got torch.int32"),
])
@pytest.mark.parametrize("impl", list(HASH_ROWS))
def test_bad_hash_rows_args_raise_naming_the_argument(impl, rows, read_bytes, out, message):
    with pytest.raises(ValueError, match=message):
        HASH_ROWS[impl](rows, read_bytes, out)


@pytest.mark.parametrize("tiling, message", [
    (K.Tiling(block=100, chunk=16, num_warps=4), "tiling.block must be a power of two; got 100"),
    (K.Tiling(block=128, chunk=0, num_warps=4), "tiling.chunk must be a power of two; got 0"),
])
def test_bad_tiling_raises(world, tiling, message):
    args = _view_launch(world, "tag") | dict(tag=0)
    with pytest.raises(ValueError, match=message):
        K.verify_view(**args, window=0, max_context=64, check_tokens=True, sentinel=False, tiling=tiling)
    with pytest.raises(ValueError, match=message):
        K.stamp_view(**args, check_tokens=True, check_write_inputs=True, tiling=tiling)
    with pytest.raises(ValueError, match=message):
        K.source_hash_rows(_bf16(4, 16), 32, torch.zeros(4, dtype=torch.int64), tiling=tiling)
