"""SWEEP: check the records of an explicit list of slots (what a prefix cache holds)."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .inputs import VerifyEntries
from .hashing import as_i64, head_hash
from .launch import (
    Tiling, cdiv, check_common, check_entries, check_prev_records, check_tiling, default_tiling, ring_args, source_args,
)
from .record_access import successor_hash
from .record_checks import READ_HASHES_OFF, check_records
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots

_PREV_CHAIN_HEAD = tl.constexpr(R.PREV_CHAIN_HEAD)
_PREV_SKIP = tl.constexpr(R.PREV_SKIP)
_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _verify_kernel(records, prev_records, sources, entries, n_entries, ring, tag, READS: tl.constexpr,
                   CHECK_TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    slots_ptr, positions_ptr, prev_slots_ptr, tokens_ptr, rows_ptr, context_ptr = entries
    count_launch(ring, tag)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.load(slots_ptr + offs, mask=offs < n_entries, other=0)
    live = slots != 0
    count_slots(ring, tag, tl.sum(live.to(tl.int64), axis=0))

    positions = tl.load(positions_ptr + offs, mask=live, other=0)
    prev_slots = tl.load(prev_slots_ptr + offs, mask=live, other=_PREV_SKIP)
    has_prev = live & (prev_slots >= 0)
    head = live & (prev_slots == _PREV_CHAIN_HEAD)
    context = tl.load(context_ptr + offs, mask=head, other=0)
    expected_prev_hash = as_i64(tl.where(has_prev, successor_hash(prev_records, prev_slots, has_prev),
                                         head_hash(context)))
    tokens = tl.zeros([BLOCK], tl.int64) + _UNKNOWN
    if CHECK_TOKENS:
        tokens = tl.load(tokens_ptr + offs, mask=live, other=_UNKNOWN)
    reasons, stored, expected = check_records(records, sources, READS, slots, live, positions,
                                              live & (prev_slots != _PREV_SKIP), expected_prev_hash, tokens,
                                              CHECK_TOKENS, records, READ_HASHES_OFF)

    fail = reasons != 0
    rows = tl.load(rows_ptr + offs, mask=fail, other=0)
    append_violations(ring, tag, fail, reasons, slots, positions, rows, stored, expected)


def verify_records(records: torch.Tensor, entries: VerifyEntries, sources: Sequence[RealKvSource],
                   ring: ViolationRing, tag: int, check_tokens: bool = True,
                   tiling: Tiling | None = None, *, prev_records: torch.Tensor | None = None) -> None:
    """Check each entry's record (slot 0 skipped) and append one ring row per failing entry.
    prev_records: the records prev_slots index (default: ``records``; a state group's entries
    name the FULL slot of a state's last token).

    Reasons: stored position != expected (verify_position); stored prev_hash !=
    ``head_hash(context_keys[i])`` for prev_slot -1 or != the successor hash of the record at
    prev_slot >= 0, unchecked for -2 (verify_chain_hash); with >= 1 source, the slot's
    recomputed fingerprint != real_kv_hash (verify_real_kv_hash); with check_tokens, a known
    expected token != stored (verify_token). Counts the launch in ring.kernel_runs[tag] (also
    when entries are empty) and the live entries in ring.slot_runs[tag]. No host
    synchronisation; the grid depends on tensor sizes only. ``tiling`` (default
    ``launch.default_tiling``) changes speed only.
    """
    check_common(records, sources, ring, tag)
    check_entries(entries, records.device)
    prev_records = check_prev_records(records, prev_records)
    tiling = tiling or default_tiling(sources)
    check_tiling(tiling)
    src, reads = source_args(sources, tiling.chunk)
    n = entries.slots.shape[0]
    grid = (max(1, cdiv(n, tiling.block)),)
    _verify_kernel[grid](records, prev_records, src, tuple(entries), n, ring_args(ring), tag, READS=reads,
                         CHECK_TOKENS=check_tokens, BLOCK=tiling.block, num_warps=tiling.num_warps)
