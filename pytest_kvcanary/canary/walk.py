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

The sweep then checks the entries it can (in range, first listing of each slot). A ``PagedWalk``
lists each slot once by its shape and is checked page by page (a page's slots follow each other by
construction); one that breaks a rule is checked as the list of its entries, with the same rows.

A walk on the host is first checked with numpy, which takes a well-formed one whole; any other is
checked with torch on one intra-op thread (``one_host_thread``; benchmarks/RESULTS.md says why).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple

import numpy as np
import torch

from kvcanary_kernels.records import (COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STORED,
                                      PREV_CHAIN_HEAD, ROW_WIDTH, Reason)
from kvcanary_kernels.reference import fold_checks

from .seam_data import CacheWalk, PagedWalk, page_entries


class CheckedWalk(NamedTuple):
    """The entries the sweep can check (a well-formed paged walk as it is), and the violation rows
    ([n, ROW_WIDTH] int64, tag and step columns left to ``ViolationRing.append``) of the malformed
    ones."""

    walk: CacheWalk | PagedWalk
    rows: torch.Tensor


@contextmanager
def one_host_thread() -> Iterator[None]:
    """torch's CPU operations on one intra-op thread inside the block (the count restored after)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _well_formed_on_host(walk: CacheWalk, space: int) -> bool:
    """True when a walk on the host breaks none of the module docstring's rules, checked with
    numpy (a few microseconds an operation where torch's CPU operations cost tens on a busy GPU
    host). False for anything else, which `check_walk` then checks and reports in full."""
    if walk.slots.numel() > space:
        return False
    slots, positions, prev = (np.asarray(t.numpy(), dtype=np.int64) for t in walk[:3])
    if slots.size == 0:
        return True
    if slots.min() < 0 or slots.max() >= space or positions.min() < 0 or prev.max() >= space:
        return False
    if prev.min() < PREV_CHAIN_HEAD:  # PREV_CHAIN_HEAD is -1: the one negative allowed
        return False
    position_of = np.full(space, -1, dtype=np.int64)
    position_of[slots] = positions
    if np.count_nonzero(position_of >= 0) != slots.size:
        return False  # a slot listed twice
    listed = position_of[np.maximum(prev, 0)]
    return bool(((prev < 0) | (listed < 0) | (listed == positions - 1)).all())


def paged_entries(walk: PagedWalk) -> CacheWalk:
    """The slots of a paged walk's listed pages as a list of entries, in slot order."""
    first = walk.first_positions.numpy()
    pages = np.flatnonzero(first != -1)
    return page_entries(walk.page_size, pages, first[pages], walk.prev_slots.numpy()[pages],
                        walk.tokens.numpy().reshape(-1, walk.page_size)[pages], walk.locked.numpy()[pages])


def _well_formed_pages(walk: PagedWalk, space: int) -> bool:
    """True when no slot of a paged walk breaks a rule, checked page by page: a listed page's
    position and predecessor (its other slots follow each other)."""
    if walk.first_positions.device.type != "cpu":
        raise ValueError(f"a PagedWalk is kept on the host (CPU tensors); got {walk.first_positions.device}")
    page = walk.page_size
    first, prev = walk.first_positions.numpy(), walk.prev_slots.numpy()
    for name, size in (("first_positions", first.size * page), ("prev_slots", prev.size * page),
                       ("tokens", walk.tokens.numel()), ("locked", walk.locked.numel() * page)):
        if size != space:
            raise ValueError(f"PagedWalk.{name} covers {size} slots in pages of {page}; the FULL group has {space}")
    if first.min() < PREV_CHAIN_HEAD or prev.min() < PREV_CHAIN_HEAD or prev.max() >= space:
        listed = first != -1  # an unlisted page's predecessor is never read
        if (listed & ((first < 0) | (prev < PREV_CHAIN_HEAD) | (prev >= space))).any():
            return False
        prev = np.where(listed, prev, PREV_CHAIN_HEAD)
    # The first position of the page holding each page's predecessor (-1: not listed; PREV_CHAIN_HEAD
    # reads the -1 appended after the last page).
    before_first = np.append(first, -1)[prev // page]
    return bool(((first == -1) | (before_first == -1) | (before_first + prev % page == first - 1)).all())


def check_walk(walk: CacheWalk | PagedWalk, space: int) -> CheckedWalk:
    """Check `walk` against a FULL slot space of `space` slots (see the module docstring); a
    well-formed walk on the host takes numpy's check alone."""
    if isinstance(walk, PagedWalk):
        if _well_formed_pages(walk, space):
            return CheckedWalk(walk, torch.zeros(0, ROW_WIDTH, dtype=torch.int64))
        walk = paged_entries(walk)
    if walk.slots.device.type != "cpu":
        return _check_in_full(walk, space)
    if _well_formed_on_host(walk, space):
        return CheckedWalk(walk, torch.zeros(0, ROW_WIDTH, dtype=torch.int64))
    with one_host_thread():
        return _check_in_full(walk, space)


def _check_in_full(walk: CacheWalk, space: int) -> CheckedWalk:
    slots = walk.slots.to(torch.int64)
    positions = walk.positions.to(torch.int64)
    prev = walk.prev_slots.to(torch.int64)
    n = slots.numel()
    in_range = (slots >= 0) & (slots < space)
    prev_in_range = (prev == PREV_CHAIN_HEAD) | ((prev >= 0) & (prev < space))
    safe = torch.where(in_range, slots, 0)
    listings = torch.bincount(safe[in_range], minlength=space)[safe]
    repeated = in_range & (listings > 1)
    first = torch.ones(n, dtype=torch.bool, device=slots.device)
    if bool(repeated.any()):  # the first listing of each slot (sorting only where one repeats)
        key = torch.where(in_range, slots, -1)
        order = torch.sort(key, stable=True).indices
        sorted_keys = key[order]
        first[order[1:]] = sorted_keys[1:] != sorted_keys[:-1]
    keep = in_range & prev_in_range & first
    position_of = torch.full((space,), -1, dtype=torch.int64, device=slots.device)
    position_of[safe[keep]] = positions[keep]
    prev_position = position_of[torch.where(prev_in_range & (prev >= 0), prev, 0)]
    gap = (positions < 0) | (prev_in_range & (prev >= 0) & (prev_position >= 0) & (prev_position != positions - 1))

    failing = {
        Reason.WALK_SLOT_OUT_OF_RANGE: (~in_range | ~prev_in_range, torch.where(in_range, prev, slots),
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
    if bool(keep.all()):
        return CheckedWalk(walk, rows)
    return CheckedWalk(CacheWalk(*(None if t is None else t[keep] for t in walk)), rows)
