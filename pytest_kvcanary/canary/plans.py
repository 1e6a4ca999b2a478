"""The sweep's entries: what the prefix cache holds, as one group's slots, padded to the size of
the slot space the walk names (the FULL pool) so the sweep's grid never depends on how much is
cached.

Planned in two steps so that a walk the engine keeps on the host (every built-in engine's) costs
the device no synchronisation: ``walk_entries`` plans the FULL-space entries where the walk's
tensors are and moves them to the device in one copy; ``group_entries`` maps them to a group with
device operations only. ``SweepPlan`` keeps them in buffers refilled in place, so the sweep's
launches can be captured once in a CUDA graph.

A walk's check and plan run on one intra-op thread (``one_host_thread``): its tensors are a few
thousand entries, and on a GPU host busy with the engine torch's thread pool made the check of an
18k-entry walk 25 to 70 ms instead of 2 ms (benchmarks/RESULTS.md). Only then: switching the
thread count costs about 0.1 ms on a 16-core host, so a sweep of an unchanged walk does not."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from kvcanary_kernels import VerifyEntries
from kvcanary_kernels.records import PREV_SKIP

from .groups import GroupState
from .host import CacheWalk
from .walk import check_walk

# VerifyEntries' fields in order, and what pads each past the walk (slot 0 is skipped).
_PADDING = (0, 0, PREV_SKIP, -1, -1, 0)


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


def walk_entries(walk: CacheWalk, space: int, device: torch.device, *, unlocked_only: bool = False) -> VerifyEntries:
    """The entries of a walk checked by ``walk.check_walk`` against a FULL space of ``space`` slots
    (all of them, or those no request holds), in that space, padded to ``space`` entries, on
    ``device``."""
    return VerifyEntries(*_planned(walk, space, device, unlocked_only).to(device, non_blocking=True).unbind(0))


def _planned(walk: CacheWalk, space: int, device: torch.device, unlocked_only: bool) -> torch.Tensor:
    """``walk_entries``' fields as the rows of one int64 tensor where the walk is (pinned for a
    copy to a CUDA device)."""
    keys = walk.context_keys if walk.context_keys is not None else torch.zeros_like(walk.slots)
    columns = [walk.slots, walk.positions, walk.prev_slots, walk.tokens, None, keys]
    if unlocked_only:
        keep = ~walk.locked.bool()
        columns = [None if c is None else c[keep] for c in columns]
    n = columns[0].numel()
    assert n <= space, "check_walk leaves each slot of the FULL space at most once"
    host = walk.slots.device
    planned = torch.empty((len(_PADDING), space), dtype=torch.int64, device=host,
                          pin_memory=host.type == "cpu" and device.type == "cuda")
    for row, column, fill in zip(planned, columns, _PADDING):
        row[n:] = fill
        row[:n] = fill if column is None else column
    return planned


def group_entries(entries: VerifyEntries, group: GroupState) -> VerifyEntries:
    """FULL-space entries as this group's: a slot not resident here becomes slot 0 (the kernels
    skip it) and a predecessor not resident here is not checked against (PREV_SKIP)."""
    prev = group.to_group_slots(entries.prev_slots.clamp(min=0))
    prev = torch.where(entries.prev_slots < 0, entries.prev_slots, torch.where(prev == 0, PREV_SKIP, prev))
    return entries._replace(slots=group.to_group_slots(entries.slots), prev_slots=prev)


def sweep_entries(walk: CacheWalk, group: GroupState, *, unlocked_only: bool = False) -> VerifyEntries:
    """The entries of a checked walk in this group (both steps at once)."""
    f2g = group.mapping.full_to_group
    space = group.pool.num_slots if f2g is None else f2g.shape[0]  # walks name FULL slots
    return group_entries(walk_entries(walk, space, group.device, unlocked_only=unlocked_only), group)


class SweepPlan:
    """The sweep's entries for each swept group in device buffers refilled in place. A walk is
    checked and planned when the host returns a new walk object (or asks for another part of it);
    the groups mapped through full_to_group are mapped again at every refresh, as their maps move."""

    def __init__(self, groups: list[GroupState], space: int, device: torch.device) -> None:
        self.groups, self.space, self.device = groups, space, device
        self.walk: CacheWalk | None = None
        self.unlocked_only = False
        self.malformed = torch.zeros(0, 0, dtype=torch.int64)
        self._full = torch.zeros((len(_PADDING), space), dtype=torch.int64, device=device)
        self._mapped = {g.pool.kind: torch.zeros((2, space), dtype=torch.int64, device=device) for g in groups}
        full = VerifyEntries(*self._full.unbind(0))
        self.entries = {kind: full._replace(slots=m[0], prev_slots=m[1]) for kind, m in self._mapped.items()}

    def refresh(self, walk: CacheWalk, unlocked_only: bool) -> None:
        """Bring the buffers up to date with ``walk``; ``malformed``: its violation rows (walk.py)."""
        stale = [g for g in self.groups if g.mapping.full_to_group is not None]
        if walk is not self.walk or unlocked_only != self.unlocked_only:
            with one_host_thread():
                checked = check_walk(walk, self.space)
                planned = _planned(checked.walk, self.space, self.device, unlocked_only)
            self._full.copy_(planned, non_blocking=True)
            self.walk, self.unlocked_only, self.malformed, stale = walk, unlocked_only, checked.rows, self.groups
        full = VerifyEntries(*self._full.unbind(0))
        for group in stale:
            mapped, into = group_entries(full, group), self._mapped[group.pool.kind]
            into[0].copy_(mapped.slots)
            into[1].copy_(mapped.prev_slots)
