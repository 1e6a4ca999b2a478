"""KV pools, their slot allocators and the req_to_token table.

A slot is one token's K/V in every layer of a pool (page_size 1): ``k_layers[i][slot]`` is a
``[num_kv_heads, head_dim]`` row, or a ``[latent_dim]`` row of a latent (mla) pool, which has no V
buffers. Slot 0 is reserved in every pool: never allocated, padding
points there. Slots handed out and taken back are CPU int64 tensors; the buffers, the SWA map and
the req_to_token table live on the engine's device.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.seam import FreeListener

from .config import EngineConfig, ModelConfig


def kv_buffers(num_slots: int, num_layers: int, model: ModelConfig,
               device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed per-layer K and V buffers ``[num_slots, *model.kv_row]``; no V for a latent model."""
    def zeros() -> list[torch.Tensor]:
        return [torch.zeros((num_slots, *model.kv_row), dtype=model.dtype, device=device) for _ in range(num_layers)]

    return zeros(), [] if model.attention == "mla" else zeros()


class KVPool:
    """Per-layer K and V buffers ``[num_slots, *model.kv_row]`` plus a free list; a latent (mla)
    model's pool has K buffers only (v_layers empty)."""

    def __init__(self, num_slots: int, num_layers: int, model: ModelConfig, device: torch.device) -> None:
        self.num_slots = num_slots
        self.k_layers, self.v_layers = kv_buffers(num_slots, num_layers, model, device)
        self.free_slots = torch.arange(1, num_slots, dtype=torch.int64)  # read-only for callers
        self._is_free = torch.ones(num_slots, dtype=torch.bool)
        self._is_free[0] = False

    @property
    def num_free(self) -> int:
        return self.free_slots.numel()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None (nothing allocated) when fewer than n are free."""
        if n > self.num_free:
            return None
        slots, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        self._is_free[slots] = False
        return slots

    def restart(self) -> None:
        """With every slot free, hand them out from slot 1 up again, as a new pool does."""
        assert self.num_free == self.num_slots - 1, "restart while slots are held"
        self.free_slots = torch.arange(1, self.num_slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """Return allocated slots; freeing slot 0, a free slot or a slot twice is a bug."""
        if slots.numel() == 0:
            return
        assert slots.unique().numel() == slots.numel() and slots.min() > 0 and not self._is_free[slots].any(), "bad free"
        self._is_free[slots] = True
        self.free_slots = torch.cat([self.free_slots, slots])


class SWAPool(KVPool):
    """The windowed layers' pool. ``full_to_swa[full_slot]`` is the SWA slot holding that token's
    windowed-layer K/V, 0 when it has none (never mapped, or slid out of every window)."""

    def __init__(self, num_slots: int, full_num_slots: int, num_layers: int, model: ModelConfig,
                 device: torch.device, listeners: list[FreeListener]) -> None:
        super().__init__(num_slots, num_layers, model, device)
        self.full_to_swa = torch.zeros(full_num_slots, dtype=torch.int64, device=device)
        self._listeners = listeners

    def map(self, full_slots: torch.Tensor) -> bool:
        """Give each full slot an SWA slot; False (nothing changed) when too few are free."""
        swa = self.alloc(full_slots.numel())
        if swa is None:
            return False
        self.full_to_swa[full_slots.to(self.full_to_swa.device)] = swa.to(self.full_to_swa.device)
        return True

    def unmap(self, full_slots: torch.Tensor, cause: str) -> int:
        """Free the SWA slots of those full slots that have one; returns how many were freed."""
        for listener in self._listeners:
            listener(GroupKind.SWA, full_slots, cause)
        idx = full_slots.to(self.full_to_swa.device)
        swa = self.full_to_swa[idx].cpu()
        self.full_to_swa[idx] = 0
        swa = swa[swa != 0]
        self.free(swa)
        return swa.numel()

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand src's SWA slots to dst (dst has none); src is left with none."""
        src, dst = src.to(self.full_to_swa.device), dst.to(self.full_to_swa.device)
        self.full_to_swa[dst] = self.full_to_swa[src]
        self.full_to_swa[src] = 0


class LayerKV(NamedTuple):
    """Where one layer's K/V live: buffers indexed by the pool's slots (a latent layer: k a
    one-head view ``[num_slots, 1, latent_dim]`` of its buffer, v None), and for a windowed layer
    the map from FULL-pool slots to them (None: FULL slots index the buffers directly); the pool
    group and the layer's index among that group's layers."""

    k: torch.Tensor
    v: torch.Tensor | None
    slot_map: torch.Tensor | None
    group: GroupKind
    index: int


def layer_kv(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], index: int, slot_map: torch.Tensor | None,
             group: GroupKind) -> LayerKV:
    """Layer `index` of a pool's buffers (no v_layers: a latent pool, seen as one KV head)."""
    if not v_layers:
        return LayerKV(k_layers[index].unsqueeze(1), None, slot_map, group, index)
    return LayerKV(k_layers[index], v_layers[index], slot_map, group, index)


class DraftPool:
    """A speculative-decoding draft model's KV buffers, indexed by FULL slots: a FULL slot holds the
    draft's KV of the token whose target KV it holds, so its slots are allocated and freed with the
    FULL pool's. full_to_draft (the identity) maps FULL slots to it for the canary's sweep."""

    def __init__(self, num_slots: int, model: ModelConfig, device: torch.device) -> None:
        self.num_slots = num_slots
        self.k_layers, self.v_layers = kv_buffers(num_slots, model.num_layers, model, device)
        self.full_to_draft = torch.arange(num_slots, device=device)

    def layer(self, i: int) -> LayerKV:
        return layer_kv(self.k_layers, self.v_layers, i, None, GroupKind.DRAFT)


class KVPools:
    """The FULL pool (slot ids everyone uses) and, for swa models, the SWA pool behind it; with
    speculative decoding, the draft pool beside it. alloc/free work on FULL slots and keep the SWA
    side in step. free_listeners hear of every
    free with its cause (the fault ledger uses it to tell why damage was never read)."""

    def __init__(self, config: EngineConfig) -> None:
        self.free_listeners: list[FreeListener] = []
        m, device = config.model, torch.device(config.device)
        groups = m.layer_groups
        full_layers = [i for i, g in enumerate(groups) if g is GroupKind.FULL]
        swa_layers = [i for i, g in enumerate(groups) if g is GroupKind.SWA]
        self.full = KVPool(config.num_slots, len(full_layers), m, device)
        self.swa = (SWAPool(config.swa_num_slots, config.num_slots, len(swa_layers), m, device, self.free_listeners)
                    if swa_layers else None)
        self.draft = (DraftPool(config.num_slots, replace(m, num_layers=config.draft_layers), device)
                      if config.speculative_k else None)
        self._layers = {i: layer_kv(self.full.k_layers, self.full.v_layers, j, None, GroupKind.FULL)
                        for j, i in enumerate(full_layers)}
        if self.swa is not None:
            self._layers |= {i: layer_kv(self.swa.k_layers, self.swa.v_layers, j, self.swa.full_to_swa, GroupKind.SWA)
                             for j, i in enumerate(swa_layers)}

    def layer(self, i: int) -> LayerKV:
        return self._layers[i]

    def alloc(self, n: int) -> torch.Tensor | None:
        """n FULL slots, each with an SWA slot on swa models; None (nothing held) if either is short."""
        slots = self.full.alloc(n)
        if slots is not None and self.swa is not None and not self.swa.map(slots):
            self.full.free(slots)
            return None
        return slots

    def restart(self) -> None:
        """With every slot free, allocate in a new engine's order again (a seeded run replays)."""
        for pool in (self.full, self.swa):
            if pool is not None:
                pool.restart()

    def free(self, slots: torch.Tensor, cause: str) -> None:
        if self.swa is not None:
            self.swa.unmap(slots, cause)
        kinds = [GroupKind.FULL] + ([GroupKind.DRAFT] if self.draft is not None else [])
        for listener in self.free_listeners:
            for kind in kinds:
                listener(kind, slots, cause)
        self.full.free(slots)


class ReqToTokenPool:
    """``table[row, pos]`` = FULL slot of a running request's token at pos; rows are handed out to
    requests while they hold KV. Entries past a request's KV length are stale and never read."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device) -> None:
        self.table = torch.zeros((max_rows, max_context), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_rows))

    def alloc(self) -> int | None:
        return self._free_rows.pop(0) if self._free_rows else None

    def free(self, row: int) -> None:
        assert row not in self._free_rows, "row freed twice"
        self._free_rows.append(row)

    def restart(self) -> None:
        """With every row free, hand them out from row 0 up again, as a new table does."""
        assert len(self._free_rows) == self.table.shape[0], "restart while rows are held"
        self._free_rows.sort()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.numel()] = slots.to(self.table.device)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end): a CPU copy, unaffected by later writes to the row."""
        return self.table[row, start:end].to("cpu", copy=True)
