"""Device-side lookups through the engine's per-(row, position) tables: the slot mapping (see
inputs.SlotMapping) and the token table. ``map_slot`` and ``known_token`` mirror the torch
``reference.map_slot_ref`` and ``reference.known_token_ref`` (the canary's host-side slot lookups
use the former): change one, change the other; tests compare them on random tables.

Each table travels into a kernel as one tuple: ``launch.mapping_args(mapping, records)`` gives
``(table, row_stride, col_stride, table_rows, table_cols, full_to_group, n_full, num_slots)`` and
the constexpr ``MAP``, a ``launch.MapConsts`` (page_size, ring, has_full_to_group); ``launch.token_args(view, records)`` gives
``(token_table, row_stride, col_stride, table_rows, table_cols)`` plus HAS_TOKENS. ``rows`` may be
a scalar (one batch row per tile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import records as R

_UNKNOWN = tl.constexpr(R.UNKNOWN)


@triton.jit
def map_slot(mapping, MAP: tl.constexpr, rows, positions, mask):
    """int64 slot holding (rows, positions) in each lane. 0 off ``mask``, at negative positions,
    where the table entry is 0 (block 0 of a block table is the null block) and wherever the
    lookup leaves the table, full_to_group or the pool (not resident). Mirrors
    ``reference.map_slot_ref``."""
    table, row_stride, col_stride, table_rows, table_cols, full_to_group, n_full, num_slots = mapping
    rows = tl.zeros_like(positions) + rows  # a lane per position (bool scalars do not mix with masks)
    logical = positions
    if MAP.ring > 0:
        logical = positions % MAP.ring
    cols = logical // MAP.page_size
    ok = mask & (positions >= 0) & (rows >= 0) & (rows < table_rows) & (cols < table_cols)
    entry = tl.load(table + rows * row_stride + cols * col_stride, mask=ok, other=0).to(tl.int64)
    ok &= entry != 0
    slots = entry * MAP.page_size + logical % MAP.page_size
    if MAP.has_full_to_group:
        ok &= (slots >= 0) & (slots < n_full)
        slots = tl.load(full_to_group + slots, mask=ok, other=0)
    return tl.where(ok & (slots >= 0) & (slots < num_slots), slots, 0)


@triton.jit
def known_token(tokens, rows, positions, mask):
    """The token the engine believes (rows, positions) holds; UNKNOWN off ``mask`` and off the table."""
    table, row_stride, col_stride, table_rows, table_cols = tokens
    rows = tl.zeros_like(positions) + rows
    ok = mask & (rows >= 0) & (rows < table_rows) & (positions >= 0) & (positions < table_cols)
    return tl.load(table + rows * row_stride + positions * col_stride, mask=ok, other=_UNKNOWN)
