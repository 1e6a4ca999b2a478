"""What differs between the transformers releases the adapter supports (the version shim).

The continuous-batching config names its page size ``page_size`` (5.18+) or ``block_size`` (5.17),
and the paged cache changed shape between them, so each layout below answers the same questions
about one of them:

- ``SectorLayout`` (5.18+): one flat byte tensor split into sectors; each attention type has a
  ``CacheAllocator`` (``cache.cache_allocators``) with its own block geometry over the whole
  tensor, a ``BlockLedger`` (hashes, shared reference counts, cached blocks) and a ``CachePool``
  that every released block passes through. The two leading trash sectors are never allocated.
- ``BlockManagerLayout`` (5.17): per-layer K and V tensors ``[(N + 2) * block_size, H, D]`` shared
  by every layer group; one ``BlockManager`` hands out global block ids from a free deque and
  tracks complete blocks as ``Block`` objects. The two trash blocks are the last two, so block 0
  is taken out of the free deque here to serve as the canary's reserved slot 0.

Both report a block id per (request, block index) through ``block_ids``, the hashed FULL blocks
and those a live request holds through ``hashed_blocks`` (``hashed_ids``: membership only), every
block returning to the free pool through the ``on_free`` callback (before it is released, with a
cause; ``causes.cause(...)`` names the cause of what an outer call releases) and every request whose
completed blocks were just hashed through ``on_marked`` (not called for a request that completed
none).
"""

from __future__ import annotations

import inspect
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Container, Iterable, Iterator

import torch

from kvcanary_kernels.records import GroupKind

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
KINDS = {FULL_ATTENTION: GroupKind.FULL, SLIDING_ATTENTION: GroupKind.SWA}

FreeCallback = Callable[[GroupKind, list[int], str], None]
MarkedCallback = Callable[[Any], None]  # called with the RequestState whose blocks were hashed

CAUSE_RELEASED = "request released its blocks"
CAUSE_OFFLOADED = "request offloaded (its KV copied to CPU memory, or dropped to be recomputed)"
CAUSE_EVICTED = "evicted from the prefix cache"
CAUSE_DEDUPLICATED = "deduplicated: the request adopted an identical hashed block"
CAUSE_RESET = "engine reset"

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


class UnsupportedModel(ValueError):
    """A model whose cache layout the adapter cannot describe to the canary."""


@dataclass(frozen=True)
class GroupCache:
    """One attention type's KV as the canary sees it: per-layer ``[num_blocks, page_size, H, D]``
    views (block b's slots are ``b * page_size + offset``) of the model layers ``layers``, the
    read window and the ring of a sliding-window group (tokens sit at ``position % ring``), and
    the allocator's key, the group's place in the per-group read and write index lists transformers
    hands the forward, and the physical cache rows per block in those indices (an index is
    ``block * index_stride + offset``)."""

    kind: GroupKind
    layers: tuple[int, ...]
    k_layers: tuple[torch.Tensor, ...]
    v_layers: tuple[torch.Tensor, ...]
    num_blocks: int
    page_size: int
    window: int | None
    ring: int
    key: Any
    io_index: int
    index_stride: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def fingerprintable(self) -> bool:
        row = self.k_layers[0][0, 0]
        return row.numel() * row.element_size() % 16 == 0


class Causes:
    """The reason the blocks being released right now are released: set by the outermost
    transformers call that releases them (an engine reset releases through the others)."""

    def __init__(self) -> None:
        self.current: str | None = None

    @contextmanager
    def cause(self, cause: str) -> Iterator[None]:
        outer = self.current
        self.current = outer or cause
        try:
            yield
        finally:
            self.current = outer

    def wrap(self, obj: Any, name: str, cause: str | Callable[..., str]) -> None:
        """Run obj.name under `cause` (a string, or a function of the call's arguments)."""
        original = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.cause(cause if isinstance(cause, str) else cause(*args, **kwargs)):
                return original(*args, **kwargs)

        setattr(obj, name, wrapped)


def _after(obj: Any, name: str, then: Callable[..., None]) -> None:
    """Call then(*args) after obj.name(*args) returns."""
    original = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        then(*args, **kwargs)
        return result

    setattr(obj, name, wrapped)


def _sliding_window(config: Any) -> int:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < 2:
        raise UnsupportedModel(f"a sliding-window layer group needs config.sliding_window >= 2; got {window!r}")
    return window


def _group_window(kind: GroupKind, config: Any) -> tuple[int | None, int]:
    """(canary read window, ring) of a group: a sliding layer reads the window - 1 cached tokens
    before its query (transformers' get_read_indices) from a ring of `window` slots."""
    if kind is GroupKind.FULL:
        return None, 0
    window = _sliding_window(config)
    return window - 1, window


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
        self.groups = [self._group(name, cache.cache_allocators[name]) for name in sorted(names, key=_full_first)]
        self._kinds = {cache.cache_allocators[g.key].index: g.kind for g in self.groups}
        self.causes = Causes()

    def _group(self, name: str, allocator: Any) -> GroupCache:
        kind = KINDS[name]
        k_layers, v_layers, num_blocks = block_views(allocator.cache_tensor, allocator)
        window, ring = _group_window(kind, self.cache.config)
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

    def install(self, on_free: FreeCallback, on_marked: MarkedCallback) -> None:
        cache, causes = self.cache, self.causes
        pool_free = cache.pool.free_blocks

        def free_blocks(index: int, block_ids: list[int]) -> None:
            if block_ids:
                on_free(self._kinds[index], list(block_ids), causes.current or CAUSE_RELEASED)
            pool_free(index, block_ids)

        cache.pool.free_blocks = free_blocks
        causes.wrap(cache, "free_blocks",
                    lambda request_id, no_cache=False: CAUSE_OFFLOADED if no_cache else CAUSE_RELEASED)
        causes.wrap(cache, "evict_cached_blocks", CAUSE_EVICTED)
        causes.wrap(cache, "mark_complete_blocks", CAUSE_DEDUPLICATED)
        _after(cache, "mark_complete_blocks",
               lambda state, complete_blocks: on_marked(state) if complete_blocks else None)

    def flush(self) -> None:
        """Free every request's blocks and every hashed one; hand blocks out in a new cache's order."""
        self.cache.free_all_requests()
        self.cache.evict_cached_blocks()
        self.cache.reset()


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
        for index in sorted(range(len(types)), key=lambda i: _full_first(types[i])):
            kind = KINDS[types[index]]
            window, ring = _group_window(kind, cache.config)
            in_group = tuple(layer for layer, (group, _) in layers if group == index)
            self.groups.append(GroupCache(kind, in_group, k_layers, v_layers, num_blocks, page, window, ring,
                                          key=index, io_index=index, index_stride=page))
        self._kind_of_index = {g.key: g.kind for g in self.groups}
        self._owner: dict[int, GroupKind] = {}  # block id -> the group it was last handed to
        self.causes = Causes()
        self._on_free: FreeCallback | None = None

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

    def install(self, on_free: FreeCallback, on_marked: MarkedCallback) -> None:
        self._on_free = on_free
        self._hook_manager(self.cache._block_manager)
        for cm in self.cache.group_cache_managers:
            self.causes.wrap(cm, "free_blocks", CAUSE_RELEASED)
        # 5.17 releases an offloaded request like a finished one; only the caller tells them apart.
        self.causes.wrap(self.processor.offloading_manager, "offload_requests", CAUSE_OFFLOADED)
        _after(self.cache, "mark_shareable_blocks_as_complete", lambda state, n: on_marked(state) if n else None)

    def _hook_manager(self, manager: Any) -> None:
        """Announce the manager's frees, note which group each block goes to, keep block 0 out."""
        manager._uninit_block_ids = _NotifyingDeque((b for b in manager._uninit_block_ids if b != 0), self._freed)
        get_free_blocks = manager.get_free_blocks

        def handed_out(n_blocks: int, last_block_id: int | None, shareable: bool, group_id: int) -> list[int] | None:
            blocks = get_free_blocks(n_blocks, last_block_id, shareable, group_id)
            for block in blocks or ():
                self._owner[block] = self._kind_of_index[group_id]
            return blocks

        manager.get_free_blocks = handed_out
        self.causes.wrap(manager, "has_enough_free_blocks", CAUSE_EVICTED)
        self.causes.wrap(manager, "uninitialize_unshared_block", CAUSE_DEDUPLICATED)

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
        self._hook_manager(fresh)


def _full_first(name: str) -> int:
    return 0 if name == FULL_ATTENTION else 1


def _config_fields() -> set[str]:
    from transformers import ContinuousBatchingConfig

    return set(inspect.signature(ContinuousBatchingConfig).parameters)


def config_options(page_size: int, **options: Any) -> dict[str, Any]:
    """ContinuousBatchingConfig keyword arguments for this version: the page size under its name,
    and flash attention never switched on behind the model's back (5.18+ asks; 5.17 does not
    switch a model whose attention is already paged, see `sdpa_attention`)."""
    fields = _config_fields()
    options["page_size" if "page_size" in fields else "block_size"] = page_size
    options["auto_switch_to_flash"] = False
    return {name: value for name, value in options.items() if name in fields}


def sdpa_attention() -> str:
    """The attention implementation name under which continuous batching runs SDPA."""
    return "sdpa" if "auto_switch_to_flash" in _config_fields() else "paged|sdpa"


def cache_layout(processor: Any) -> SectorLayout | BlockManagerLayout:
    """The layout of this ContinuousBatchProcessor's paged cache, by transformers version."""
    cache = processor.cache
    if hasattr(cache, "cache_allocators"):
        return SectorLayout(processor)
    if hasattr(cache, "_block_manager"):
        return BlockManagerLayout(processor)
    raise UnsupportedModel(f"unknown transformers paged-cache layout ({type(cache).__module__}); the adapter "
                           "supports the versions pytest-kvcanary[transformers] installs")
