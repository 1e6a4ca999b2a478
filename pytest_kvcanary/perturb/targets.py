"""Where faults may land: the slots a forward reads, writes, or only the prefix cache holds, and the
tokens it is fed.

Each slot list is of (group slot, mapping-space slot, position, row) candidates, computed through
the seam (the view, the cache walk) and the runtime's readout of the group (its mapping); slot 0
never appears.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcanary_kernels.records import GroupKind

from ..canary.readout import GroupReadout
from ..canary.seam import GuardedEngine, ForwardView, PagedWalk, optional
from ..canary.walk import paged_entries


class Target(NamedTuple):
    slot: int  # in the group's pool
    full_slot: int  # in the mapping's space (the FULL slot for a group mapped through full_to_group)
    position: int
    row: int


def _positions(view: ForwardView, starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) pairs for positions [starts[b], starts[b] + lengths[b]) of each batch row."""
    lengths = lengths.clamp(min=0).cpu()
    batch = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    offsets = torch.arange(batch.numel()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return view.rows.cpu()[batch], starts.cpu()[batch] + offsets


def _targets(group: GroupReadout, rows: torch.Tensor, positions: torch.Tensor) -> list[Target]:
    space, slots = group.slots_at(rows, positions)
    keep = (slots != 0).cpu()
    cols = [t.cpu()[keep].tolist() for t in (slots, space, positions, rows)]
    return [Target(*c) for c in zip(*cols)]


def _state_targets(view: ForwardView, slots: torch.Tensor, lengths: torch.Tensor) -> list[Target]:
    """(state slot, the tokens it summarizes, row) of each entry with a slot: one per batch row
    ([B]) or m per row ([B, m], row-major)."""
    rows = view.rows.repeat_interleave(slots.numel() // max(1, view.rows.numel()))
    cols = [t.cpu().flatten() for t in (slots, slots, lengths, rows)]
    keep = cols[0] != 0
    return [Target(*c) for c in zip(*(t[keep].tolist() for t in cols))]


def read_targets(view: ForwardView, group: GroupReadout) -> list[Target]:
    """Slots this forward's HEAD verifies (and the forward reads) in this group (a STATE group:
    each row's state, at the row's prefix length)."""
    if group.kind is GroupKind.STATE:
        return _state_targets(view, view.state.slots, view.prefix_lens)
    prefix = view.prefix_lens.cpu()
    starts = (prefix - group.window).clamp(min=0) if group.window else torch.zeros_like(prefix)
    return _targets(group, *_positions(view, starts, prefix - starts))


def written_targets(view: ForwardView, group: GroupReadout) -> list[Target]:
    """Slots this forward wrote (and TAIL just stamped) in this group (a STATE group: each row's
    state and checkpoint)."""
    if group.kind is GroupKind.STATE:
        s = view.state
        return (_state_targets(view, s.slots, view.prefix_lens + view.extend_lens)
                + _state_targets(view, s.checkpoint_slots, s.checkpoint_lens))
    return _targets(group, *_positions(view, view.prefix_lens.cpu(), view.extend_lens.cpu()))


def cached_only_targets(host: GuardedEngine, group: GroupReadout) -> list[Target]:
    """Slots held by the prefix cache and by no live request (only a sweep reads them; a STATE
    group: the checkpoints of paths no request holds)."""
    if group.kind is GroupKind.STATE:
        walk = optional(host, "checkpoint_walk")()
        if walk is None:
            return []
        keep = ~walk.locked
        cols = [walk.slots[keep], walk.slots[keep], walk.lengths[keep], torch.full_like(walk.slots[keep], -1)]
        return [Target(*c) for c in zip(*(t.tolist() for t in cols))]
    walk = host.cache_walk()
    if walk is None or not group.swept_by_walk():
        return []
    if isinstance(walk, PagedWalk):
        walk = paged_entries(walk)
    e = group.sweep_entries(walk, unlocked_only=True)
    space = walk.slots[~walk.locked.bool()].cpu()
    n = space.numel()
    cols = [e.slots[:n].cpu(), space, e.positions[:n].cpu(), e.rows[:n].cpu()]
    keep = cols[0] != 0
    return [Target(*c) for c in zip(*(t[keep].tolist() for t in cols))]


def feeds(view: ForwardView) -> list[tuple[int, int, int]]:
    """(view token index, row, position) of each batch row's newest fed token: the last token of
    its row whose token the engine's token table knows (a speculative decode's proposals are not
    known yet)."""
    out = []
    start = 0
    known = view.token_table.cpu()
    for row, prefix, extend in zip(view.rows.tolist(), view.prefix_lens.tolist(), view.extend_lens.tolist()):
        for j in reversed(range(max(extend, 0))):
            if prefix + j < known.shape[1] and int(known[row, prefix + j]) >= 0:
                out.append((start + j, row, prefix + j))
                break
        start += max(extend, 0)
    return out
