"""The paged cache of transformers 5.17 (``BlockManagerLayout``): per-layer K and V tensors
``[(N + 2) * block_size, H, D]`` shared by every layer group; one ``BlockManager`` hands out global
block ids from a free deque and tracks complete blocks as ``Block`` objects. The two trash blocks
are the last two, so block 0 is taken out of the free deque here to serve as the canary's reserved
slot 0. Also the two defects of 5.17's cache the adapter names. versions.py says what every layout
answers."""

from __future__ import annotations

from collections import deque
from typing import AbstractSet, Any, Callable, Container, Iterable

from ...canary.seam import GroupKind
from .cache_groups import (
    CAUSE_DEDUPLICATED, CAUSE_EVICTED, CAUSE_OFFLOADED, CAUSE_RELEASED, FULL_ATTENTION, KINDS, SLIDING_ATTENTION,
    Causes, FreeCallback, GroupCache, MarkedCallback, UnsupportedModel, full_first, group_window,
)
from ..patches import Patches

# transformers 5.17 matches a prompt of a whole number of pages in full, recomputes its last token
# (it needs that token's logits) and writes its K/V into the last matched block: a cached block other
# requests read. The K/V written equals the cached one only up to rounding, so a request reading that
# block in the same forward sees its bytes change (5.18 leaves the last page out of the match).
DEFECT_CACHED_BLOCK_REWRITE = "a forward rewrote a cached (hashed) block"
# transformers 5.17 under async batching: the next batch is scheduled (a block allocated for the first
# token past such a prompt) before the last batch's update marks its blocks complete, and the update
# hashes that new block over the one or no token it holds. An identical request at the same point
# finds the hash and adopts the block: two running requests then decode into one block, each
# overwriting the other's K/V (the same values only while their tokens agree).
DEFECT_SHARED_DECODE_BLOCK = "two running requests decode into one block (hashed before it was full)"


class _NotifyingDeque(deque):
    """BlockManager's free deque: every block entering it is announced first."""

    def __init__(self, blocks: Iterable[int], announce: Callable[[list[int]], None]) -> None:
        super().__init__(blocks)
        self.announce = announce

    def append(self, block: int) -> None:
        self.announce([block])
        super().append(block)

    def extend(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        if blocks:
            self.announce(blocks)
        super().extend(blocks)


class _HashedBlocks:
    """5.17's hashed block ids, asked block by block: the block's hash maps back to it."""

    def __init__(self, manager: Any) -> None:
        self._blocks, self._hash_to_id = manager._id_to_block, manager._hash_to_id

    def __contains__(self, block_id: object) -> bool:
        block = self._blocks.get(block_id)
        return block is not None and block.hash is not None and self._hash_to_id.get(block.hash) == block_id


class BlockManagerLayout:
    """transformers 5.17: ``PagedAttentionCache.group_cache_managers`` and ``_block_manager``."""

    writes_hashed_blocks = True  # DEFECT_CACHED_BLOCK_REWRITE, DEFECT_SHARED_DECODE_BLOCK

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.cache = cache = processor.cache
        types = [FULL_ATTENTION if type(cm).__name__.startswith("Full") else SLIDING_ATTENTION
                 for cm in cache.group_cache_managers]
        if FULL_ATTENTION not in types:
            raise UnsupportedModel(f"the canary needs a full-attention layer group; this model has {types}")
        if len(types) != len(set(types)):
            raise UnsupportedModel(f"transformers 5.17 splits this model into layer groups {types}; the canary "
                                   "guards one group per attention type (use as many sliding as full layers, "
                                   "or transformers >= 5.18)")
        heads, dim, page = cache.num_key_value_heads, cache.head_dim, cache.block_size
        num_blocks = cache.key_cache[0].shape[0] // page
        k_layers = tuple(k.view(num_blocks, page, heads, dim) for k in cache.key_cache)
        v_layers = tuple(v.view(num_blocks, page, heads, dim) for v in cache.value_cache)
        self.groups = []
        layers = sorted(cache.layer_index_to_group_indices.items(), key=lambda item: item[1])  # (layer, (group, j))
        for index in sorted(range(len(types)), key=lambda i: full_first(types[i])):
            kind = KINDS[types[index]]
            window, ring = group_window(kind, cache.config)
            in_group = tuple(layer for layer, (group, _) in layers if group == index)
            self.groups.append(GroupCache(kind, in_group, k_layers, v_layers, num_blocks, page, window, ring,
                                          key=index, io_index=index, index_stride=page))
        self._kind_of_index = {g.key: g.kind for g in self.groups}
        self._owner: dict[int, GroupKind] = {}  # block id -> the group it was last handed to
        self.causes = Causes()
        self._on_free: FreeCallback | None = None
        self._manager_patches = Patches()  # of the block manager in use (flush starts a fresh one)

    def block_ids(self, group: GroupCache, request_id: str) -> list[int]:
        return self.cache.group_cache_managers[group.key].block_table.get(request_id, [])

    def store_target(self, layer_idx: int) -> tuple[GroupKind, int]:
        """The group model layer `layer_idx` stores into and its index in that group's k_layers
        (the per-layer tensors every group shares)."""
        index, within = self.cache.layer_index_to_group_indices[layer_idx]
        return self._kind_of_index[index], within

    def hashed_blocks(self) -> tuple[AbstractSet[int], AbstractSet[int]]:
        """The blocks with a content hash, and those of them a live request holds (an unheld one
        is an initialised block)."""
        manager = self.cache._block_manager
        hashed = set(manager._hash_to_id.values())
        return hashed, hashed - manager._init_block_ids.keys()

    def hashed_ids(self) -> Container[int]:
        """The blocks with a content hash (membership in O(1): asked on every forward)."""
        return _HashedBlocks(self.cache._block_manager)

    def install(self, patches: Patches, on_free: FreeCallback, on_marked: MarkedCallback) -> None:
        self._on_free = on_free
        patches.on_uninstall(self._manager_patches.uninstall)
        self._hook_manager(self.cache._block_manager)
        for cm in self.cache.group_cache_managers:
            self.causes.wrap(patches, cm, "free_blocks", CAUSE_RELEASED)
        # 5.17 releases an offloaded request like a finished one; only the caller tells them apart.
        self.causes.wrap(patches, self.processor.offloading_manager, "offload_requests", CAUSE_OFFLOADED)
        patches.after(self.cache, "mark_shareable_blocks_as_complete", lambda state, n: on_marked(state) if n else None)

    def _hook_manager(self, manager: Any) -> None:
        """Announce the manager's frees, note which group each block goes to, keep block 0 out."""
        patches = self._manager_patches
        free = _NotifyingDeque((b for b in manager._uninit_block_ids if b != 0), self._freed)
        manager._uninit_block_ids = free
        patches.on_uninstall(lambda: setattr(manager, "_uninit_block_ids", deque(free)))  # block 0 stays out

        def make(get_free_blocks: Any) -> Any:
            def handed_out(n_blocks: int, last_block_id: int | None, shareable: bool, group_id: int
                           ) -> list[int] | None:
                blocks = get_free_blocks(n_blocks, last_block_id, shareable, group_id)
                for block in blocks or ():
                    self._owner[block] = self._kind_of_index[group_id]
                return blocks
            return handed_out

        patches.wrap(manager, "get_free_blocks", make)
        self.causes.wrap(patches, manager, "has_enough_free_blocks", CAUSE_EVICTED)
        self.causes.wrap(patches, manager, "uninitialize_unshared_block", CAUSE_DEDUPLICATED)

    def _freed(self, blocks: list[int]) -> None:
        by_kind: dict[GroupKind, list[int]] = {}
        for block in blocks:
            by_kind.setdefault(self._owner.pop(block, GroupKind.FULL), []).append(block)
        for kind, group_blocks in by_kind.items():
            self._on_free(kind, group_blocks, self.causes.current or CAUSE_RELEASED)

    def flush(self) -> None:
        """Free every request's blocks and every hashed one; a fresh manager hands out blocks
        1, 2, ... again."""
        manager = self.cache._block_manager
        self.cache.free_all_requests()
        if manager._init_block_ids:
            self._freed(list(manager._init_block_ids))
        fresh = type(manager)(manager.num_blocks, manager.block_size, manager.tp_on)
        self.cache._block_manager = fresh
        self._owner.clear()
        self._manager_patches.uninstall()  # the old manager's, which is dropped
        self._hook_manager(fresh)
