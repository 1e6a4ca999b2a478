"""The sweep's entries: what the prefix cache holds, as one group's slots, padded to the size of
the slot space the walk names (the FULL pool) so the sweep's grid never depends on how much is
cached.

Planned in two steps so that a walk the engine keeps on the host (every built-in engine's) costs
the device no synchronisation: ``walk_entries`` plans the FULL-space entries where the walk's
tensors are and moves them to the device in one copy; ``group_entries`` maps them to a group with
device operations only. ``SweepPlan`` keeps them in buffers refilled in place, so the sweep's
launches can be captured once in a CUDA graph, and plans a host walk into one pinned buffer it
keeps (allocating pinned memory cost about 0.5 ms a plan on a GPU host). A host walk's plan is
written with numpy: torch's CPU operations cost tens of microseconds each on a GPU host busy with
the engine."""

from __future__ import annotations

import torch

from kvcanary_kernels import VerifyEntries
from kvcanary_kernels.records import PREV_SKIP

from .groups import GroupState
from .host import CacheWalk
from .walk import check_walk

# VerifyEntries' fields in order, and what pads each past the walk (slot 0 is skipped).
_PADDING = (0, 0, PREV_SKIP, -1, -1, 0)


def walk_entries(walk: CacheWalk, space: int, device: torch.device, *, unlocked_only: bool = False) -> VerifyEntries:
    """The entries of a walk checked by ``walk.check_walk`` against a FULL space of ``space`` slots
    (all of them, or those no request holds), in that space, padded to ``space`` entries, on
    ``device``."""
    host = walk.slots.device
    planned = torch.empty((len(_PADDING), space), dtype=torch.int64, device=host,
                          pin_memory=host.type == "cpu" and device.type == "cuda")
    _plan_into(planned, walk, unlocked_only)
    return VerifyEntries(*planned.to(device, non_blocking=True).unbind(0))


def _plan_into(planned: torch.Tensor, walk: CacheWalk, unlocked_only: bool) -> None:
    """Write ``walk_entries``' fields as the rows of ``planned`` (int64 ``[6, space]`` where the
    walk is), with numpy for a host walk."""
    columns = [walk.slots, walk.positions, walk.prev_slots, walk.tokens, None, walk.context_keys]
    keep = ~walk.locked.bool() if unlocked_only else None
    rows = planned
    if walk.slots.device.type == "cpu":
        rows = planned.numpy()
        columns = [None if c is None else c.numpy() for c in columns]
        keep = None if keep is None else keep.numpy()
    if keep is not None:
        columns = [None if c is None else c[keep] for c in columns]
    n = len(columns[0])
    assert n <= planned.shape[1], "check_walk leaves each slot of the FULL space at most once"
    for row, column, fill in zip(rows, columns, _PADDING):
        row[n:] = fill
        row[:n] = fill if column is None else column
    prev = rows[2][:n]  # a predecessor at the reserved slot 0 holds no record to check against
    if isinstance(prev, torch.Tensor):
        prev.masked_fill_(prev == 0, PREV_SKIP)
    else:
        prev[prev == 0] = PREV_SKIP


def group_entries(entries: VerifyEntries, group: GroupState) -> VerifyEntries:
    """FULL-space entries (as planned: a predecessor at the reserved slot 0 is PREV_SKIP) as this
    group's: a slot not resident here becomes slot 0 (the kernels skip it) and a predecessor not
    resident here is not checked against (PREV_SKIP)."""
    if group.mapping.full_to_group is None:  # the FULL group: a checked entry's slot is its own
        return entries
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
    checked and planned when the columns the plan reads are other tensors than last time
    (``locked`` only for an unlocked-only sweep), or the sweep asks for another part of it; the
    groups mapped through full_to_group are mapped again at every refresh, as their maps move (the
    FULL group's entries are the plan itself)."""

    def __init__(self, groups: list[GroupState], space: int, device: torch.device) -> None:
        self.groups, self.space, self.device = groups, space, device
        self._planned: tuple = ()  # (unlocked_only, the walk's columns the buffers were planned from)
        self.malformed = torch.zeros(0, 0, dtype=torch.int64)
        self._full = torch.zeros((len(_PADDING), space), dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self._host_plan = torch.zeros((len(_PADDING), space), dtype=torch.int64, pin_memory=cuda)
        self._host_plan_read = torch.cuda.Event() if cuda else None  # the copy out of _host_plan is over
        self._mapped_groups = [g for g in groups if g.mapping.full_to_group is not None]  # mapped at every refresh
        self._mapped = {g.pool.kind: torch.zeros((2, space), dtype=torch.int64, device=device)
                        for g in self._mapped_groups}
        self._full_entries = VerifyEntries(*self._full.unbind(0))  # views of _full, refilled in place
        self.entries = {g.pool.kind: self._full_entries for g in groups}  # the FULL group's: the plan itself
        self.entries.update({kind: self._full_entries._replace(slots=m[0], prev_slots=m[1])
                             for kind, m in self._mapped.items()})

    def refresh(self, walk: CacheWalk, unlocked_only: bool) -> None:
        """Bring the buffers up to date with ``walk``; ``malformed``: its violation rows (walk.py)."""
        source = (unlocked_only, *(column for name, column in zip(walk._fields, walk)
                                   if name != "locked" or unlocked_only))
        if len(source) != len(self._planned) or any(a is not b for a, b in zip(source, self._planned)):
            checked = check_walk(walk, self.space)
            where = checked.walk.slots.device
            kept = where.type == "cpu" and self._host_plan_read is not None  # planned into the kept pinned buffer
            if kept:
                self._host_plan_read.synchronize()  # the last plan's copy out of it (long done)
            planned = self._host_plan if where.type == "cpu" else torch.empty_like(self._full, device=where)
            _plan_into(planned, checked.walk, unlocked_only)
            self._full.copy_(planned, non_blocking=True)
            if kept:
                self._host_plan_read.record()
            self.malformed, self._planned = checked.rows, source
        for group in self._mapped_groups:
            mapped, into = group_entries(self._full_entries, group), self._mapped[group.pool.kind]
            into[0].copy_(mapped.slots)
            into[1].copy_(mapped.prev_slots)
