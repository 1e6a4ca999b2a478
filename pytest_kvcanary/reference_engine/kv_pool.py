"""KV pools, their page allocators and the req_to_token table.

A slot is one token's K/V in every layer of a pool: ``k_layers[i][slot]`` is a ``[num_kv_heads,
head_dim]`` row, or a ``[latent_dim]`` row of a latent (mla) pool, which has no V buffers. A page is
page_size consecutive slots, ``[page * page_size, (page + 1) * page_size)``: the pools hand out and
take back whole pages (with page_size 1 a page is a slot). Page 0, which holds slot 0, is reserved
in every pool: never allocated, padding points there. Pages and slots handed out and taken back are
CPU int64 tensors; the buffers, the SWA map and the req_to_token table live on the engine's device.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Sequence

import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.seam import FreeListener

from .config import LATENT, EngineConfig, ModelConfig, index_row_bytes


def kv_buffers(num_slots: int, num_layers: int, model: ModelConfig,
               device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed per-layer K and V buffers ``[num_slots, *model.kv_row]`` in model.kv_storage; no V for
    a latent model."""
    def zeros() -> list[torch.Tensor]:
        return [torch.zeros((num_slots, *model.kv_row), dtype=model.kv_storage, device=device)
                for _ in range(num_layers)]

    return zeros(), [] if model.attention in LATENT else zeros()


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of these pages, page by page in order."""
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).flatten()


def put_from_host(table: torch.Tensor, rows: list[int], columns: list[int], values: list[int]) -> None:
    """``table[rows[i], columns[i]] = values[i]`` for every i, the three lists in one copy to the
    table's device (nothing when they are empty)."""
    if values:
        at = torch.tensor([rows, columns, values], dtype=torch.int64).to(table.device)
        table[at[0], at[1]] = at[2]


def pages_needed(page_size: int, start: int, n: int) -> int:
    """New pages positions [start, start + n) of a request take: those past the page holding
    position start - 1 (a request fills its last page first)."""
    return -(-(start + n) // page_size) - -(-start // page_size)


def slot_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages of slots that are whole pages listed in order (page_slots' inverse)."""
    return slots if page_size == 1 else slots[::page_size] // page_size


def token_slots(table_rows: torch.Tensor, page_size: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    """The slots of positions [start, end) (end: every position the table columns reach) of
    req_to_token rows ``[..., cols]``, on their device."""
    if page_size == 1:
        return table_rows[..., start:end]
    end = table_rows.shape[-1] * page_size if end is None else end
    positions = torch.arange(start, end, device=table_rows.device)
    return table_rows[..., positions // page_size] * page_size + positions % page_size


class KVPool:
    """Per-layer K and V buffers ``[num_slots, *model.kv_row]`` plus a free list of pages; a latent
    (mla) model's pool has K buffers only (v_layers empty)."""

    def __init__(self, num_slots: int, num_layers: int, model: ModelConfig, device: torch.device,
                 page_size: int = 1) -> None:
        self.num_slots, self.page_size = num_slots, page_size
        self.num_pages = num_slots // page_size
        self.k_layers, self.v_layers = kv_buffers(num_slots, num_layers, model, device)
        self.free_pages = torch.arange(1, self.num_pages, dtype=torch.int64)  # read-only for callers
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._is_free[0] = False

    @property
    def num_free(self) -> int:
        """Free slots (of free pages)."""
        return self.free_pages.numel() * self.page_size

    @property
    def free_slots(self) -> torch.Tensor:
        return page_slots(self.free_pages, self.page_size)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free pages, or None (nothing allocated) when fewer than n are free."""
        if n > self.free_pages.numel():
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self._is_free[pages] = False
        return pages

    def restart(self) -> None:
        """With every page free, hand them out from page 1 up again, as a new pool does."""
        assert self.free_pages.numel() == self.num_pages - 1, "restart while pages are held"
        self.free_pages = torch.arange(1, self.num_pages, dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        """Return allocated pages; freeing page 0, a free page or a page twice is a bug."""
        if pages.numel() == 0:
            return
        assert pages.unique().numel() == pages.numel() and pages.min() > 0, "bad free"
        assert not self._is_free[pages].any(), "bad free"
        self._is_free[pages] = True
        self.free_pages = torch.cat([self.free_pages, pages])


class SWAPool(KVPool):
    """The windowed layers' pool. ``full_to_swa[full_slot]`` is the SWA slot holding that token's
    windowed-layer K/V, 0 when it has none (never mapped, or slid out of every window); a FULL page
    maps to one SWA page, slot for slot. Its methods take FULL pages."""

    def __init__(self, num_slots: int, full_num_slots: int, num_layers: int, model: ModelConfig,
                 device: torch.device, listeners: list[FreeListener], page_size: int = 1) -> None:
        super().__init__(num_slots, num_layers, model, device, page_size)
        self.full_to_swa = torch.zeros(full_num_slots, dtype=torch.int64, device=device)
        self._listeners = listeners

    def map(self, full_pages: torch.Tensor) -> bool:
        """Give each FULL page an SWA page; False (nothing changed) when too few are free."""
        swa = self.alloc(full_pages.numel())
        if swa is None:
            return False
        device = self.full_to_swa.device
        self.full_to_swa[page_slots(full_pages, self.page_size).to(device)] = page_slots(swa, self.page_size).to(device)
        return True

    def unmap(self, full_pages: torch.Tensor, cause: str) -> int:
        """Free the SWA pages of those FULL pages that have one; returns how many slots were freed."""
        full_slots = page_slots(full_pages, self.page_size)
        for listener in self._listeners:
            listener(GroupKind.SWA, full_slots, cause)
        idx = full_slots.to(self.full_to_swa.device)
        swa = self.full_to_swa[idx].cpu()
        self.full_to_swa[idx] = 0
        swa = swa[swa != 0]
        self.free(slot_pages(swa, self.page_size))
        return swa.numel()

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand the SWA pages of FULL pages src to FULL pages dst (dst has none); src is left with none."""
        device = self.full_to_swa.device
        src, dst = page_slots(src, self.page_size).to(device), page_slots(dst, self.page_size).to(device)
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
    FULL pool's. It holds the draft's attention layers only (a hybrid draft's recurrent layers keep
    no KV). full_to_draft (the identity) maps FULL slots to it for the canary's sweep."""

    def __init__(self, num_slots: int, model: ModelConfig, device: torch.device, page_size: int = 1) -> None:
        self.num_slots, self.page_size = num_slots, page_size
        layers = [i for i, g in enumerate(model.layer_groups) if g is GroupKind.FULL]
        self._index = {layer: j for j, layer in enumerate(layers)}
        self.k_layers, self.v_layers = kv_buffers(num_slots, len(layers), model, device)
        self.full_to_draft = torch.arange(num_slots, device=device)

    def layer(self, i: int) -> LayerKV:
        return layer_kv(self.k_layers, self.v_layers, self._index[i], None, GroupKind.DRAFT)


class KVPools:
    """The FULL pool (slot ids everyone uses) and, for swa models, the SWA pool behind it; with
    speculative decoding, the draft pool beside it; for a sparse model, ``indexer``: per layer, the
    indexer's key rows, uint8 ``[num_slots, index_row_bytes]``, slot for slot the FULL pool's
    (sparse.py). alloc/free work on FULL pages and keep the SWA
    side in step. free_listeners hear of every free (as FULL slots) with its cause (the fault ledger
    uses it to tell why damage was never read)."""

    def __init__(self, config: EngineConfig) -> None:
        self.free_listeners: list[FreeListener] = []
        m, device, ps = config.model, torch.device(config.device), config.page_size
        self.page_size = ps
        groups = m.layer_groups
        full_layers = [i for i, g in enumerate(groups) if g is GroupKind.FULL]
        swa_layers = [i for i, g in enumerate(groups) if g is GroupKind.SWA]
        self.full = KVPool(config.num_slots, len(full_layers), m, device, ps)
        self.swa = (SWAPool(config.swa_num_slots, config.num_slots, len(swa_layers), m, device, self.free_listeners,
                            ps) if swa_layers else None)
        self.draft = (DraftPool(config.num_slots, replace(m, num_layers=config.draft_layers), device, ps)
                      if config.speculative_k else None)
        self.indexer = [torch.zeros((config.num_slots, index_row_bytes(m.index_head_dim)), dtype=torch.uint8,
                                    device=device) for _ in full_layers] if m.attention == "sparse" else []
        self._layers = {i: layer_kv(self.full.k_layers, self.full.v_layers, j, None, GroupKind.FULL)
                        for j, i in enumerate(full_layers)}
        if self.swa is not None:
            self._layers |= {i: layer_kv(self.swa.k_layers, self.swa.v_layers, j, self.swa.full_to_swa, GroupKind.SWA)
                             for j, i in enumerate(swa_layers)}

    def layer(self, i: int) -> LayerKV:
        return self._layers[i]

    def alloc(self, n: int) -> torch.Tensor | None:
        """n FULL pages, each with an SWA page on swa models; None (nothing held) if either is short."""
        pages = self.full.alloc(n)
        if pages is not None and self.swa is not None and not self.swa.map(pages):
            self.full.free(pages)
            return None
        return pages

    def restart(self) -> None:
        """With every slot free, allocate in a new engine's order again (a seeded run replays)."""
        for pool in (self.full, self.swa):
            if pool is not None:
                pool.restart()

    def free(self, pages: torch.Tensor, cause: str) -> None:
        """Return FULL pages (and their SWA pages); listeners hear their slots first."""
        if self.swa is not None:
            self.swa.unmap(pages, cause)
        kinds = ([GroupKind.FULL] + ([GroupKind.DRAFT] if self.draft is not None else [])
                 + ([GroupKind.INDEXER] if self.indexer else []))
        slots = page_slots(pages, self.page_size)
        for listener in self.free_listeners:
            for kind in kinds:
                listener(kind, slots, cause)
        self.full.free(pages)


class ReqToTokenPool:
    """``table[row, pos // page_size]`` = FULL page of a running request's token at pos (page_size
    1: its FULL slot, SGLang's req_to_token; else a block table): the token's slot is that page's
    slot ``pos % page_size``. Rows are handed out to requests while they hold KV. Entries past a
    request's KV length are stale and never read. write and read take and give slots."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device, page_size: int = 1) -> None:
        self.page_size = page_size
        self.table = torch.zeros((max_rows, -(-max_context // page_size)), dtype=torch.int64, device=device)
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
        """Map positions [start, start + len(slots)) to slots (each in the page its position's
        column then names). With pages, a slot's offset in its page must be its position's: one
        that is not would be written in one place and read from another, a bug that asserts."""
        self.write_rows([row], [start], [slots])

    def write_rows(self, rows: Sequence[int], starts: Sequence[int], slots: Sequence[torch.Tensor]) -> None:
        """``write`` of each (row, start, slots), in one copy to the table's device (the indices
        built on the host as lists: a handful of torch calls a step whatever the batch, and host work
        in proportion to the slots written)."""
        ps = self.page_size
        at_rows: list[int] = []
        columns: list[int] = []
        pages: list[int] = []
        for row, start, row_slots in zip(rows, starts, slots):
            values, positions = row_slots.tolist(), range(start, start + row_slots.numel())
            if ps > 1:  # the page each slot is in, at its position's column
                assert all(v % ps == p % ps for v, p in zip(values, positions)), "slot misaligned in its page"
                values, positions = [v // ps for v in values], [p // ps for p in positions]
            at_rows += [row] * len(values)
            columns += positions
            pages += values
        put_from_host(self.table, at_rows, columns, pages)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end): a CPU copy, unaffected by later writes to the row."""
        return token_slots(self.table[row], self.page_size, start, end).to("cpu", copy=True)

    def pages(self, row: int, start: int, end: int) -> torch.Tensor:
        """The pages holding positions [start, end), each once (CPU)."""
        if end <= start:
            return torch.empty(0, dtype=torch.int64)
        ps = self.page_size
        return self.table[row, start // ps:-(-end // ps)].to("cpu", copy=True)
