"""HostRecords: the canary records of the KV pages an engine keeps in its host-memory tier, kept
beside them in host memory and moved with the bytes.

A page written back takes its records along (device records -> host); a page loaded back brings
them back (host -> device records, into the slots it lands in), before the forward that reads it,
whose HEAD then verifies every loaded-back slot (its bytes against the fingerprint, its token,
position and chain against the request reading it). A freed host copy keeps its records, as a
freed device slot does. The copies are launched where the engine launches its own (on its copy
stream, the seam's HostTierListener), a slice copy per run of consecutive slots, without the host
waiting; host-side readers (`position`) wait for the tier first. Pages that leave host memory for
a lower tier (the reference engine's disk tier) take their records along (`records_of`) and bring
them back into the host slots they return to (`restore_records`).
"""

from __future__ import annotations

import torch

from kvcanary_kernels.records import FIELD_POSITION, RECORD_WIDTH, GroupKind, Half

from .groups import GroupState
from .seam_data import copy_runs
from .seam import HostTier


class HostRecords:
    """Registered with the tier by the runtime when its host has one; one record buffer per group
    the tier backs and half, ``[host slots, RECORD_WIDTH]``, pinned when the records live on a
    GPU. live: per group, the host slots holding a written-back copy."""

    def __init__(self, groups: list[GroupState], tier: HostTier) -> None:
        sizes = {pool.kind: pool.num_slots for pool in tier.pools}
        self.tier = tier
        self.groups = [g for g in groups if g.pool.kind in sizes]
        self._groups = {g.pool.kind: g for g in self.groups}
        pinned = any(g.device.type == "cuda" for g in self.groups)
        self.records = {g.pool.kind: {half: torch.zeros(sizes[g.pool.kind], RECORD_WIDTH, dtype=torch.int64,
                                                        pin_memory=pinned) for half in g.halves}
                        for g in self.groups}
        self.live = {g.pool.kind: torch.zeros(sizes[g.pool.kind], dtype=torch.bool) for g in self.groups}
        tier.add_listener(self)

    def written_back(self, kind: GroupKind, slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        group = self._groups.get(kind)
        if group is None:
            return
        slots = group.to_group_slots(slots.to(group.device))
        for half, state in group.halves.items():
            copy_runs(self.records[kind][half], host_slots, state.records[slots], None)
        self.live[kind][host_slots] = True

    def loaded_back(self, kind: GroupKind, host_slots: torch.Tensor, slots: torch.Tensor) -> None:
        group = self._groups.get(kind)
        if group is None:
            return
        slots = group.to_group_slots(slots.to(group.device))
        resident = (slots != 0)[:, None]  # slot 0's record (the sentinel) is never written
        for half, state in group.halves.items():
            rows = torch.empty(slots.shape[0], RECORD_WIDTH, dtype=torch.int64, device=group.device)
            copy_runs(rows, None, self.records[kind][half], host_slots)
            state.records[slots] = torch.where(resident, rows, state.records[slots])

    def host_freed(self, kind: GroupKind, host_slots: torch.Tensor, cause: str) -> None:
        if kind in self.live:
            self.live[kind][host_slots] = False

    def records_of(self, kind: GroupKind, host_slots: torch.Tensor) -> dict[Half, torch.Tensor]:
        """The records of these host slots per half (a copy; none for a group it does not keep):
        the tier takes them along when the pages leave host memory for a lower tier (a disk)."""
        if kind not in self.records:
            return {}
        self.tier.synchronize()
        return {half: records[host_slots].clone() for half, records in self.records[kind].items()}

    def restore_records(self, kind: GroupKind, host_slots: torch.Tensor, rows: dict[Half, torch.Tensor]) -> None:
        """Records that came back with pages from a lower tier into these host slots (`records_of`'s
        rows); the next load-back takes them to the device, and HEAD verifies them there."""
        if kind not in self.records:
            return
        self.tier.synchronize()
        for half, records in rows.items():
            self.records[kind][half][host_slots] = records.to(self.records[kind][half].device)
        self.live[kind][host_slots] = True

    def live_slots(self, kind: GroupKind) -> torch.Tensor:
        """The host slots of a group holding a written-back copy (CPU int64)."""
        return self.live[kind].nonzero().flatten()

    def position(self, kind: GroupKind, half: Half, host_slot: int) -> int:
        """The position the record of a host slot names (waits for the tier's copies)."""
        self.tier.synchronize()
        return int(self.records[kind][half][host_slot, FIELD_POSITION])

    def clear(self) -> None:
        for halves in self.records.values():
            for records in halves.values():
                records.zero_()
        for live in self.live.values():
            live.zero_()
