"""Per pool group canary state: the K and V record buffers and their real-KV sources."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary_kernels import RealDataMode, RealKvSource, layer_source
from kvcanary_kernels.records import RECORD_WIDTH, Half
from kvcanary_kernels.sources import MAX_SOURCES

from .host import PoolGroup


def pick_layers(num_layers: int, count: int = MAX_SOURCES) -> list[int]:
    """Up to `count` layer indices spread evenly from the first to the last."""
    if num_layers <= count:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


@dataclass
class GroupState:
    """One pool group's records (K and V halves) and the sources its fingerprints read."""

    pool: PoolGroup
    records: dict[Half, torch.Tensor]
    sources: dict[Half, tuple[RealKvSource, ...]]

    @classmethod
    def create(cls, pool: PoolGroup, real_data: RealDataMode, device: torch.device) -> "GroupState":
        records = {
            half: torch.zeros(pool.num_slots, RECORD_WIDTH, dtype=torch.int64, device=device) for half in Half
        }
        sources = {}
        for half, layers in ((Half.K, pool.k_layers), (Half.V, pool.v_layers)):
            picked = (layer_source(layers[i], pool.page_size, real_data) for i in pick_layers(len(layers)))
            sources[half] = tuple(s for s in picked if s is not None)
        return cls(pool=pool, records=records, sources=sources)

    @property
    def device(self) -> torch.device:
        return self.records[Half.K].device

    def to_group_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """FULL-pool slots -> this group's slots (identity for FULL; 0 where not resident)."""
        if self.pool.full_to_group is None:
            return full_slots
        return self.pool.full_to_group[full_slots]

    def clear(self) -> None:
        for rec in self.records.values():
            rec.zero_()
