"""Stamp the records of an explicit list of slots: a recurrent-state group's slots, whose records
chain onto the FULL group's record of the state's last token."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .fingerprint import slot_fingerprint
from .hashing import as_i64, head_hash
from .inputs import VerifyEntries
from .launch import (
    Tiling, cdiv, check_common, check_entries, check_prev_records, check_tiling, default_tiling, ring_args,
    source_args,
)
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs, successor_hash
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import count_launch, count_slots

_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _stamp_entries_kernel(records, prev_records, sources, entries, n_entries, ring, tag, READS: tl.constexpr,
                          BLOCK: tl.constexpr):
    slots_ptr, positions_ptr, prev_slots_ptr, tokens_ptr, _, context_ptr = entries
    count_launch(ring, tag)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.load(slots_ptr + offs, mask=offs < n_entries, other=0)
    live = slots != 0
    count_slots(ring, tag, tl.sum(live.to(tl.int64), axis=0))
    prev_slots = tl.load(prev_slots_ptr + offs, mask=live, other=-1)
    has_prev = live & (prev_slots >= 0)
    context = tl.load(context_ptr + offs, mask=live, other=0)
    prev_hash = as_i64(tl.where(has_prev, successor_hash(prev_records, prev_slots, has_prev), head_hash(context)))
    tokens = tl.load(tokens_ptr + offs, mask=live, other=_UNKNOWN)
    prev_tokens = tl.load(field_ptrs(prev_records, prev_slots, TOKEN), mask=has_prev, other=_UNKNOWN)
    tokens = tl.where(tokens == _UNKNOWN, prev_tokens, tokens)
    fingerprint = tl.zeros([BLOCK], tl.int64)
    if len(READS) > 0:
        fingerprint = as_i64(slot_fingerprint(sources, READS, slots, live)[0])
    tl.store(field_ptrs(records, slots, TOKEN), tokens, mask=live)
    tl.store(field_ptrs(records, slots, POSITION), tl.load(positions_ptr + offs, mask=live, other=0), mask=live)
    tl.store(field_ptrs(records, slots, PREV_HASH), prev_hash, mask=live)
    tl.store(field_ptrs(records, slots, REAL_KV_HASH), fingerprint, mask=live)


def stamp_records(records: torch.Tensor, entries: VerifyEntries, sources: Sequence[RealKvSource],
                  ring: ViolationRing, tag: int, tiling: Tiling | None = None, *,
                  prev_records: torch.Tensor | None = None) -> None:
    """Write each entry's record (slot 0 skipped): token (entries.tokens where known, else the
    token of the record at prev_slot, UNKNOWN at a chain head), position, prev_hash (the successor
    hash of the record at prev_slot in ``prev_records``, default ``records``; ``head_hash(context
    key)`` for prev_slot < 0) and the fingerprint of the slot's bytes over ``sources`` (0 with
    none). entries.rows is not read. Two entries of one slot leave either's record. Counts the
    launch in ring.kernel_runs[tag] and the live entries in ring.slot_runs[tag]; logs nothing. No
    host synchronisation; the grid depends on tensor sizes only."""
    check_common(records, sources, ring, tag)
    check_entries(entries, records.device)
    prev_records = check_prev_records(records, prev_records)
    tiling = tiling or default_tiling(sources)
    check_tiling(tiling)
    src, reads = source_args(sources, tiling.chunk)
    n = entries.slots.shape[0]
    grid = (max(1, cdiv(n, tiling.block)),)
    _stamp_entries_kernel[grid](records, prev_records, src, tuple(entries), n, ring_args(ring), tag, READS=reads,
                                BLOCK=tiling.block, num_warps=tiling.num_warps)
