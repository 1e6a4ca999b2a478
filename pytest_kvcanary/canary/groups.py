"""Per pool group canary state: record buffers per half, the real-KV sources the fingerprints read,
the group's slot mapping, and the write-through buffers. Everything is allocated at attach."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary_kernels import (
    MAX_SOURCES, RealDataMode, RealKvSource, SlotMapping, group_slot_ref, layer_source, mapping_slot_ref,
)
from kvcanary_kernels.records import FIELD_REAL_KV_HASH, RECORD_WIDTH, GroupKind, Half

from .seam_data import Capacities, PoolGroup


def pick_layers(num_layers: int, count: int = MAX_SOURCES) -> list[int]:
    """Up to `count` layer indices spread evenly from the first to the last."""
    if num_layers <= count:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


def sampled_mode(real_data: RealDataMode, j: int) -> RealDataMode:
    """How the j-th sampled layer of a half is read. ``all`` reads every byte of the first and
    partial's samples of the others (their share of the KV heads), so each byte of one layer is
    fingerprinted and every head of the others sampled, and RECHECK, which re-reads the last,
    reads samples; whole rows of every sampled layer cost four to five times the bytes
    (docs/how-it-works.md)."""
    return RealDataMode.PARTIAL if real_data is RealDataMode.ALL and j > 0 else real_data


@dataclass
class HalfState:
    """One half (K or V) of a group: its records, the sources its fingerprints fold (one per
    picked layer, in order; in partial mode the picked layers share the KV heads out among them)
    and, for write-through, one row-hash buffer per source."""

    records: torch.Tensor  # [num_slots, RECORD_WIDTH] int64
    sources: tuple[RealKvSource, ...]
    source_layers: tuple[int, ...]  # layer index of each source
    stored_hashes: torch.Tensor  # [len(sources), max_tokens] int64: each source's row hashes, filled by kv_stored
    stored: set[int]  # sources whose rows this forward handed over
    # [num_slots] int64: the last source's hash of each slot HEAD read, which RECHECK compares
    # with (None without RECHECK or sources)
    read_hashes: torch.Tensor | None

    def take_stored_hashes(self) -> torch.Tensor | None:
        """``stored_hashes`` once every source layer was handed over this forward (stamp_view's
        written_source_hashes), None otherwise. Forgets the hand-overs (the next forward starts over)."""
        complete = bool(self.sources) and len(self.stored) == len(self.sources)
        self.stored.clear()
        return self.stored_hashes if complete else None


@dataclass
class GroupState:
    pool: PoolGroup
    halves: dict[Half, HalfState]
    window: int  # 0 for FULL

    @classmethod
    def create(cls, pool: PoolGroup, real_data: RealDataMode, device: torch.device, capacities: Capacities,
               *, recheck: bool) -> "GroupState":
        if not pool.fingerprintable and real_data is not RealDataMode.NONE:
            raise ValueError(f"real_data must be none for the {pool.kind.name} group of this engine: its KV "
                             f"layout is one the fingerprint cannot read; got {real_data.value!r}")
        layers_of = {Half.K: pool.k_layers, Half.V: pool.v_layers}
        halves = {}
        for half, layers in layers_of.items():
            if not layers:
                continue
            readable = [] if half in pool.opaque_halves else pick_layers(len(layers))
            picked = [(i, layer_source(layers[i], pool.page_size, sampled_mode(real_data, j), share=(j, len(readable))))
                      for j, i in enumerate(readable)]
            picked = [(i, s) for i, s in picked if s is not None]
            halves[half] = HalfState(
                records=torch.zeros(pool.num_slots, RECORD_WIDTH, dtype=torch.int64, device=device),
                sources=tuple(s for _, s in picked),
                source_layers=tuple(i for i, _ in picked),
                stored_hashes=torch.zeros(len(picked), capacities.max_tokens, dtype=torch.int64, device=device),
                stored=set(),
                read_hashes=torch.zeros(pool.num_slots, dtype=torch.int64, device=device)
                if recheck and picked else None,
            )
        return cls(pool=pool, halves=halves, window=pool.window or 0)

    @property
    def mapping(self) -> SlotMapping:
        return self.pool.mapping

    @property
    def device(self) -> torch.device:
        return next(iter(self.halves.values())).records.device

    def swept_by_walk(self) -> bool:
        """A cache walk names FULL slots: it reaches the FULL group, the INDEXER group (the FULL
        group's slots) and groups mapped through full_to_group."""
        return self.pool.kind in (GroupKind.FULL, GroupKind.INDEXER) or self.mapping.full_to_group is not None

    def has_sources(self) -> bool:
        return any(h.sources for h in self.halves.values())

    def to_group_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """FULL-pool slots -> this group's slots (through full_to_group when the mapping has one; 0
        where not resident), on the device of ``full_slots``. A STATE group has no mapping: the
        slots a caller names are its own."""
        if self.mapping is None:
            return full_slots
        table = self.mapping.table
        return group_slot_ref(self.mapping, full_slots.to(table.device, torch.int64),
                              self.pool.num_slots).to(full_slots.device)

    def mapped_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host-side evaluation of the mapping (tools, not the per-forward path): for each (row,
        position), the slot in the mapping's own space (a FULL slot for groups mapped through
        full_to_group) and the group's slot."""
        device = self.mapping.table.device
        space = mapping_slot_ref(self.mapping, rows.to(device, torch.int64), positions.to(device, torch.int64))
        return space, self.to_group_slots(space)

    def seal_reserved_slot(self) -> None:
        """Fingerprint slot 0's bytes as they are now: the sentinel every HEAD and RECHECK checks."""
        from kvcanary_kernels import fingerprint_ref

        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        for half in self.halves.values():
            half.records[0, FIELD_REAL_KV_HASH] = fingerprint_ref(half.sources, zero)[0]

    def clear(self) -> None:
        for half in self.halves.values():
            half.records.zero_()
            half.stored.clear()
        self.seal_reserved_slot()
