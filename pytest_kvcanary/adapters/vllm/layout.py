"""Where a slot's K and V bytes lie in a vLLM KV cache: found by asking vLLM's own cache write,
then read off the tensor's shape and strides.

Two steps, kept apart so that one of them serves every layout:

- `probe` (vLLM's CPU attention, CPU_ATTN, which keeps each layer as ``[num_blocks, kv_heads,
  block_size, 2 * head_size]``, used as ``[num_blocks, kv_heads, 2 * block_size, head_size]``, K
  rows then V rows per head): coded tokens go through the layer's own cache write into a scratch
  cache, and the order each half's rows come back in is matched against the orders it may use
  (`Order`): one row per token (``token``), one row per head dimension (``dim``: K on vLLM's
  vec and vec16 paths), or packed for AMX tiles (``dim_pairs`` and ``token_pairs``: K and V on
  its amx path, whose cache write runs on any x86 CPU). `probe_latent` does the same for
  CPU_MLA's latent rows (``[num_blocks, block_size, kv_lora_rank + rope_dim]``).
- `slot_bytes` takes one half of one layer as a view ``[num_blocks, block_size, *features]``, or
  ``[num_blocks, tiles, tile, *features]`` for a packed order (any strides: the layout's own
  order), and splits it along its leading feature axes (heads) until each view is one the
  fingerprint reads (``kvcanary_kernels.sources``): each slot's bytes one contiguous run,
  ``[num_blocks, block_size, run]``, or each block one run whose slots' features lie evenly
  strided (a ``dim`` half, or a packed one: read element by element, ``strided_read``). Where no
  split gets there the views keep the same addressing, strided, and the half is not fingerprinted.

vLLM's CUDA layouts go through `slot_bytes` alike: FlashAttention's ``[2, num_blocks, block_size,
heads, head_size]`` (half ``cache[i]``), FlashInfer's NHD ``[num_blocks, 2, block_size, heads,
head_size]`` (half ``cache[:, i]``) and HND ``[num_blocks, 2, heads, block_size, head_size]``
(half ``cache[:, i].transpose(1, 2)``: one run per head), MLA's ``[num_blocks, block_size,
width]``.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Callable, NamedTuple

import torch

from kvcanary_kernels.sources import strided_read
from pytest_kvcanary.canary.seam import Half


class Order(str, Enum):
    """How a CPU_ATTN half keeps a head's block: row t is token t (``token``), row d is dimension d
    (``dim``: K on the vec and vec16 paths), or packed for AMX tiles of bfloat16 (rows of 16
    pairs): K as ``[block_size / 16][head_size / 2][16 tokens][2 dimensions]`` (``dim_pairs``),
    V as ``[head_size / 16][block_size / 2][16 dimensions][2 tokens]`` (``token_pairs``)."""

    TOKEN = "token"
    DIM = "dim"
    DIM_PAIRS = "dim_pairs"
    TOKEN_PAIRS = "token_pairs"


# Order -> (block_size, head_size) divisors of the packed orders
PACKING = {Order.DIM_PAIRS: (16, 2), Order.TOKEN_PAIRS: (2, 16)}


class SlotBytes(NamedTuple):
    """One half's views ``[num_blocks, block_size, *features]`` (slot s at ``[s // block_size, s %
    block_size]``) or ``[num_blocks, tiles, tile, *features]`` (slot s at ``[s // block_size,
    s % block_size // tile, s % tile]``), and whether the fingerprint reads every one of them."""

    views: list[torch.Tensor]
    readable: bool


def slot_bytes(half: torch.Tensor, slot_dims: int = 1) -> SlotBytes:
    """Views of `half` (``[num_blocks, *slot axes, *features]``: one slot axis, or a tile axis and
    a slot-in-tile axis; any strides) the fingerprint reads (``kvcanary_kernels.sources``): the
    features flattened where a block's are contiguous, the view kept as it is where its slots'
    features are strided the way the fingerprint reads element by element, else split along the
    leading feature axis, recursively."""
    split = split_views(half, slot_dims)
    return SlotBytes([view for _, view, _ in split], all(readable for _, _, readable in split))


def split_views(half: torch.Tensor, slot_dims: int = 1) -> list[tuple[tuple[int, ...], torch.Tensor, bool]]:
    """`slot_bytes`' views, each with the leading feature indices it selects (its path: the view
    holds ``half[:, *slot axes, *path]``) and whether the fingerprint reads it."""
    block_size = math.prod(half.shape[1:1 + slot_dims])
    if half[0].is_contiguous():
        runs = half.reshape(half.shape[0], block_size, -1)
        return [((), runs, runs.shape[2] * runs.element_size() % 16 == 0)]
    readable = strided_read(half, block_size) is not None
    if readable or half.dim() == 2 + slot_dims:
        return [((), half, readable)]
    return [((i, *path), view, ok) for i in range(half.shape[1 + slot_dims])
            for path, view, ok in split_views(half.select(1 + slot_dims, i), slot_dims)]


def slot_axes(order: Order) -> int:
    """How many slot axes `cpu_attn_half` gives a half kept in `order`."""
    return 2 if order in PACKING else 1


def cpu_attn_half(cache: torch.Tensor, half: Half, order: Order) -> torch.Tensor:
    """One half of a CPU_ATTN layer cache as ``[num_blocks, block_size, kv_heads, head_size]``, or
    for a packed order ``[num_blocks, tiles, tile, kv_heads, *features]`` (a view in the layout's
    own order)."""
    blocks, heads, block_size, two_d = cache.shape
    d = two_d // 2
    index = 0 if half is Half.K else 1
    if order is Order.TOKEN:
        return cache.view(blocks, heads, 2, block_size, d)[:, :, index].permute(0, 2, 1, 3)
    if order is Order.DIM:
        return cache.view(blocks, heads, 2, d, block_size)[:, :, index].permute(0, 3, 1, 2)
    if order is Order.DIM_PAIRS:  # [blocks, tiles of 16 tokens, 16, heads, d / 2 pairs, 2]
        return cache.view(blocks, heads, 2, block_size // 16, d // 2, 16, 2)[:, :, index].permute(0, 2, 4, 1, 3, 5)
    # [blocks, token pairs, 2, heads, d / 16, 16]
    return cache.view(blocks, heads, 2, d // 16, block_size // 2, 16, 2)[:, :, index].permute(0, 3, 5, 1, 2, 4)


def per_token(view: torch.Tensor, order: Order) -> torch.Tensor:
    """A `cpu_attn_half` view as ``[num_blocks, block_size, kv_heads, head_size]`` (a copy where
    the order is packed)."""
    if order not in PACKING:
        return view
    return view.reshape(view.shape[0], view.shape[1] * view.shape[2], view.shape[3], -1)


def packable(order: Order, block_size: int, head_size: int) -> bool:
    """Whether a block of this size can be kept in `order`."""
    tokens, dims = PACKING.get(order, (1, 1))
    return block_size % tokens == 0 and head_size % dims == 0


def _codes(heads: int, block_size: int, head_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Three ``[heads, block_size, head_size]`` codes: the head, the token, the dimension, each + 1
    (exact in every float type up to 256)."""
    h, t, d = torch.meshgrid(torch.arange(heads), torch.arange(block_size), torch.arange(head_size), indexing="ij")
    return [(c + 1).to(dtype) for c in (h, t, d)]


def probe(layer: Any, cache: torch.Tensor,
          write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> dict[Half, Order | None]:
    """Per half of a CPU_ATTN layer: the order its cache write keeps (None: neither). write(tokens,
    scratch, slots) stores coded tokens (``[block_size, heads, head_size]``, in the cache's dtype)
    as K and V: the layer's own cache write by default (fp8.probe_write for an FP8 cache)."""
    if write is None:
        def write(tokens: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor) -> None:
            layer.impl.do_kv_cache_update(layer, tokens, tokens, scratch, slots)
    _, heads, block_size, two_d = cache.shape
    head_size = two_d // 2
    scratch = torch.zeros(2, heads, block_size, two_d, dtype=cache.dtype)
    slots = torch.arange(block_size, dtype=torch.int64) + block_size  # block 1: block 0 is vLLM's null block
    matches = {(half, order): True for half in Half for order in Order}
    for code in _codes(heads, block_size, head_size, cache.dtype):
        scratch.zero_()
        tokens = code.transpose(0, 1).contiguous()  # [block_size, heads, head_size]
        write(tokens, scratch, slots)
        if scratch[0].any():
            return {half: None for half in Half}
        for half, order in matches:
            if not packable(order, block_size, head_size):
                matches[half, order] = False
                continue
            written = per_token(cpu_attn_half(scratch, half, order), order)[1].transpose(0, 1)  # [heads, B, D]
            matches[half, order] &= torch.equal(written, code)
    return {half: next((o for o in Order if matches[half, o]), None) for half in Half}


def probe_latent(layer: Any, cache: torch.Tensor) -> bool:
    """True when a CPU_MLA layer's cache write puts token t's latent row (compressed KV, then the
    rotary key) at row t of its block."""
    _, block_size, width = cache.shape
    scratch = torch.zeros(2, block_size, width, dtype=cache.dtype)
    code = (torch.arange(block_size) + 1).to(cache.dtype)[:, None].expand(block_size, width).contiguous()
    slots = torch.arange(block_size, dtype=torch.int64) + block_size
    rank = layer.kv_lora_rank
    layer.impl.do_kv_cache_update(code[:, :rank], code[:, None, rank:], scratch, slots, "auto", layer._k_scale)
    return torch.equal(scratch[1], code) and not scratch[0].any()


def half_views(caches: list[torch.Tensor], orders: dict[Half, Order]) -> dict[Half, SlotBytes]:
    """Per half, the views of these CPU_ATTN layer caches, layer by layer (one per KV head)."""
    out = {}
    for half, order in orders.items():
        parts = [slot_bytes(cpu_attn_half(cache, half, order), slot_axes(order)) for cache in caches]
        out[half] = SlotBytes([v for p in parts for v in p.views], all(p.readable for p in parts))
    return out


# vLLM's CUDA caches (FLASH_ATTN, FLASHINFER) ------------------------------------------------------

def _pair_view(cache: torch.Tensor, shape: str, heads: int, head_size: int) -> torch.Tensor | None:
    """`cache` read as ``[num_blocks, block_size, heads, 2 (K, V), head_size]`` under the logical
    shape `shape` (a key of PAGED_SHAPES), or None when its shape is not that one."""
    c, d = cache, head_size
    if shape == "blocks, heads, block_size, 2 * head_size":  # vLLM 0.26: FlashAttention, FlashInfer
        ok = c.dim() == 4 and c.shape[1] == heads and c.shape[3] == 2 * d
        return c.unflatten(-1, (2, d)).permute(0, 2, 1, 3, 4) if ok else None
    if shape == "blocks, 2, block_size, heads, head_size":  # FlashInfer NHD, earlier releases
        ok = c.dim() == 5 and c.shape[1] == 2 and c.shape[3] == heads and c.shape[4] == d
        return c.permute(0, 2, 3, 1, 4) if ok else None
    if shape == "blocks, 2, heads, block_size, head_size":  # FlashInfer HND, earlier releases
        ok = c.dim() == 5 and c.shape[1] == 2 and c.shape[2] == heads and c.shape[4] == d
        return c.permute(0, 3, 2, 1, 4) if ok else None
    if shape == "2, blocks, block_size, heads, head_size":  # FlashAttention, earlier releases
        ok = c.dim() == 5 and c.shape[0] == 2 and c.shape[3] == heads and c.shape[4] == d
        return c.permute(1, 2, 3, 0, 4) if ok else None
    raise ValueError(f"unknown paged KV shape {shape!r}")


# Logical cache shape -> the axis of its blocks
PAGED_SHAPES = {"blocks, heads, block_size, 2 * head_size": 0, "blocks, 2, block_size, heads, head_size": 0,
                "blocks, 2, heads, block_size, head_size": 0, "2, blocks, block_size, heads, head_size": 1}


class PagedLayout(NamedTuple):
    """Where a CUDA backend's cache write puts a layer's K and V. shape: the logical shape (a key
    of PAGED_SHAPES). pair: each slot holds a head's K and V side by side, in runs the fingerprint
    cannot read half by half (vLLM 0.26's ``[blocks, heads, block_size, 2 * head_size]``): the
    canary guards the pair as one half (K, ``[num_blocks, block_size, heads, 2, head_size]``);
    else K and V are halves of their own (``[num_blocks, block_size, heads, head_size]`` each)."""

    shape: str
    pair: bool

    def features(self, cache: torch.Tensor, heads: int, head_size: int) -> dict[Half, torch.Tensor]:
        """Per half the canary guards, `cache` as ``[num_blocks, block_size, *features]``."""
        pair = _pair_view(cache, self.shape, heads, head_size)
        assert pair is not None, f"a cache of shape {tuple(cache.shape)} is not {self.shape}"
        return {Half.K: pair} if self.pair else {Half.K: pair[:, :, :, 0], Half.V: pair[:, :, :, 1]}

    def token_features(self, key: torch.Tensor, value: torch.Tensor) -> dict[Half, torch.Tensor]:
        """What a cache write handed (``key`` / ``value`` ``[tokens, heads, head_size]``) as the
        features `features` gives a slot, per half."""
        return {Half.K: torch.stack([key, value], dim=2)} if self.pair else {Half.K: key, Half.V: value}

    def views(self, cache: torch.Tensor, heads: int, head_size: int
              ) -> dict[Half, list[tuple[tuple[int, ...], torch.Tensor, bool]]]:
        """Per half, the fingerprint's views of one layer (`split_views`: path, view, readable)."""
        return {half: split_views(f) for half, f in self.features(cache, heads, head_size).items()}


def _scratch(cache: torch.Tensor, block_axis: int, blocks: int) -> torch.Tensor:
    """A zeroed cache like `cache` with `blocks` blocks, its axes in the same memory order."""
    order = sorted(range(cache.dim()), key=lambda i: -cache.stride(i))
    shape = [blocks if i == block_axis else cache.shape[i] for i in order]
    inverse = [order.index(i) for i in range(cache.dim())]
    return torch.zeros(shape, dtype=cache.dtype, device=cache.device).permute(inverse)


def probe_paged(layer: Any, cache: torch.Tensor, heads: int, head_size: int) -> PagedLayout:
    """How a FLASH_ATTN or FLASHINFER layer's cache write (``impl.do_kv_cache_update(layer, key,
    value, kv_cache, slot_mapping)``) lays out K and V: coded tokens written through it into a
    scratch cache (block 1; block 0 is vLLM's null block) and matched against PAGED_SHAPES.
    Raises NotImplementedError naming the cache's shape, strides and what was seen when none
    matches."""
    matched = None
    for shape, block_axis in PAGED_SHAPES.items():
        view = _pair_view(cache, shape, heads, head_size)
        if view is None:
            continue
        block_size = view.shape[1]
        scratch = _scratch(cache, block_axis, 2)
        slots = torch.arange(block_size, dtype=torch.int64, device=cache.device) + block_size
        written = _pair_view(scratch, shape, heads, head_size)
        ok = True
        for code in _codes(heads, block_size, head_size, cache.dtype):
            tokens = code.transpose(0, 1).contiguous().to(cache.device)  # [block_size, heads, head_size]
            for half in (0, 1):
                scratch.zero_()
                kv = [torch.zeros_like(tokens), torch.zeros_like(tokens)]
                kv[half] = tokens
                layer.impl.do_kv_cache_update(layer, kv[0], kv[1], scratch, slots)
                landed = written[1, :, :, half].transpose(0, 1).cpu()  # [heads, block_size, head_size]
                others = int(torch.count_nonzero(scratch)) - int(torch.count_nonzero(landed))
                ok &= torch.equal(landed, code) and others == 0
        if ok:
            matched = shape
            break
    if matched is None:
        raise NotImplementedError(
            f"the cache write of {type(layer.impl).__name__} does not store K and V as any layout the adapter knows "
            f"({', '.join(PAGED_SHAPES)}): cache shape {tuple(cache.shape)}, strides {cache.stride()}, "
            f"{heads} KV heads x {head_size}, dtype {cache.dtype}")

    def readable(layout: PagedLayout) -> bool:
        return all(ok for views in layout.views(cache, heads, head_size).values() for _, _, ok in views)

    halves, pair = PagedLayout(matched, pair=False), PagedLayout(matched, pair=True)
    return pair if not readable(halves) and readable(pair) else halves
