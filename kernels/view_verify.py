"""HEAD / RECHECK: check the records of every slot a forward reads, walked from its view."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .entries import MappingArgs, ViewArgs
from .fingerprint import slot_fingerprint
from .hashing import as_i64, head_hash
from .launch import (
    DEFAULT_TILING, Tiling, check_int, check_tiling, check_view_launch, mapping_args, ring_args, row_grid,
    source_args, token_args,
)
from .lookup import known_token, map_slot
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs, successor_hash
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots, first_program, note_failure

_RESERVED = tl.constexpr(int(R.Reason.RESERVED_SLOT_WRITTEN))
_MISSING = tl.constexpr(int(R.Reason.VERIFY_MISSING_SLOT))
_POSITION = tl.constexpr(int(R.Reason.VERIFY_POSITION))
_TOKEN = tl.constexpr(int(R.Reason.VERIFY_TOKEN))
_CHAIN = tl.constexpr(int(R.Reason.VERIFY_CHAIN_HASH))
_REAL_KV = tl.constexpr(int(R.Reason.VERIFY_REAL_KV_HASH))
_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _check_sentinel(records, sources, READS: tl.constexpr, ring, tag, BLOCK: tl.constexpr):
    """One row when slot 0's bytes no longer hash to records[0, REAL_KV_HASH] (lane 0 only)."""
    lane0 = tl.arange(0, BLOCK) == 0
    zeros = tl.zeros([BLOCK], tl.int64)
    fingerprint = as_i64(slot_fingerprint(sources, READS, zeros, lane0))
    stored = tl.load(field_ptrs(records, zeros, REAL_KV_HASH), mask=lane0, other=0)
    append_violations(ring, tag, lane0 & (stored != fingerprint), zeros + _RESERVED, zeros, zeros - 1,
                      zeros - 1, stored, fingerprint)


@triton.jit
def _verify_view_kernel(records, sources, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, context_ptr, n_batch,
                        window, ring, tag, READS: tl.constexpr, MAP: tl.constexpr, HAS_TOKENS: tl.constexpr,
                        HAS_CONTEXT: tl.constexpr, SENTINEL: tl.constexpr, AFTER_FORWARD: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (b, j) checks tiles j, j + J, ... of batch row b's read positions [lo, hi)."""
    count_launch(ring, tag)
    if SENTINEL:
        if first_program():
            _check_sentinel(records, sources, READS, ring, tag, BLOCK)
    b = tl.program_id(0)
    in_batch = b < n_batch
    row = tl.load(rows_ptr + b, mask=in_batch, other=0)
    hi = tl.load(prefix_ptr + b, mask=in_batch, other=0)
    lo = tl.where(window > 0, tl.maximum(hi - window, 0), 0)
    if AFTER_FORWARD:  # ring mappings only: the forward rewrote the slots of positions >= hi + extend - ring
        extend = tl.load(extend_ptr + b, mask=in_batch, other=0)
        lo = tl.minimum(tl.maximum(lo, hi + extend - MAP[1]), hi)
    if tl.program_id(1) == 0:
        count_slots(ring, tag, hi - lo)
    context = tl.zeros([BLOCK], tl.int64)
    if HAS_CONTEXT:
        context += tl.load(context_ptr + b, mask=in_batch, other=0)
    head_prev_hash = as_i64(head_hash(context))
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], tl.int64)
    for t in range(tl.program_id(1), tl.cdiv(hi - lo, BLOCK), tl.num_programs(1)):
        pos = lo + t * BLOCK + offs
        on = pos < hi
        slots = map_slot(mapping, MAP, row, pos, on)
        live = on & (slots != 0)
        stored_position = tl.load(field_ptrs(records, slots, POSITION), mask=live, other=0)
        stored_prev_hash = tl.load(field_ptrs(records, slots, PREV_HASH), mask=live, other=0)
        # Position 0 holds the chain head; a window start's predecessor is outside the window; a
        # missing predecessor is reported at its own position.
        head = live & (pos == 0)
        prev_slots = map_slot(mapping, MAP, row, pos - 1, live & (pos > lo))
        linked = prev_slots != 0
        expected_prev_hash = tl.where(head, head_prev_hash, as_i64(successor_hash(records, prev_slots, linked)))

        reasons, stored, expected = zeros, zeros, zeros
        if len(READS) > 0:
            fingerprint = as_i64(slot_fingerprint(sources, READS, slots, live))
            stored_kv = tl.load(field_ptrs(records, slots, REAL_KV_HASH), mask=live, other=0)
            reasons, stored, expected = note_failure(live & (stored_kv != fingerprint), _REAL_KV,
                                                     stored_kv, fingerprint, reasons, stored, expected)
        bad_chain = (head | linked) & (stored_prev_hash != expected_prev_hash)
        reasons, stored, expected = note_failure(bad_chain, _CHAIN, stored_prev_hash, expected_prev_hash,
                                                 reasons, stored, expected)
        if HAS_TOKENS:
            want = known_token(tokens, row, pos, live)
            stored_token = tl.load(field_ptrs(records, slots, TOKEN), mask=live, other=0)
            reasons, stored, expected = note_failure((want != _UNKNOWN) & (stored_token != want), _TOKEN,
                                                     stored_token, want, reasons, stored, expected)
        reasons, stored, expected = note_failure(live & (stored_position != pos), _POSITION,
                                                 stored_position, pos, reasons, stored, expected)
        reasons, stored, expected = note_failure(on & (slots == 0), _MISSING, zeros, zeros,
                                                 reasons, stored, expected)
        append_violations(ring, tag, reasons != 0, reasons, slots, pos, row, stored, expected)


def verify_view(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: MappingArgs, view: ViewArgs,
                ring: ViolationRing, tag: int, *, window: int, max_context: int, check_tokens: bool,
                sentinel: bool, after_forward: bool = False, tiling: Tiling | None = None) -> None:
    """Check the record of every position batch row b reads, ``[ws_b, prefix_lens[b])`` with
    ``ws_b = max(0, prefix_lens[b] - window)`` (0 when window is 0), at
    ``slot = mapping(rows[b], p)``; one ring row (slot, position p, row rows[b]) per failing
    position. ``after_forward``: the call follows the view's forward (RECHECK; False for HEAD).
    Then, with a ring mapping (ring > 0), positions whose ring slot the forward rewrote hold a
    newer token and are left out: ``ws_b = max(ws_b, prefix_lens[b] + extend_lens[b] - ring)``
    (at most prefix_lens[b]); other mappings ignore it.

    Reasons: slot 0 (verify_missing_slot; no other check); stored position != p
    (verify_position); stored prev_hash != ``head_hash(context_keys[b])`` at p = 0, or != the
    successor hash of the record at ``mapping(rows[b], p - 1)`` for p > ws_b where that slot is
    not 0 (verify_chain_hash); with >= 1 source, the recomputed fingerprint != real_kv_hash
    (verify_real_kv_hash); with check_tokens and a token table, a known token != stored
    (verify_token). With sentinel and >= 1 source, one more row (slot 0, position -1, row -1)
    when slot 0's fingerprint != records[0, real_kv_hash] (reserved_slot_written).

    Counts the launch in ring.kernel_runs[tag] and the positions checked (missing ones
    included) in ring.slot_runs[tag]. Graph-safe: no host synchronisation, and a grid of
    (batch rows, programs per row) sized from the batch capacity (rows.shape[0]) and ``window``
    (or ``max_context``) only; programs loop over their row's tiles. ``tiling`` (default
    DEFAULT_TILING) changes speed only.
    """
    check_view_launch(records, sources, mapping, view, ring, tag)
    check_int("window", window, 0)
    check_int("max_context", max_context, 1)
    tiling = tiling or DEFAULT_TILING
    check_tiling(tiling)
    src, reads = source_args(sources, tiling.chunk)
    mapping_tuple, map_consts = mapping_args(mapping, records)
    token_tuple, has_tokens = token_args(view, records)
    batch = view.rows.shape[0]
    grid = row_grid(batch, window or max_context, tiling.block, records.device)
    _verify_view_kernel[grid](
        records, src, mapping_tuple, token_tuple, view.rows, view.prefix_lens, view.extend_lens,
        records if view.context_keys is None else view.context_keys, batch, window, ring_args(ring), tag,
        READS=reads, MAP=map_consts, HAS_TOKENS=has_tokens and check_tokens,
        HAS_CONTEXT=view.context_keys is not None, SENTINEL=sentinel and bool(sources),
        AFTER_FORWARD=after_forward and mapping.ring > 0,
        BLOCK=tiling.block, num_warps=tiling.num_warps,
    )
