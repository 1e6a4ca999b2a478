"""Where faults may land: the slots a forward reads, writes, or only the radix cache holds.

Each is a list of (group slot, FULL slot, position, row) candidates; slot 0 never appears.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..canary.groups import GroupState
from ..canary.host import CanaryHost, ForwardView
from ..canary.plans import sweep_entries, verify_entries, write_entries


class Target(NamedTuple):
    slot: int  # in the group's pool
    full_slot: int
    position: int
    row: int


def _targets(slots: torch.Tensor, full: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> list[Target]:
    keep = slots != 0
    cols = [t[keep].tolist() for t in (slots, full, positions, rows)]
    return [Target(*c) for c in zip(*cols)]


def read_targets(view: ForwardView, host: CanaryHost, group: GroupState) -> list[Target]:
    """Slots this forward's HEAD verifies (and the forward reads) in this group."""
    table = host.req_to_token()
    e = verify_entries(view, table, group)
    full = table[e.rows.to(table.device), e.positions.to(table.device)].to(e.slots.device, torch.int64)
    return _targets(e.slots, full, e.positions, e.rows)


def written_targets(view: ForwardView, host: CanaryHost, group: GroupState) -> list[Target]:
    """Slots this forward wrote (and TAIL just stamped) in this group."""
    e = write_entries(view, host.req_to_token(), group)
    full = view.out_cache_loc.to(e.slots.device, torch.int64)
    return _targets(e.slots, full, e.positions, e.rows)


def cached_only_targets(host: CanaryHost, group: GroupState) -> list[Target]:
    """Slots held by the radix cache and by no live request (only a sweep reads them)."""
    walk = host.radix_walk()
    if walk is None:
        return []
    e = sweep_entries(walk, group, unlocked_only=True)
    full = walk.slots[~walk.locked].to(e.slots.device, torch.int64)
    return _targets(e.slots, full, e.positions, e.rows)
