"""HEAD / RECHECK: check the records of every slot a forward reads, walked from its view."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .checks import check_int
from .inputs import ForwardView, SlotMapping
from .hashing import as_i64, head_hash
from .launch import (
    Tiling, ViewPart, check_parts, check_vector, check_view_launch, default_tiling, optional_ptr, ring_args, row_grid, view_kernel_args,
)
from .lookup import known_token, map_slot
from .record_access import REAL_KV_HASH, field_ptrs, successor_hash
from .record_checks import (
    READ_HASHES_COMPARE, READ_HASHES_OFF, READ_HASHES_STORE, check_real_kv, check_records,
)
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots, first_program, note_failure

_RESERVED = tl.constexpr(int(R.Reason.RESERVED_SLOT_WRITTEN))
_MISSING = tl.constexpr(int(R.Reason.VERIFY_MISSING_SLOT))
_VIEW_OUT_OF_RANGE = tl.constexpr(int(R.Reason.VIEW_OUT_OF_RANGE))
_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _check_sentinel(records, sources, READS: tl.constexpr, ring, tag, read_hashes, READ_HASHES: tl.constexpr,
                    BLOCK: tl.constexpr):
    """One row when slot 0's bytes changed (lane 0 only): since the canary attached
    (records[0, REAL_KV_HASH]), or with READ_HASHES_COMPARE since the STORE launch."""
    lane0 = tl.arange(0, BLOCK) == 0
    zeros = tl.zeros([BLOCK], tl.int64)
    bad, stored, fresh = check_real_kv(sources, READS, zeros, lane0, field_ptrs(records, zeros, REAL_KV_HASH),
                                       read_hashes, READ_HASHES)
    append_violations(ring, tag, bad, zeros + _RESERVED, zeros, zeros - 1, zeros - 1, stored, fresh)


@triton.jit
def _verify_view_part(records, sources, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr,
                      window, max_context, ring, tag, read_hashes, READS: tl.constexpr, MAP: tl.constexpr,
                      HAS_TOKENS: tl.constexpr, HAS_CONTEXT: tl.constexpr, SENTINEL: tl.constexpr,
                      MISSING_AT_ZERO: tl.constexpr, AFTER_FORWARD: tl.constexpr, READ_HASHES: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program (b, j) of a part checks tiles j, j + J, ... of batch row b's read positions [lo, hi)."""
    count_launch(ring, tag)
    if SENTINEL:
        if first_program():
            _check_sentinel(records, sources, READS, ring, tag, read_hashes, READ_HASHES, BLOCK)
    b = tl.program_id(0)
    in_batch = b < n_batch
    row = tl.load(rows_ptr + b, mask=in_batch, other=0)
    prefix = tl.load(prefix_ptr + b, mask=in_batch, other=0)
    hi = tl.minimum(tl.maximum(prefix, 0), max_context)  # a prefix outside [0, max_context] is reported
    lo = tl.where(window > 0, tl.maximum(hi - window, 0), 0)
    if AFTER_FORWARD:  # ring mappings only: the forward rewrote the slots of positions >= hi + extend - ring
        extend = tl.load(extend_ptr + b, mask=in_batch, other=0)
        lo = tl.minimum(tl.maximum(lo, hi + extend - MAP.ring), hi)
    if tl.program_id(1) == 0:
        count_slots(ring, tag, hi - lo)
    context = tl.zeros([BLOCK], tl.int64)
    if HAS_CONTEXT:
        context += tl.load(context_ptr + b, mask=in_batch, other=0)
    head_prev_hash = as_i64(head_hash(context))
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], tl.int64)
    if tl.program_id(1) == 0:
        bad = (offs == 0) & (zeros + prefix != zeros + hi)  # lanes, not a bool scalar (they do not mix)
        append_violations(ring, tag, bad, zeros + _VIEW_OUT_OF_RANGE, zeros, zeros + prefix, zeros + row,
                          zeros + prefix, zeros + max_context)
    for t in range(tl.program_id(1), tl.cdiv(hi - lo, BLOCK), tl.num_programs(1)):
        pos = lo + t * BLOCK + offs
        on = pos < hi
        slots = map_slot(mapping, MAP, row, pos, on)
        live = on & (slots != 0)
        # Position 0 holds the chain head; a window start's predecessor is outside the window; a
        # missing predecessor is reported at its own position.
        head = live & (pos == 0)
        prev_slots = map_slot(mapping, MAP, row, pos - 1, live & (pos > lo))
        linked = prev_slots != 0
        expected_prev_hash = tl.where(head, head_prev_hash, as_i64(successor_hash(records, prev_slots, linked)))
        want = zeros + _UNKNOWN
        if HAS_TOKENS:
            want = known_token(tokens, row, pos, live)
        reasons, stored, expected = check_records(records, sources, READS, slots, live, pos, head | linked,
                                                  expected_prev_hash, want, HAS_TOKENS, read_hashes, READ_HASHES)
        if MISSING_AT_ZERO:
            reasons, stored, expected = note_failure(on & (slots == 0), _MISSING, zeros, zeros,
                                                     reasons, stored, expected)
        append_violations(ring, tag, reasons != 0, reasons, slots, pos, row, stored, expected)


@triton.jit
def _verify_view_kernel(records0, sources0, tag0, read_hashes0, records1, sources1, tag1, read_hashes1, mapping, tokens,
                        rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr, window, max_context, ring,
                        READS0: tl.constexpr, READS1: tl.constexpr, SENTINEL0: tl.constexpr, SENTINEL1: tl.constexpr,
                        READ_HASHES0: tl.constexpr, READ_HASHES1: tl.constexpr, N_PARTS: tl.constexpr,
                        MAP: tl.constexpr, HAS_TOKENS: tl.constexpr, HAS_CONTEXT: tl.constexpr,
                        MISSING_AT_ZERO: tl.constexpr, AFTER_FORWARD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, j, i) is program (b, j) of part i (N_PARTS 1 or 2; part 1's arguments repeat
    part 0's when there is one)."""
    if tl.program_id(2) == 0:
        _verify_view_part(records0, sources0, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr,
                          window, max_context, ring, tag0, read_hashes0, READS0, MAP, HAS_TOKENS, HAS_CONTEXT,
                          SENTINEL0, MISSING_AT_ZERO, AFTER_FORWARD, READ_HASHES0, BLOCK)
    if N_PARTS == 2:
        if tl.program_id(2) == 1:
            _verify_view_part(records1, sources1, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, n_batch,
                              context_ptr, window, max_context, ring, tag1, read_hashes1, READS1, MAP, HAS_TOKENS,
                              HAS_CONTEXT, SENTINEL1, MISSING_AT_ZERO, AFTER_FORWARD, READ_HASHES1, BLOCK)


def verify_view(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping, view: ForwardView,
                ring: ViolationRing, tag: int, *, window: int, max_context: int, check_tokens: bool,
                sentinel: bool, after_forward: bool = False, read_hashes: torch.Tensor | None = None,
                missing_at_zero: bool = True, tiling: Tiling | None = None) -> None:
    """Check the record of every position batch row b reads, ``[ws_b, prefix_lens[b])`` with
    ``ws_b = max(0, prefix_lens[b] - window)`` (0 when window is 0; a prefix_lens[b] outside
    [0, max_context] is clamped there and reported once, view_out_of_range: slot 0, position and
    stored prefix_lens[b], expected max_context), at
    ``slot = mapping(rows[b], p)``; one ring row (slot, position p, row rows[b]) per failing
    position. ``after_forward``: the call follows the view's forward (RECHECK; False for HEAD).
    Then, with a ring mapping (ring > 0), positions whose ring slot the forward rewrote hold a
    newer token and are left out: ``ws_b = max(ws_b, prefix_lens[b] + extend_lens[b] - ring)``
    (at most prefix_lens[b]); other mappings ignore it.

    Reasons: slot 0 (verify_missing_slot; no other check; with missing_at_zero False, for an engine
    whose slot 0 holds a token, nothing: the position is skipped); stored position != p
    (verify_position); stored prev_hash != ``head_hash(context_keys[b])`` at p = 0, or != the
    successor hash of the record at ``mapping(rows[b], p - 1)`` for p > ws_b where that slot is
    not 0 (verify_chain_hash); with >= 1 source, the recomputed fingerprint != real_kv_hash
    (verify_real_kv_hash); with check_tokens and a token table, a known token != stored
    (verify_token). With sentinel and >= 1 source, one more row (slot 0, position -1, row -1)
    when slot 0's fingerprint != records[0, real_kv_hash] (reserved_slot_written).

    ``read_hashes`` (int64 [num_slots]) lets the launch after a forward re-read one source
    instead of all: before the forward (after_forward False) the launch also stores the last
    source's hash of every slot it reads (and of slot 0, with sentinel) there; after it
    (after_forward True) it hashes only the last source and compares with what was stored, in
    place of the fingerprint against real_kv_hash (same reasons). The second launch takes the
    same sources, and its read set lies within the first's.

    Counts the launch in ring.kernel_runs[tag] and the positions checked (missing ones
    included) in ring.slot_runs[tag]. Graph-safe: no host synchronisation, and a grid of
    (batch rows, programs per row) sized from the batch capacity (rows.shape[0]) and ``window``
    (or ``max_context``) only; programs loop over their row's tiles. ``tiling`` (default
    ``launch.default_tiling``) changes speed only.
    """
    verify_view_parts([ViewPart(records, sources, tag, read_hashes)], mapping, view, ring, window=window,
                      max_context=max_context, check_tokens=check_tokens, sentinel=sentinel,
                      after_forward=after_forward, missing_at_zero=missing_at_zero, tiling=tiling)


def verify_view_parts(parts: Sequence[ViewPart], mapping: SlotMapping, view: ForwardView, ring: ViolationRing, *,
                      window: int, max_context: int, check_tokens: bool, sentinel: bool, after_forward: bool = False,
                      missing_at_zero: bool = True, tiling: Tiling | None = None) -> None:
    """``verify_view`` of each part (its records, sources, tag and read_hashes; a pool group's K
    and V halves, whose records share the mapping and the slot count) in one launch: the parts'
    programs run side by side (the grid's third dimension); at most MAX_PARTS. Exactly what a
    verify_view per part logs (the rows' order in the ring aside); ``tiling`` defaults to the
    widest source's."""
    for part in parts:
        check_view_launch(part.records, part.sources, mapping, view, ring, part.tag)
    check_parts(parts, ViewPart)
    args, tags, hashes, sentinels, modes = [], [], [], [], []
    first = parts[0].records
    for part in parts:
        sources, read_mode = part.sources, READ_HASHES_OFF
        if part.read_hashes is not None:
            check_vector("read_hashes", part.read_hashes, first.device, first.shape[0])
            read_mode = READ_HASHES_COMPARE if after_forward else READ_HASHES_STORE
            sources = sources[-1:] if after_forward else sources
        args.append(sources)
        tags.append(part.tag)
        hashes.append(optional_ptr(part.read_hashes, part.records))
        sentinels.append(sentinel and bool(sources))
        modes.append(read_mode.value)
    check_int("window", window, 0)
    check_int("max_context", max_context, 1)
    tiling = tiling or default_tiling([src for sources in args for src in sources])
    a = [view_kernel_args(part.records, sources, mapping, view, tiling) for part, sources in zip(parts, args)]
    grid = (*row_grid(view.rows.shape[0], window or max_context, tiling.block, first.device), len(parts))
    per_part = [(part.records, x.sources, tag, hashes_ptr) for part, x, tag, hashes_ptr in zip(parts, a, tags, hashes)]
    second = len(parts) - 1  # part 1's arguments: part 0's again when there is one
    _verify_view_kernel[grid](
        *per_part[0], *per_part[second], a[0].mapping, a[0].tokens, *a[0].batch, a[0].context, window, max_context,
        ring_args(ring), READS0=a[0].reads, READS1=a[second].reads, SENTINEL0=sentinels[0],
        SENTINEL1=sentinels[second], READ_HASHES0=modes[0], READ_HASHES1=modes[second], N_PARTS=len(parts),
        MAP=a[0].map_consts, HAS_TOKENS=a[0].has_tokens and check_tokens, HAS_CONTEXT=a[0].has_context,
        MISSING_AT_ZERO=missing_at_zero, AFTER_FORWARD=after_forward and mapping.ring > 0, BLOCK=tiling.block,
        num_warps=tiling.num_warps,
    )
