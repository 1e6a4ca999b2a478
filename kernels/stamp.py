"""TAIL: stamp the records of the slots a forward has just written."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .entries import WriteEntries
from .fingerprint import slot_fingerprint
from .hashing import CHAIN_HEAD_HASH_JIT, as_i64, as_u64, mix3
from .launch import DEFAULT_TILING, Tiling, check_launch, check_tiling, source_args
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs, successor_hash
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots, note_failure

_WRITE_POSITION = tl.constexpr(int(R.Reason.WRITE_POSITION))
_WRITE_TOKEN = tl.constexpr(int(R.Reason.WRITE_TOKEN))
_UNKNOWN = tl.constexpr(R.UNKNOWN)
_CHAIN_LANES = 32  # segments per chain program (one warp)


@triton.jit
def _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, j):
    """(in segment, slot, token, position) of each lane's entry j."""
    on = j < lens
    entry = starts + j
    slots = tl.load(slots_ptr + entry, mask=on, other=0)
    tokens = tl.load(tokens_ptr + entry, mask=on, other=0)
    positions = tl.load(positions_ptr + entry, mask=on, other=0)
    return on, slots, tokens, positions


@triton.jit
def _chain_step(records, chain, on, slots, tokens, positions):
    """Stores the running hash as the prev_hash of each lane's live entry and folds the entry in."""
    written = on & (slots != 0)
    tl.store(field_ptrs(records, slots, PREV_HASH), as_i64(chain), mask=written)
    return tl.where(written, mix3(chain, as_u64(tokens), as_u64(positions)), chain)


@triton.jit
def _stamp_chain_kernel(records, slots_ptr, tokens_ptr, positions_ptr, seg_starts_ptr, seg_lens_ptr,
                        seed_slots_ptr, n_segments, LANES: tl.constexpr):
    """One lane per segment: run its prev_hash chain serially and store each entry's prev_hash
    (the PREV_HASH field only). Launched with one warp per program: each step's accesses are
    scattered, so fewer segments per multiprocessor means shorter steps."""
    segs = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    in_range = segs < n_segments
    starts = tl.load(seg_starts_ptr + segs, mask=in_range, other=0)
    lens = tl.load(seg_lens_ptr + segs, mask=in_range, other=0)
    seeds = tl.load(seed_slots_ptr + segs, mask=in_range, other=-1)
    seeded = in_range & (seeds >= 0)
    chain = tl.where(seeded, successor_hash(records, seeds, seeded), CHAIN_HEAD_HASH_JIT)
    # The chain is latency-bound: four entries are hashed while the next four load.
    on0, slots0, tokens0, positions0 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, 0)
    on1, slots1, tokens1, positions1 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, 1)
    on2, slots2, tokens2, positions2 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, 2)
    on3, slots3, tokens3, positions3 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, 3)
    for j in range(0, tl.max(lens, axis=0), 4):
        on4, slots4, tokens4, positions4 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, j + 4)
        on5, slots5, tokens5, positions5 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, j + 5)
        on6, slots6, tokens6, positions6 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, j + 6)
        on7, slots7, tokens7, positions7 = _chain_entry(slots_ptr, tokens_ptr, positions_ptr, starts, lens, j + 7)
        chain = _chain_step(records, chain, on0, slots0, tokens0, positions0)
        chain = _chain_step(records, chain, on1, slots1, tokens1, positions1)
        chain = _chain_step(records, chain, on2, slots2, tokens2, positions2)
        chain = _chain_step(records, chain, on3, slots3, tokens3, positions3)
        on0, slots0, tokens0, positions0 = on4, slots4, tokens4, positions4
        on1, slots1, tokens1, positions1 = on5, slots5, tokens5, positions5
        on2, slots2, tokens2, positions2 = on6, slots6, tokens6, positions6
        on3, slots3, tokens3, positions3 = on7, slots7, tokens7, positions7


@triton.jit
def _stamp_entries_kernel(records, slots_ptr, tokens_ptr, positions_ptr, expected_positions_ptr,
                          expected_tokens_ptr, rows_ptr, n_entries,
                          ring_rows, ring_count, ring_step, kernel_runs, slot_runs, capacity, tag,
                          src0, stride0, page0, wpt0, src1, stride1, page1, wpt1,
                          src2, stride2, page2, wpt2, src3, stride3, page3, wpt3,
                          NUM_SOURCES: tl.constexpr,
                          RW0: tl.constexpr, CHUNK0: tl.constexpr, RW1: tl.constexpr, CHUNK1: tl.constexpr,
                          RW2: tl.constexpr, CHUNK2: tl.constexpr, RW3: tl.constexpr, CHUNK3: tl.constexpr,
                          CHECK_WRITE: tl.constexpr, CHECK_TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """Token, position and fingerprint of each entry's record (not PREV_HASH), and write checks."""
    count_launch(kernel_runs, tag)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.load(slots_ptr + offs, mask=offs < n_entries, other=0)
    live = slots != 0
    count_slots(slot_runs, tag, live)
    tokens = tl.load(tokens_ptr + offs, mask=live, other=0)
    positions = tl.load(positions_ptr + offs, mask=live, other=0)
    tl.store(field_ptrs(records, slots, TOKEN), tokens, mask=live)
    tl.store(field_ptrs(records, slots, POSITION), positions, mask=live)
    fingerprint = tl.zeros([BLOCK], tl.int64)
    if NUM_SOURCES > 0:
        fingerprint = as_i64(slot_fingerprint(slots, live,
                                              src0, stride0, page0, wpt0, src1, stride1, page1, wpt1,
                                              src2, stride2, page2, wpt2, src3, stride3, page3, wpt3,
                                              NUM_SOURCES, RW0, CHUNK0, RW1, CHUNK1, RW2, CHUNK2, RW3, CHUNK3))
    tl.store(field_ptrs(records, slots, REAL_KV_HASH), fingerprint, mask=live)
    if CHECK_WRITE:
        zeros = tl.zeros([BLOCK], tl.int64)
        reasons, stored, expected = zeros, zeros, zeros
        if CHECK_TOKENS:
            expected_tokens = tl.load(expected_tokens_ptr + offs, mask=live, other=_UNKNOWN)
            bad_token = live & (expected_tokens != _UNKNOWN) & (tokens != expected_tokens)
            reasons, stored, expected = note_failure(bad_token, _WRITE_TOKEN, tokens, expected_tokens,
                                                     reasons, stored, expected)
        expected_positions = tl.load(expected_positions_ptr + offs, mask=live, other=0)
        reasons, stored, expected = note_failure(live & (positions != expected_positions),
                                                 _WRITE_POSITION, positions, expected_positions,
                                                 reasons, stored, expected)
        fail = reasons != 0
        rows = tl.load(rows_ptr + offs, mask=fail, other=0)
        append_violations(ring_rows, ring_count, ring_step, capacity, fail, reasons, tag,
                          slots, expected_positions, rows, stored, expected)


def stamp_records(records: torch.Tensor, entries: WriteEntries, sources: Sequence[RealKvSource],
                  ring: ViolationRing, tag: int, check_tokens: bool = True,
                  check_write_inputs: bool = True, tiling: Tiling | None = None) -> None:
    """Write ``(token, position, prev_hash, fingerprint)`` into the record of each entry's slot
    (slot 0 skipped).

    prev_hash runs serially through each segment: it starts at ``mix(ANCHOR)`` when seed_slot is
    -1, else at the successor hash of the record at seed_slot; each live entry takes the running
    value, then folds in its token and position (slot-0 entries neither take nor advance it).
    Seed slots must not be written by the same call, and a slot appears at most once. With
    check_write_inputs, entries whose position differs from expected_position (write_position)
    or, with check_tokens, whose token differs from a known expected token (write_token) each
    append one ring row. Counters, graph safety and ``tiling`` as for ``verify_records``.

    Two launches: one over entries (bandwidth-bound), one over segments (one lane each; its steps
    are serial, so its time grows with the longest segment).
    """
    check_launch(records, entries, sources, ring, tag)
    tiling = tiling or DEFAULT_TILING
    check_tiling(tiling)
    src, consts = source_args(sources, records, tiling.chunk)
    n = entries.slots.shape[0]
    _stamp_entries_kernel[(max(1, triton.cdiv(n, tiling.block)),)](
        records, entries.slots, entries.tokens, entries.positions, entries.expected_positions,
        entries.expected_tokens, entries.rows, n,
        ring.rows, ring.count, ring.step, ring.kernel_runs, ring.slot_runs, ring.capacity, tag,
        *src, **consts, CHECK_WRITE=check_write_inputs, CHECK_TOKENS=check_tokens,
        BLOCK=tiling.block, num_warps=tiling.num_warps,
    )
    n_segments = entries.seg_starts.shape[0]
    if n_segments:
        _stamp_chain_kernel[(triton.cdiv(n_segments, _CHAIN_LANES),)](
            records, entries.slots, entries.tokens, entries.positions,
            entries.seg_starts, entries.seg_lens, entries.seed_slots, n_segments,
            LANES=_CHAIN_LANES, num_warps=1,
        )
