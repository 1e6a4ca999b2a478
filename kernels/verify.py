"""HEAD / SWEEP: check the records of the slots a forward (or the radix cache) is about to read."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .entries import VerifyEntries
from .fingerprint import slot_fingerprint
from .hashing import CHAIN_HEAD_HASH_JIT, as_i64
from .launch import DEFAULT_TILING, Tiling, check_launch, check_tiling, source_args
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs, successor_hash
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots, note_failure

_CHAIN = tl.constexpr(int(R.Reason.VERIFY_CHAIN_HASH))
_POSITION = tl.constexpr(int(R.Reason.VERIFY_POSITION))
_REAL_KV = tl.constexpr(int(R.Reason.VERIFY_REAL_KV_HASH))
_TOKEN = tl.constexpr(int(R.Reason.VERIFY_TOKEN))
_PREV_SKIP = tl.constexpr(R.PREV_SKIP)
_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _verify_kernel(records, slots_ptr, positions_ptr, prev_slots_ptr, tokens_ptr, rows_ptr, n_entries,
                   ring_rows, ring_count, ring_step, kernel_runs, slot_runs, capacity, tag,
                   src0, stride0, page0, wpt0, src1, stride1, page1, wpt1,
                   src2, stride2, page2, wpt2, src3, stride3, page3, wpt3,
                   NUM_SOURCES: tl.constexpr,
                   RW0: tl.constexpr, CHUNK0: tl.constexpr, RW1: tl.constexpr, CHUNK1: tl.constexpr,
                   RW2: tl.constexpr, CHUNK2: tl.constexpr, RW3: tl.constexpr, CHUNK3: tl.constexpr,
                   CHECK_TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    count_launch(kernel_runs, tag)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.load(slots_ptr + offs, mask=offs < n_entries, other=0)
    live = slots != 0
    count_slots(slot_runs, tag, live)

    positions = tl.load(positions_ptr + offs, mask=live, other=0)
    prev_slots = tl.load(prev_slots_ptr + offs, mask=live, other=_PREV_SKIP)
    stored_position = tl.load(field_ptrs(records, slots, POSITION), mask=live, other=0)
    stored_prev_hash = tl.load(field_ptrs(records, slots, PREV_HASH), mask=live, other=0)

    has_prev = live & (prev_slots >= 0)
    expected_prev_hash = as_i64(tl.where(has_prev, successor_hash(records, prev_slots, has_prev),
                                         CHAIN_HEAD_HASH_JIT))
    zeros = tl.zeros([BLOCK], tl.int64)
    reasons, stored, expected = zeros, zeros, zeros
    if NUM_SOURCES > 0:
        fingerprint = as_i64(slot_fingerprint(slots, live,
                                              src0, stride0, page0, wpt0, src1, stride1, page1, wpt1,
                                              src2, stride2, page2, wpt2, src3, stride3, page3, wpt3,
                                              NUM_SOURCES, RW0, CHUNK0, RW1, CHUNK1, RW2, CHUNK2, RW3, CHUNK3))
        stored_kv = tl.load(field_ptrs(records, slots, REAL_KV_HASH), mask=live, other=0)
        reasons, stored, expected = note_failure(live & (stored_kv != fingerprint), _REAL_KV,
                                                 stored_kv, fingerprint, reasons, stored, expected)
    bad_chain = live & (prev_slots != _PREV_SKIP) & (stored_prev_hash != expected_prev_hash)
    reasons, stored, expected = note_failure(bad_chain, _CHAIN, stored_prev_hash, expected_prev_hash,
                                             reasons, stored, expected)
    if CHECK_TOKENS:
        tokens = tl.load(tokens_ptr + offs, mask=live, other=_UNKNOWN)
        stored_token = tl.load(field_ptrs(records, slots, TOKEN), mask=live, other=0)
        bad_token = live & (tokens != _UNKNOWN) & (stored_token != tokens)
        reasons, stored, expected = note_failure(bad_token, _TOKEN, stored_token, tokens,
                                                 reasons, stored, expected)
    reasons, stored, expected = note_failure(live & (stored_position != positions), _POSITION,
                                             stored_position, positions, reasons, stored, expected)

    fail = reasons != 0
    rows = tl.load(rows_ptr + offs, mask=fail, other=0)
    append_violations(ring_rows, ring_count, ring_step, capacity, fail, reasons, tag,
                      slots, positions, rows, stored, expected)


def verify_records(records: torch.Tensor, entries: VerifyEntries, sources: Sequence[RealKvSource],
                   ring: ViolationRing, tag: int, check_tokens: bool = True,
                   tiling: Tiling | None = None) -> None:
    """Check each entry's record (slot 0 skipped) and append one ring row per failing entry.

    Reasons: stored position != expected (verify_position); stored prev_hash != ``mix(ANCHOR)``
    for prev_slot -1 or != the successor hash of the record at prev_slot >= 0, unchecked for -2
    (verify_chain_hash); with >= 1 source, the slot's recomputed fingerprint != real_kv_hash
    (verify_real_kv_hash); with check_tokens, a known expected token != stored (verify_token).
    Counts the launch in ring.kernel_runs[tag] (also when entries are empty) and the live entries
    in ring.slot_runs[tag]. No host synchronisation; the grid depends on tensor sizes only.
    ``tiling`` (default DEFAULT_TILING) changes speed only.
    """
    check_launch(records, entries, sources, ring, tag)
    tiling = tiling or DEFAULT_TILING
    check_tiling(tiling)
    src, consts = source_args(sources, records, tiling.chunk)
    n = entries.slots.shape[0]
    grid = (max(1, triton.cdiv(n, tiling.block)),)
    _verify_kernel[grid](
        records, entries.slots, entries.positions, entries.prev_slots, entries.tokens, entries.rows, n,
        ring.rows, ring.count, ring.step, ring.kernel_runs, ring.slot_runs, ring.capacity, tag,
        *src, **consts, CHECK_TOKENS=check_tokens, BLOCK=tiling.block, num_warps=tiling.num_warps,
    )
