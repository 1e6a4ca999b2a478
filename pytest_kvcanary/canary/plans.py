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
the engine. A paged walk is checked page by page on the host and its slots' entries are derived on
the device, so the host copies its tokens and a few numbers a page instead of planning every
cached slot."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from kvcanary_kernels import VerifyEntries
from kvcanary_kernels.records import PREV_SKIP

from .groups import GroupState
from .seam_data import CacheWalk, PagedWalk
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


def _same(a: object, b: object) -> bool:
    """The same tensor (or None), or an equal flag or version."""
    return a is b or (type(a) in (bool, int) and type(b) is type(a) and a == b)


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
    (``locked`` only for an unlocked-only sweep), or the sweep asks for another part of it; a paged
    walk when its version changed, and at every unlocked-only sweep; the groups mapped through
    full_to_group are mapped again at every refresh, as their maps move (the FULL group's entries
    are the plan itself)."""

    def __init__(self, groups: list[GroupState], space: int, device: torch.device) -> None:
        self.groups, self.space, self.device = groups, space, device
        self._planned: tuple = ()  # (unlocked_only, the walk's columns (a paged one's version) planned from)
        self.malformed = torch.zeros(0, 0, dtype=torch.int64)
        self._full = torch.zeros((len(_PADDING), space), dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self._host_plan = torch.zeros((len(_PADDING), space), dtype=torch.int64, pin_memory=cuda)
        self._host_plan_read = torch.cuda.Event() if cuda else None  # the copy out of _host_plan is over
        self._pages: torch.Tensor | None = None  # a paged walk's pages on the device: first positions, prev, locked
        self._host_pages = torch.zeros(0)  # their pinned host copy
        self._slot_pages: tuple[torch.Tensor, ...] = ()  # per slot: its page, its offset there, it, it - 1
        self._expansions: dict[bool, torch.cuda.CUDAGraph] = {}  # _expand_pages captured, by unlocked_only
        self._mapped_groups = [g for g in groups if g.mapping.full_to_group is not None]  # mapped at every refresh
        self._mapped = {g.pool.kind: torch.zeros((2, space), dtype=torch.int64, device=device)
                        for g in self._mapped_groups}
        self._full_entries = VerifyEntries(*self._full.unbind(0))  # views of _full, refilled in place
        self.entries = {g.pool.kind: self._full_entries for g in groups}  # the FULL group's: the plan itself
        self.entries.update({kind: self._full_entries._replace(slots=m[0], prev_slots=m[1])
                             for kind, m in self._mapped.items()})

    def refresh(self, walk: CacheWalk | PagedWalk, unlocked_only: bool) -> None:
        """Bring the buffers up to date with ``walk``; ``malformed``: its violation rows (walk.py)."""
        if isinstance(walk, PagedWalk):  # updated in place: its version says when
            source = (unlocked_only, walk.version, walk.first_positions, walk.prev_slots, walk.tokens,
                      object() if unlocked_only else None)
        else:
            source = (unlocked_only, *(column for name, column in zip(walk._fields, walk)
                                       if name != "locked" or unlocked_only))
        if len(source) != len(self._planned) or not all(map(_same, source, self._planned)):
            checked = check_walk(walk, self.space)
            with self._refilling_host_plan():
                if isinstance(checked.walk, PagedWalk):
                    self._plan_pages(checked.walk, unlocked_only)
                else:
                    self._plan_entries(checked.walk, unlocked_only)
            self.malformed, self._planned = checked.rows, source
        for group in self._mapped_groups:
            mapped, into = group_entries(self._full_entries, group), self._mapped[group.pool.kind]
            into[0].copy_(mapped.slots)
            into[1].copy_(mapped.prev_slots)

    @contextmanager
    def _refilling_host_plan(self) -> Iterator[None]:
        """The kept pinned host plan may be refilled inside: the last copy out of it is over (long
        done); the copies out of it enqueued inside are waited for by the next refill."""
        if self._host_plan_read is not None:
            self._host_plan_read.synchronize()
        yield
        if self._host_plan_read is not None:
            self._host_plan_read.record()

    def _plan_entries(self, walk: CacheWalk, unlocked_only: bool) -> None:
        """A list of entries: planned where it is (numpy on the host), then copied over."""
        where = walk.slots.device
        planned = self._host_plan if where.type == "cpu" else torch.empty_like(self._full, device=where)
        _plan_into(planned, walk, unlocked_only)
        self._full.copy_(planned, non_blocking=True)

    def _plan_pages(self, walk: PagedWalk, unlocked_only: bool) -> None:
        """A paged walk: its pages and tokens copied over, its slots' entries derived on the device
        (on CUDA by a graph captured at the first plan, so a plan launches two copies and a replay)."""
        pages = walk.first_positions.numel()
        if self._pages is None or self._pages.shape[1] != pages:
            cuda = self.device.type == "cuda"
            self._pages = torch.zeros((3, pages), dtype=torch.int64, device=self.device)
            self._host_pages = torch.zeros((3, pages), dtype=torch.int64, pin_memory=cuda)
            slot = torch.arange(self.space, device=self.device)
            self._slot_pages = (slot // walk.page_size, slot % walk.page_size, slot, slot - 1)
            self._expansions = {}
        self._host_pages.numpy()[:] = (walk.first_positions.numpy(), walk.prev_slots.numpy(), walk.locked.numpy())
        self._host_plan[3].numpy()[:] = walk.tokens.numpy()
        self._pages.copy_(self._host_pages, non_blocking=True)
        self._full[3].copy_(self._host_plan[3], non_blocking=True)
        graph = self._expansions.get(unlocked_only)
        if graph is not None:
            graph.replay()
            return
        self._expand_pages(unlocked_only)
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self._expansions[unlocked_only] = graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # captures; runs nothing
                self._expand_pages(unlocked_only)

    def _expand_pages(self, unlocked_only: bool) -> None:
        """The plan's slots, positions, predecessors, rows and contexts from the pages on the
        device (device work only)."""
        full = self._full
        page_of, offset, slot, slot_before = self._slot_pages
        first, prev, locked = (row[page_of] for row in self._pages)
        listed = first != -1
        if unlocked_only:
            listed &= locked == 0
        torch.mul(slot, listed, out=full[0])  # 0 where nothing is listed
        torch.add(first, offset, out=full[1])
        torch.where(offset == 0, prev, slot_before, out=full[2])
        full[2].masked_fill_(full[2] == 0, PREV_SKIP)  # a predecessor at the reserved slot 0
        full[4].fill_(-1)
        full[5].zero_()
