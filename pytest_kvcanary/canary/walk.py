"""The sweep's first step: check a prefix-cache walk from the engine before planning with it.

A corrupted cache structure is what the canary exists to report, so a malformed walk is reported,
never asserted on. Each entry is compared with the FULL slot space (``space`` slots) and with the
walk itself:

- ``walk_slot_out_of_range``: its slot is outside ``[0, space)``, or its predecessor is neither a
  slot of that range nor PREV_CHAIN_HEAD (stored: the slot, expected: ``space``);
- ``walk_duplicate_slot``: its slot is listed more than once, as after a stale radix node stays
  linked when its slot was freed and reused (stored: the listings, expected: 1);
- ``walk_position_gap``: its position is negative, or its predecessor is listed at a position other
  than the previous one (stored: the predecessor's position, expected: position - 1);
- ``walk_too_large``: one row when the walk holds more entries than ``space`` (slot -1; stored:
  the entries, expected: ``space``).

The sweep then checks the entries it can (in range, first listing of each slot).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcanary_kernels.records import (COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STORED,
                                      PREV_CHAIN_HEAD, ROW_WIDTH, Reason)
from kvcanary_kernels.reference import fold_checks

from .host import CacheWalk


class CheckedWalk(NamedTuple):
    """The entries the sweep can check, and the violation rows ([n, ROW_WIDTH] int64, tag and step
    columns left to ``ViolationRing.append``) of the malformed ones."""

    walk: CacheWalk
    rows: torch.Tensor


def check_walk(walk: CacheWalk, space: int) -> CheckedWalk:
    """Check `walk` against a FULL slot space of `space` slots (see the module docstring). A
    well-formed walk (every entry in range, listed once, after its predecessor) takes no boolean
    compaction and no fold of the reasons: the checks' masks are all it costs."""
    slots = walk.slots.to(torch.int64)
    positions = walk.positions.to(torch.int64)
    prev = walk.prev_slots.to(torch.int64)
    n = slots.numel()
    in_range = (slots >= 0) & (slots < space)
    prev_in_range = (prev == PREV_CHAIN_HEAD) | ((prev >= 0) & (prev < space))
    all_in_range = bool(in_range.all())
    safe = slots if all_in_range else torch.where(in_range, slots, 0)
    listings = torch.bincount(safe if all_in_range else safe[in_range], minlength=space)[safe]
    repeated = in_range & (listings > 1)
    first = torch.ones(n, dtype=torch.bool, device=slots.device)
    if bool(repeated.any()):  # the first listing of each slot (sorting only where one repeats)
        key = torch.where(in_range, slots, -1)
        order = torch.sort(key, stable=True).indices
        sorted_keys = key[order]
        first[order[1:]] = sorted_keys[1:] != sorted_keys[:-1]
    keep = in_range & prev_in_range & first
    kept_all = bool(keep.all())
    position_of = torch.full((space,), -1, dtype=torch.int64, device=slots.device)
    if kept_all:
        position_of[safe] = positions
    else:
        position_of[safe[keep]] = positions[keep]
    prev_position = position_of[torch.where(prev_in_range & (prev >= 0), prev, 0)]
    gap = (positions < 0) | (prev_in_range & (prev >= 0) & (prev_position >= 0) & (prev_position != positions - 1))
    out_of_range = ~in_range | ~prev_in_range

    rows = torch.zeros(0, ROW_WIDTH, dtype=torch.int64, device=slots.device)
    if bool((out_of_range | repeated | gap).any()):
        failing = {
            Reason.WALK_SLOT_OUT_OF_RANGE: (out_of_range, torch.where(in_range, prev, slots),
                                            torch.full_like(slots, space)),
            Reason.WALK_DUPLICATE_SLOT: (repeated, listings, torch.ones_like(slots)),
            Reason.WALK_POSITION_GAP: (gap, prev_position, positions - 1),
        }
        bits, stored, expected = fold_checks(failing, slots)
        bad = (bits != 0).nonzero().squeeze(1)
        rows = torch.zeros(bad.numel(), ROW_WIDTH, dtype=torch.int64, device=slots.device)
        for col, value in ((COL_REASONS, bits), (COL_SLOT, slots), (COL_POSITION, positions), (COL_STORED, stored),
                           (COL_EXPECTED, expected)):
            rows[:, col] = value[bad]
        rows[:, COL_ROW] = -1
    if n > space:
        too_large = torch.zeros(1, ROW_WIDTH, dtype=torch.int64, device=slots.device)
        too_large[0, [COL_REASONS, COL_SLOT, COL_POSITION, COL_ROW, COL_STORED, COL_EXPECTED]] = torch.tensor(
            [int(Reason.WALK_TOO_LARGE), -1, -1, -1, n, space], device=slots.device)
        rows = torch.cat([too_large, rows])
    if kept_all:
        return CheckedWalk(walk, rows)
    return CheckedWalk(CacheWalk(*(None if t is None else t[keep] for t in walk)), rows)
