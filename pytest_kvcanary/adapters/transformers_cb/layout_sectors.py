"""The paged cache of transformers 5.18+ (``SectorLayout``): one flat byte tensor split into
sectors; each attention type has a ``CacheAllocator`` (``cache.cache_allocators``) with its own
block geometry over the whole tensor, a ``BlockLedger`` (hashes, shared reference counts, cached
blocks) and a ``CachePool`` that every released block passes through. The two leading trash sectors
are never allocated. versions.py says what every layout answers."""

from __future__ import annotations

from typing import AbstractSet, Any, Container

import torch

from ...canary.seam import GroupKind
from .cache_groups import (
    CAUSE_DEDUPLICATED, CAUSE_EVICTED, CAUSE_OFFLOADED, CAUSE_RELEASED, FULL_ATTENTION, KINDS, Causes, FreeCallback,
    GroupCache, MarkedCallback, UnsupportedModel, full_first, group_window,
)
from ..patches import Patches


def block_views(base: torch.Tensor, allocator: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int]:
    """Per layer of the allocator's group, K and V views ``[num_blocks, page, H, D]`` of `base`, a
    tensor of the cache's dtype laid out as transformers lays out its cache (block b: the b-th run
    of block_physical_stride rows; per page, the page's K rows then its V rows, layer by layer), and
    num_blocks."""
    page, heads, dim = allocator.tokens_per_page, allocator.num_key_value_heads, allocator.head_dim
    stride = allocator.block_physical_stride  # rows per block: (K page + V page) per layer of the group
    row = heads * dim
    num_blocks = base.numel() // (stride * row)

    def layer(i: int, half: int) -> torch.Tensor:
        return base.as_strided((num_blocks, page, heads, dim), (stride * row, row, dim, 1),
                               base.storage_offset() + (2 * i + half) * page * row)

    layers = range(len(allocator.layer_indices))
    return tuple(layer(i, 0) for i in layers), tuple(layer(i, 1) for i in layers), num_blocks


class SectorLayout:
    """transformers 5.18+: ``PagedAttentionCache.cache_allocators``."""

    writes_hashed_blocks = False  # no release writes a block once it has a content hash

    def __init__(self, processor: Any) -> None:
        self.cache = cache = processor.cache
        names = list(cache.cache_allocators)
        if FULL_ATTENTION not in names:
            raise UnsupportedModel(f"the canary needs a full-attention layer group; this model has {names}")
        self.groups = [self._group(name, cache.cache_allocators[name]) for name in sorted(names, key=full_first)]
        self._kinds = {cache.cache_allocators[g.key].index: g.kind for g in self.groups}
        self.causes = Causes()

    def _group(self, name: str, allocator: Any) -> GroupCache:
        kind = KINDS[name]
        k_layers, v_layers, num_blocks = block_views(allocator.cache_tensor, allocator)
        window, ring = group_window(kind, self.cache.config)
        return GroupCache(kind, tuple(allocator.layer_indices), k_layers, v_layers, num_blocks,
                          allocator.tokens_per_page, window, ring, key=name, io_index=allocator.index,
                          index_stride=allocator.block_physical_stride)

    def cpu_pools(self, cpu_bytes: torch.Tensor) -> list[tuple[GroupCache, tuple[torch.Tensor, ...],
                                                                  tuple[torch.Tensor, ...], int]]:
        """Per group, its layers' K and V views of transformers' CPU swap pool (`cpu_bytes`, whose
        blocks of each allocator lie as the device cache's do, without trash sectors) and the pool's
        blocks in that group's geometry."""
        out = []
        for group in self.groups:
            allocator = self.cache.cache_allocators[group.key]
            out.append((group, *block_views(cpu_bytes.view(allocator.cache_tensor.dtype), allocator)))
        return out

    def block_ids(self, group: GroupCache, request_id: str) -> list[int]:
        return self.cache.cache_allocators[group.key].block_table.get(request_id, [])

    def store_target(self, layer_idx: int) -> tuple[GroupKind, int]:
        """The group model layer `layer_idx` stores into and its index in that group's k_layers."""
        group = next(g for g in self.groups if layer_idx in g.layers)
        return group.kind, group.layers.index(layer_idx)

    def hashed_blocks(self) -> tuple[AbstractSet[int], AbstractSet[int]]:
        """The FULL blocks with a content hash, and those of them a live request holds (set
        operations only: no Python loop over the blocks)."""
        ledger = self.cache.cache_allocators[FULL_ATTENTION].ledger
        hashed = ledger.block_to_hash.keys()
        return hashed, hashed - ledger.cached_blocks.keys()

    def hashed_ids(self) -> Container[int]:
        """The FULL blocks with a content hash (membership only; no copy)."""
        return self.cache.cache_allocators[FULL_ATTENTION].ledger.block_to_hash

    def install(self, patches: Patches, on_free: FreeCallback, on_marked: MarkedCallback) -> None:
        cache, causes = self.cache, self.causes

        def make(pool_free: Any) -> Any:
            def free_blocks(index: int, block_ids: list[int]) -> None:
                if block_ids:
                    on_free(self._kinds[index], list(block_ids), causes.current or CAUSE_RELEASED)
                pool_free(index, block_ids)
            return free_blocks

        patches.wrap(cache.pool, "free_blocks", make)
        causes.wrap(patches, cache, "free_blocks",
                    lambda request_id, no_cache=False: CAUSE_OFFLOADED if no_cache else CAUSE_RELEASED)
        causes.wrap(patches, cache, "evict_cached_blocks", CAUSE_EVICTED)
        causes.wrap(patches, cache, "mark_complete_blocks", CAUSE_DEDUPLICATED)
        patches.after(cache, "mark_complete_blocks",
                      lambda state, complete_blocks: on_marked(state) if complete_blocks else None)

    def flush(self) -> None:
        """Free every request's blocks and every hashed one; hand blocks out in a new cache's order."""
        self.cache.free_all_requests()
        self.cache.evict_cached_blocks()
        self.cache.reset()
