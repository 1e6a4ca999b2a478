"""What the soak, the fault injector and tools read of a CanaryRuntime (`CanaryRuntime.readout`),
so that none of them reaches into its groups, halves, sources or records, or works out a slot from
(row, position) with a formula of its own: every slot here is the canary's own mapping code's
(`GroupState.mapped_slots`, `to_group_slots`, which the kernels mirror).

Read only: nothing here changes the canary's state. Two members hand over the engine's own
tensors, which the fault injector damages on purpose: `GroupReadout.table` (the mapping table) and
`GroupReadout.slot_bytes` / `buffers` (views of the pool's buffers). A readout stays valid for its
runtime's life: the groups are fixed at attach (`reset` clears them, it does not replace them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Sequence

import torch

from kvcanary_kernels import RealKvSource, VerifyEntries
from kvcanary_kernels.records import GroupKind, Half

from .groups import GroupState
from .seam_data import CacheWalk
from .host_records import HostRecords
from .plans import sweep_entries
from .state import StateGuard


class SlotBytes(NamedTuple):
    """One slot's bytes in one layer's buffer, as the fingerprint reads them. data: a uint8 view of
    the buffer from the slot's first byte on (it aliases the buffer: a write lands in the pool);
    sampled: the offsets in `data` of the bytes the fingerprint reads, in its order."""

    data: torch.Tensor
    sampled: tuple[int, ...]


class GroupReadout:
    """One guarded pool group, read through the canary. Slots named here are the group's own
    unless said to be of the mapping's space (a FULL slot for a group mapped through
    full_to_group). The mapping members (`slots_at` to `table`) are not the STATE group's, which
    has no mapping."""

    def __init__(self, group: GroupState, held: HostRecords | None) -> None:
        self._group = group
        self._held = held if held is not None and any(g is group for g in held.groups) else None

    @property
    def kind(self) -> GroupKind:
        return self._group.pool.kind

    @property
    def window(self) -> int:
        """Attention window in tokens; 0 without one (FULL)."""
        return self._group.window

    @property
    def num_slots(self) -> int:
        """Slots in the group's pool, reserved slot 0 included."""
        return self._group.pool.num_slots

    @property
    def page_size(self) -> int:
        """The mapping's page (block) size: 1 for a per-token table."""
        return self._group.mapping.page_size

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the group's K buffers (its first layer's)."""
        return self._group.pool.k_layers[0].dtype

    def swept_by_walk(self) -> bool:
        """Whether the sweep checks this group's slots of a cache walk (FULL, and groups mapped
        through full_to_group)."""
        return self._group.swept_by_walk()

    # The mapping -------------------------------------------------------------------------------

    def slots_at(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each (row, position), read through the engine's table now: the slot in the mapping's
        space and the group's slot (0: not resident), on the table's device. Host work with
        device syncs: for tools, not the per-forward path."""
        return self._group.mapped_slots(rows, positions)

    def group_slots(self, space_slots: torch.Tensor) -> torch.Tensor:
        """Mapping-space slots -> the group's slots (0: not resident), on the device of
        ``space_slots``. The STATE group's slots are its own: they come back as they are."""
        return self._group.to_group_slots(space_slots)

    def column_of(self, position: int) -> int:
        """The table column that maps this position (the ring taken into account)."""
        m = self._group.mapping
        return (position % m.ring if m.ring else position) // m.page_size

    def block_of(self, space_slot: int) -> int:
        """The table entry that maps this mapping-space slot: its block (its slot in a per-token
        table)."""
        return space_slot // self._group.mapping.page_size

    @property
    def table(self) -> torch.Tensor:
        """The engine's mapping table itself ([rows, columns]; the fault injector remaps an entry
        and puts it back after the forward)."""
        return self._group.mapping.table

    def sweep_entries(self, walk: CacheWalk, *, unlocked_only: bool = False) -> VerifyEntries:
        """The entries the sweep verifies in this group for a well-formed cache walk, padded with
        slot 0 (the first n for the walk's n entries, or its n unlocked ones)."""
        return sweep_entries(walk, self._group, unlocked_only=unlocked_only)

    # The fingerprint's bytes -------------------------------------------------------------------

    def fingerprinted(self) -> dict[Half, tuple[int, ...]]:
        """The layers (indices into the half's buffers) the fingerprint reads bytes of, per half
        that has any, in the group's order of halves; empty with real_data none."""
        return {half: state.source_layers for half, state in self._group.halves.items() if state.sources}

    def slot_bytes(self, half: Half, layer: int, slot: int, *, host: bool = False) -> SlotBytes:
        """The bytes of `slot` the fingerprint reads in one layer of `fingerprinted()`; host: of
        host slot `slot` in the host tier's copy of that layer (`host_backed` groups). The view
        aliases the buffer; a host one may be mid-copy (synchronize the tier first)."""
        state = self._group.halves[half]
        source = state.sources[state.source_layers.index(layer)]
        if host:
            pool = next(p for p in self._host().tier.pools if p.kind is self.kind)
            source = replace(source, tensor=(pool.k_layers if half is Half.K else pool.v_layers)[layer])
        return _slot_bytes(source, slot)

    def buffers(self, half: Half) -> Sequence[torch.Tensor]:
        """The engine's buffers of this half, a layer each, as canary_groups() handed them."""
        return self._group.pool.k_layers if half is Half.K else self._group.pool.v_layers

    # The host tier -----------------------------------------------------------------------------

    @property
    def host_backed(self) -> bool:
        """Whether the engine's host tier keeps this group's pages (and the canary their records)."""
        return self._held is not None

    def host_slots(self) -> torch.Tensor:
        """The host slots holding a written-back copy of this group's data (CPU int64)."""
        return self._host().live_slots(self.kind)

    def host_position(self, half: Half, host_slot: int) -> int:
        """The position the record of a host slot names (waits for the tier's copies)."""
        return self._host().position(self.kind, half, host_slot)

    def _host(self) -> HostRecords:
        if self._held is None:
            raise ValueError(f"the {self.kind.label} group has no host tier behind it (host_backed is False)")
        return self._held


class RuntimeReadout:
    """A runtime's groups and counts, read only (`CanaryRuntime.readout`). kv_groups: the groups
    with a slot mapping, FULL first (every guarded group but STATE)."""

    def __init__(self, groups: Sequence[GroupState], state: StateGuard | None, held: HostRecords | None) -> None:
        self.kv_groups: tuple[GroupReadout, ...] = tuple(GroupReadout(g, held) for g in groups)
        self._state = state
        self._by_kind = {g.kind: g for g in self.kv_groups}
        if state is not None:
            self._by_kind[GroupKind.STATE] = GroupReadout(state.group, held)

    def group(self, kind: GroupKind) -> GroupReadout:
        """The group of that kind, the STATE group included (KeyError: the engine has none)."""
        return self._by_kind[kind]

    def state_restores(self) -> int | None:
        """Recurrent states copied from a slot other than 0 since the last reset (a checkpoint's
        reuse: the liveness count of a hybrid model's soak); None without a STATE group. Syncs."""
        return None if self._state is None else self._state.restores()


def _slot_bytes(source: RealKvSource, slot: int) -> SlotBytes:
    page, within = divmod(slot, source.page_size)
    t = source.tensor
    rows = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1)).view(torch.uint8)  # a byte row per page
    start = source.slot_offset(within)
    return SlotBytes(rows[page, start:start + source.sample_end], tuple(source.sampled_bytes()))
