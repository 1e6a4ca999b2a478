"""TAIL: stamp the records of the slots a forward has just written, walked from its view."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import records as R
from .inputs import ForwardView, SlotMapping
from .fingerprint import slot_fingerprint
from .hashing import LINK_INVERSE_JIT, LINK_JIT, as_i64, as_u64, compose, head_hash, link_term, mix
from .launch import (
    StampPart, Tiling, batch_lanes, cdiv, check_parts, check_stamp_launch, default_tiling, input_args, next_power_of_2,
    optional_ptr, ring_args, row_grid, view_kernel_args,
)
from .lookup import known_token, map_slot
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs, successor_hash
from .ring import ViolationRing
from .sources import RealKvSource
from .violation_log import append_violations, count_launch, count_slots, note_failure

_WRITE_POSITION = tl.constexpr(int(R.Reason.WRITE_POSITION))
_WRITE_TOKEN = tl.constexpr(int(R.Reason.WRITE_TOKEN))
_WRITE_REAL_KV = tl.constexpr(int(R.Reason.WRITE_REAL_KV_HASH))
_VIEW_OUT_OF_RANGE = tl.constexpr(int(R.Reason.VIEW_OUT_OF_RANGE))


@triton.jit
def _clamped(extend, n_tokens):
    """A row's extend as stamped: within [0, n_tokens] (one outside is reported)."""
    return tl.minimum(tl.maximum(extend, 0), n_tokens)
_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def _first_stamped(extend, MAP: tl.constexpr):
    """The first entry of a row that keeps its slot: with a ring, only the last ``ring`` of its
    ``extend`` entries (earlier ones are overwritten within the forward); else entry 0."""
    first = extend * 0
    if MAP.ring > 0:
        first = tl.maximum(extend - MAP.ring, 0)
    return first


@triton.jit
def _batch_row(b, rows_ptr, prefix_ptr, extend_ptr, n_batch, n_tokens, BATCH: tl.constexpr):
    """Batch row b as stamped: (its first token's index, row, prefix_len, extend_len as given,
    extend_len clamped); zeros past n_batch."""
    in_batch = b < n_batch
    lanes = tl.arange(0, BATCH)
    start = tl.sum(_clamped(tl.load(extend_ptr + lanes, mask=lanes < b, other=0), n_tokens), axis=0)
    row = tl.load(rows_ptr + b, mask=in_batch, other=0)
    prefix = tl.load(prefix_ptr + b, mask=in_batch, other=0)
    given = tl.load(extend_ptr + b, mask=in_batch, other=0)
    return start, row, prefix, given, _clamped(given, n_tokens)


@triton.jit
def _written_fingerprint(written_ptr, stride, token_index, live, N_WRITTEN: tl.constexpr):
    """int64 fingerprint of what the forward computed for each token: its per-source row hashes
    (row s of ``written``) folded as a slot's sources fold, ``acc = mix(acc ^ h)``."""
    acc = tl.zeros(token_index.shape, tl.uint64)
    for s in tl.static_range(N_WRITTEN):
        acc = mix(acc ^ as_u64(tl.load(written_ptr + s * stride + token_index, mask=live, other=0)))
    return as_i64(acc)


@triton.jit
def _stamp_records_part(records, sources, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, n_batch, input_ids,
                        positions_ptr, n_tokens, written_ptr, written_stride, ring, tag, READS: tl.constexpr,
                        MAP: tl.constexpr, HAS_TOKENS: tl.constexpr,
                        CHECK_WRITE: tl.constexpr, N_WRITTEN: tl.constexpr, BATCH: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Token, position and fingerprint of each written slot's record (not PREV_HASH), and the
    write checks. Program (b, j) of a part stamps tiles j, j + J, ... of batch row b's extend."""
    count_launch(ring, tag)
    token_start, row, prefix, given, extend = _batch_row(tl.program_id(0), rows_ptr, prefix_ptr, extend_ptr, n_batch,
                                                         n_tokens, BATCH)
    first = _first_stamped(extend, MAP)
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], tl.int64)
    if tl.program_id(1) == 0:
        append_violations(ring, tag, (offs == 0) & (zeros + given != zeros + extend), zeros + _VIEW_OUT_OF_RANGE, zeros,
                          zeros + prefix, zeros + row, zeros + given, zeros + n_tokens)
    stamped = zeros
    for t in range(tl.program_id(1), tl.cdiv(extend - first, BLOCK), tl.num_programs(1)):
        j = first + t * BLOCK + offs
        token_index = token_start + j
        pos = prefix + j
        slots = map_slot(mapping, MAP, row, pos, (j < extend) & (token_index < n_tokens))
        live = slots != 0
        stamped += live.to(tl.int64)
        token = tl.load(input_ids + token_index, mask=live, other=0)
        position = tl.load(positions_ptr + token_index, mask=live, other=0)
        tl.store(field_ptrs(records, slots, TOKEN), token, mask=live)
        tl.store(field_ptrs(records, slots, POSITION), position, mask=live)
        fingerprint = zeros
        if len(READS) > 0:
            fingerprint = as_i64(slot_fingerprint(sources, READS, slots, live)[0])
        tl.store(field_ptrs(records, slots, REAL_KV_HASH), fingerprint, mask=live)
        if CHECK_WRITE or N_WRITTEN > 0:
            reasons, stored, expected = zeros, zeros, zeros
            if N_WRITTEN > 0:
                written = _written_fingerprint(written_ptr, written_stride, token_index, live, N_WRITTEN)
                reasons, stored, expected = note_failure(live & (fingerprint != written), _WRITE_REAL_KV,
                                                         fingerprint, written, reasons, stored, expected)
            if CHECK_WRITE:
                if HAS_TOKENS:
                    want = known_token(tokens, row, pos, live)
                    reasons, stored, expected = note_failure((want != _UNKNOWN) & (token != want), _WRITE_TOKEN,
                                                             token, want, reasons, stored, expected)
                reasons, stored, expected = note_failure(live & (position != pos), _WRITE_POSITION,
                                                         position, pos, reasons, stored, expected)
            append_violations(ring, tag, reasons != 0, reasons, slots, pos, row, stored, expected)
    count_slots(ring, tag, tl.sum(stamped, axis=0))


@triton.jit
def _stamp_chain_part(records, mapping, inputs, rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr,
                      MAP: tl.constexpr, HAS_CONTEXT: tl.constexpr, BATCH: tl.constexpr, BLOCK: tl.constexpr):
    """Program b of a part: batch row b's prev_hash chain, a tile of BLOCK entries at a time, each
    tile one prefix scan of the entries' links (``compose``) applied to the running hash; stores
    each stamped slot's prev_hash (the PREV_HASH field only)."""
    b = tl.program_id(0)
    in_batch = b < n_batch
    input_ids, positions_ptr, n_tokens = inputs
    start, row, prefix, _, extend = _batch_row(b, rows_ptr, prefix_ptr, extend_ptr, n_batch, n_tokens, BATCH)
    first = _first_stamped(extend, MAP)
    context = tl.full([], 0, tl.int64)
    if HAS_CONTEXT:
        context = tl.load(context_ptr + b, mask=in_batch, other=0)
    seeded = in_batch & (prefix > 0)
    seed_slot = map_slot(mapping, MAP, row, prefix - 1, seeded)
    chain = tl.where(seeded, successor_hash(records, seed_slot, seeded), head_hash(context))
    offs = tl.arange(0, BLOCK)
    last = offs == BLOCK - 1
    for t in range(0, tl.cdiv(extend, BLOCK)):
        j = t * BLOCK + offs
        slots = map_slot(mapping, MAP, row, prefix + j, (j < extend) & (start + j < n_tokens))
        written = slots != 0  # every entry with a slot links, stamped or overwritten later in the forward
        token = as_u64(tl.load(input_ids + start + j, mask=written, other=0))
        position = as_u64(tl.load(positions_ptr + start + j, mask=written, other=0))
        term = tl.where(written, link_term(token, position), 0)
        multiplier = tl.where(written, LINK_JIT, 1).to(tl.uint64)
        scale, shift = tl.associative_scan((multiplier, term), 0, compose)
        linked = chain * scale + shift  # the running hash after each entry
        before = (linked - term) * LINK_INVERSE_JIT
        tl.store(field_ptrs(records, slots, PREV_HASH), as_i64(before), mask=written & (j >= first))
        chain = tl.sum(tl.where(last, linked, 0), axis=0)


@triton.jit
def _stamp_records_kernel(records0, sources0, written0, tag0, records1, sources1, written1, tag1, mapping, tokens,
                          rows_ptr, prefix_ptr, extend_ptr, n_batch, input_ids, positions_ptr, n_tokens,
                          written_stride0, written_stride1, ring, READS0: tl.constexpr, READS1: tl.constexpr,
                          N_WRITTEN0: tl.constexpr, N_WRITTEN1: tl.constexpr, N_PARTS: tl.constexpr,
                          MAP: tl.constexpr, HAS_TOKENS: tl.constexpr, CHECK_WRITE: tl.constexpr,
                          BATCH: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, j, i) is program (b, j) of part i (N_PARTS 1 or 2; part 1's arguments repeat
    part 0's when there is one)."""
    if tl.program_id(2) == 0:
        _stamp_records_part(records0, sources0, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, n_batch, input_ids,
                            positions_ptr, n_tokens, written0, written_stride0, ring, tag0, READS0, MAP, HAS_TOKENS,
                            CHECK_WRITE, N_WRITTEN0, BATCH, BLOCK)
    if N_PARTS == 2:
        if tl.program_id(2) == 1:
            _stamp_records_part(records1, sources1, mapping, tokens, rows_ptr, prefix_ptr, extend_ptr, n_batch,
                                input_ids, positions_ptr, n_tokens, written1, written_stride1, ring, tag1, READS1, MAP,
                                HAS_TOKENS, CHECK_WRITE, N_WRITTEN1, BATCH, BLOCK)


@triton.jit
def _stamp_chain_kernel(records0, records1, mapping, inputs, rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr,
                        N_PARTS: tl.constexpr, MAP: tl.constexpr, HAS_CONTEXT: tl.constexpr, BATCH: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (b, i) is program b of part i (N_PARTS 1 or 2; records1 is records0 when there is one)."""
    if tl.program_id(1) == 0:
        _stamp_chain_part(records0, mapping, inputs, rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr, MAP,
                          HAS_CONTEXT, BATCH, BLOCK)
    if N_PARTS == 2:
        if tl.program_id(1) == 1:
            _stamp_chain_part(records1, mapping, inputs, rows_ptr, prefix_ptr, extend_ptr, n_batch, context_ptr, MAP,
                              HAS_CONTEXT, BATCH, BLOCK)


CHAIN_MAX_BLOCK = 1024


def chain_block(n_tokens: int, n_batch: int) -> int:
    """Entries per tile of the chain's scan: a row's mean share of the tokens rounded up to a power
    of two, within [16, CHAIN_MAX_BLOCK] (a longer row takes more tiles)."""
    return min(CHAIN_MAX_BLOCK, max(16, next_power_of_2(cdiv(n_tokens, max(n_batch, 1)))))


def stamp_view(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping, view: ForwardView,
               ring: ViolationRing, tag: int, *, check_tokens: bool, check_write_inputs: bool,
               written_source_hashes: torch.Tensor | None = None, tiling: Tiling | None = None) -> None:
    """Write ``(token, position, prev_hash, fingerprint)`` into the record of every slot the
    forward wrote: for batch row b and j in [0, extend_lens[b]) (an extend outside [0, T] is
    clamped there and reported once, view_out_of_range: slot 0, position prefix_lens[b], stored
    extend_lens[b], expected T), token t = start_b + j (start_b: the clamped extends before b), position
    p = prefix_lens[b] + j, slot = mapping(rows[b], p); slot 0 is skipped (no record, no chain
    step), and so are tokens past T. With a ring mapping (ring > 0), only the last ``ring``
    entries of a row are stamped, ``j >= extend_lens[b] - ring`` (earlier ones land in slots the
    same forward overwrites), so no two stamped entries of a row share a slot.

    The record takes input_ids[t], positions[t], the slot's fingerprint, and the running chain of
    its row: seeded with ``head_hash(context_keys[b])`` when prefix_lens[b] is 0, else with the
    successor hash of the record at ``mapping(rows[b], prefix_lens[b] - 1)`` as it was before the
    call (a ring rewrites it when extend_lens[b] >= ring; when the slot is 0, record 0, whose
    chain no HEAD checks across the hole); every entry with a slot, stamped or not, folds its
    token and position into the chain, and a stamped one first takes the running value.

    One ring row (slot, position p, row rows[b]) per stamped entry failing a check: with
    check_write_inputs, positions[t] != p (write_position) and, with check_tokens and a token
    table, a known token != input_ids[t] (write_token); with written_source_hashes ([len(sources),
    >= T] int64: row s holds source s's hash of what the forward computed for each token, as
    ``source_hash_rows`` writes it), the fingerprint != their fold ``acc = mix(acc ^ h)`` over the
    rows, what the slot would fingerprint as had it kept the forward's bytes (write_real_kv_hash). The write-input
    checks compare what the forward consumed (view.input_ids / positions, the tensors its model
    read) with the engine's bookkeeping: write_position with p = prefix_lens[b] + j, the position
    whose slot the entry wrote (stored: positions[t], expected: p); write_token with the token
    table's token at (rows[b], p) (stored: input_ids[t], expected: the table's).

    Counts the call once in ring.kernel_runs[tag] and the stamped slots in ring.slot_runs[tag].
    Two launches (``stamp_view_parts``), graph-safe, grids from the batch and token capacities only: one program per
    batch row that writes prev_hash (a prefix scan of the row's links per tile of
    ``chain_block(T, B)`` entries; it reads the seed record first), then one over (batch rows,
    programs per row) that writes the rest (bandwidth-bound).
    """
    stamp_view_parts([StampPart(records, sources, tag, written_source_hashes)], mapping, view, ring,
                     check_tokens=check_tokens, check_write_inputs=check_write_inputs, tiling=tiling)


def stamp_view_parts(parts: Sequence[StampPart], mapping: SlotMapping, view: ForwardView, ring: ViolationRing, *,
                     check_tokens: bool, check_write_inputs: bool, tiling: Tiling | None = None) -> None:
    """``stamp_view`` of each part (its records, sources, tag and written_source_hashes; a pool
    group's K and V halves, whose records share the mapping and the slot count) in the same two
    launches, the parts' programs side by side; at most MAX_PARTS. Exactly what a stamp_view per
    part stamps and logs (the rows' order in the ring aside)."""
    for part in parts:
        check_stamp_launch(part.records, part.sources, mapping, view, ring, part.tag, part.written_source_hashes)
    check_parts(parts, StampPart)
    first = parts[0].records
    tiling = tiling or default_tiling([src for part in parts for src in part.sources])
    a = [view_kernel_args(part.records, part.sources, mapping, view, tiling) for part in parts]
    inputs, lanes = input_args(view), batch_lanes(view)
    n_batch, n_tokens = a[0].batch[-1], inputs[-1]
    second = len(parts) - 1  # part 1's arguments: part 0's again when there is one
    if n_batch:
        block = chain_block(n_tokens, n_batch)
        _stamp_chain_kernel[(n_batch, len(parts))](
            first, parts[second].records, a[0].mapping, inputs, *a[0].batch, a[0].context, N_PARTS=len(parts),
            MAP=a[0].map_consts, HAS_CONTEXT=a[0].has_context, BATCH=lanes, BLOCK=block,
            num_warps=min(4, block // 32) or 1,
        )
    written = [optional_ptr(part.written_source_hashes, part.records) for part in parts]
    per_part = [(part.records, x.sources, w, part.tag) for part, x, w in zip(parts, a, written)]
    n_written = [0 if part.written_source_hashes is None else len(part.sources) for part in parts]
    _stamp_records_kernel[(*row_grid(n_batch, n_tokens, tiling.block, first.device), len(parts))](
        *per_part[0], *per_part[second], a[0].mapping, a[0].tokens, *a[0].batch, *inputs, written[0].stride(0),
        written[second].stride(0), ring_args(ring), READS0=a[0].reads, READS1=a[second].reads,
        N_WRITTEN0=n_written[0], N_WRITTEN1=n_written[second], N_PARTS=len(parts), MAP=a[0].map_consts,
        HAS_TOKENS=a[0].has_tokens and check_tokens, CHECK_WRITE=check_write_inputs, BATCH=lanes,
        BLOCK=tiling.block, num_warps=tiling.num_warps,
    )
