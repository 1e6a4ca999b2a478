"""The sweep's entries: what the prefix cache holds, as one group's slots, padded to the size of
the slot space the walk names (the FULL pool) so the sweep's grid never depends on how much is
cached."""

from __future__ import annotations

import torch

from kvcanary_kernels import VerifyEntries
from kvcanary_kernels.records import PREV_CHAIN_HEAD, PREV_SKIP

from .groups import GroupState
from .host import CacheWalk


def sweep_entries(walk: CacheWalk, group: GroupState, *, unlocked_only: bool = False) -> VerifyEntries:
    """Slots the cache holds (a walk checked by ``walk.check_walk``) that are resident in this group (others become slot 0, which the
    kernels skip); a predecessor that is not resident here (slid out of a window) is not checked
    against."""
    device = group.device
    keep = ~walk.locked.bool() if unlocked_only else torch.ones_like(walk.locked, dtype=torch.bool)
    keys = walk.context_keys if walk.context_keys is not None else torch.zeros_like(walk.slots)
    full, pos, prev_full, tokens, ctx = (t[keep].to(device=device, dtype=torch.int64)
                                         for t in (walk.slots, walk.positions, walk.prev_slots, walk.tokens, keys))
    slots = group.to_group_slots(full)
    prev = group.to_group_slots(prev_full.clamp(min=0))
    prev = torch.where(prev_full < 0, PREV_CHAIN_HEAD, torch.where(prev == 0, PREV_SKIP, prev))
    f2g = group.mapping.full_to_group
    pad = (group.pool.num_slots if f2g is None else f2g.shape[0]) - slots.numel()  # walks name FULL slots
    assert pad >= 0, "check_walk leaves each slot of the FULL space at most once"

    def padded(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad,), fill, dtype=torch.int64, device=device)])

    return VerifyEntries(slots=padded(slots, 0), positions=padded(pos, 0), prev_slots=padded(prev, PREV_SKIP),
                         tokens=padded(tokens, -1), rows=padded(torch.full_like(slots, -1), -1),
                         context_keys=padded(ctx, 0))
