"""A recurrent-state group's HEAD and TAIL (a hybrid model's STATE group), per batch row of a
forward: the row's state slot against, or stamped from, the FULL group's record of the last token
the state summarizes, found through the FULL group's mapping on the device.

A state's record: token = the token of that FULL record (UNKNOWN for length 0), position = the
state's length, prev_hash = the successor hash of that FULL record (the head hash of context 0 for
length 0: the initial state is every context's), real_kv_hash = the fingerprint of the state's
bytes. Each lane is one (row, state slot, length) entry; slot 0 is skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .fingerprint import slot_fingerprint
from .hashing import as_i64, head_hash
from .inputs import SlotMapping
from .launch import (
    Tiling, cdiv, check_state_launch, check_tiling, default_tiling, mapping_args, optional_ptr, ring_args, source_args,
)
from .lookup import map_slot
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs, successor_hash
from .record_checks import READ_HASHES_OFF, check_records
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots

_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _state_kernel(records, full_records, sources, mapping, rows_ptr, slots_ptr, lengths_ptr, extend_ptr,
                  more_slots_ptr, more_lengths_ptr, n, m, ring, tag, READS: tl.constexpr, MAP: tl.constexpr,
                  HAS_EXTEND: tl.constexpr, HAS_MORE: tl.constexpr, STAMP: tl.constexpr, BLOCK: tl.constexpr):
    count_launch(ring, tag)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    first = offs < n  # lanes past n: the m more entries of each row (HAS_MORE), row-major
    entry = offs - n
    index = tl.where(first, offs, entry // m)
    in_more = HAS_MORE & ~first & (entry < n * m)
    slots = tl.load(slots_ptr + index, mask=first, other=0)
    if HAS_MORE:
        slots = tl.where(in_more, tl.load(more_slots_ptr + entry, mask=in_more, other=0), slots)
    live = slots != 0
    count_slots(ring, tag, tl.sum(live.to(tl.int64), axis=0))
    rows = tl.load(rows_ptr + index, mask=live, other=0)
    lengths = tl.load(lengths_ptr + index, mask=live & first, other=0)
    if HAS_EXTEND:
        lengths += tl.load(extend_ptr + index, mask=live & first, other=0)
    if HAS_MORE:
        lengths = tl.where(in_more, tl.load(more_lengths_ptr + entry, mask=live & in_more, other=0), lengths)
    has_prev = live & (lengths > 0)
    prev = map_slot(mapping, MAP, rows, lengths - 1, has_prev)
    expected_prev_hash = as_i64(tl.where(has_prev, successor_hash(full_records, prev, has_prev),
                                         head_hash(tl.zeros_like(lengths))))
    if STAMP:
        tokens = tl.load(field_ptrs(full_records, prev, TOKEN), mask=has_prev, other=_UNKNOWN)
        fingerprint = tl.zeros([BLOCK], tl.int64)
        if len(READS) > 0:
            fingerprint = as_i64(slot_fingerprint(sources, READS, slots, live)[0])
        tl.store(field_ptrs(records, slots, TOKEN), tokens, mask=live)
        tl.store(field_ptrs(records, slots, POSITION), lengths, mask=live)
        tl.store(field_ptrs(records, slots, PREV_HASH), expected_prev_hash, mask=live)
        tl.store(field_ptrs(records, slots, REAL_KV_HASH), fingerprint, mask=live)
    else:
        unknown = tl.zeros([BLOCK], tl.int64) + _UNKNOWN
        reasons, stored, expected = check_records(records, sources, READS, slots, live, lengths, live,
                                                  expected_prev_hash, unknown, False, records, READ_HASHES_OFF)
        append_violations(ring, tag, reasons != 0, reasons, slots, lengths, rows, stored, expected)


def state_launch(records: torch.Tensor, sources: Sequence[RealKvSource], full_records: torch.Tensor,
                 full_mapping: SlotMapping, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 ring: ViolationRing, tag: int, *, stamp: bool, extend: torch.Tensor | None = None,
                 more: tuple[torch.Tensor, torch.Tensor] | None = None, tiling: Tiling | None = None) -> None:
    """stamp False (HEAD): check each entry's record, ``(rows[i], slots[i], lengths[i])``, against
    the state of row rows[i]'s first lengths[i] tokens, and append one ring row per failing entry
    (verify_position: another length; verify_chain_hash: another prefix, from the successor hash of
    the FULL record at ``full_mapping(rows[i], lengths[i] - 1)``; verify_real_kv_hash, with >= 1
    source: the bytes changed); the row's position column is the expected length. stamp True
    (TAIL): write those records (lengths + extend where extend is given). more = (slots, lengths),
    ``[B]`` or ``[B, m]`` (contiguous): m more entries per row, on the same rows, in the same launch
    (a forward's checkpoints or rollback states beside its running states). Counts the launch in
    ring.kernel_runs[tag] and the live entries in ring.slot_runs[tag]. No host synchronisation;
    the grid depends on tensor sizes only."""
    check_state_launch(records, sources, full_records, full_mapping, rows, slots, lengths, extend, more, ring, tag)
    tiling = tiling or default_tiling(sources)
    check_tiling(tiling)
    src, reads = source_args(sources, tiling.chunk)
    mapping, consts = mapping_args(full_mapping, full_records)
    n = rows.shape[0]
    more_slots, more_lengths = (records, records) if more is None else more
    m = 0 if more is None else (more_slots.shape[1] if more_slots.dim() == 2 else 1)
    grid = (max(1, cdiv(n * (1 + m), tiling.block)),)
    _state_kernel[grid](records, full_records, src, mapping, rows, slots, lengths, optional_ptr(extend, records),
                        more_slots, more_lengths, n, max(m, 1), ring_args(ring), tag, READS=reads, MAP=consts,
                        HAS_EXTEND=extend is not None, HAS_MORE=more is not None, STAMP=stamp, BLOCK=tiling.block,
                        num_warps=tiling.num_warps)
