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
from typing import Any, NamedTuple

import torch

from kvcanary_kernels.records import Half
from kvcanary_kernels.sources import strided_read


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
    block_size = math.prod(half.shape[1:1 + slot_dims])
    if half[0].is_contiguous():
        runs = half.reshape(half.shape[0], block_size, -1)
        return SlotBytes([runs], runs.shape[2] * runs.element_size() % 16 == 0)
    readable = strided_read(half, block_size) is not None
    if readable or half.dim() == 2 + slot_dims:
        return SlotBytes([half], readable)
    parts = [slot_bytes(half.select(1 + slot_dims, i), slot_dims) for i in range(half.shape[1 + slot_dims])]
    return SlotBytes([v for p in parts for v in p.views], all(p.readable for p in parts))


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


def probe(layer: Any, cache: torch.Tensor) -> dict[Half, Order | None]:
    """Per half of a CPU_ATTN layer: the order its cache write keeps (None: neither)."""
    _, heads, block_size, two_d = cache.shape
    head_size = two_d // 2
    scratch = torch.zeros(2, heads, block_size, two_d, dtype=cache.dtype)
    slots = torch.arange(block_size, dtype=torch.int64) + block_size  # block 1: block 0 is vLLM's null block
    matches = {(half, order): True for half in Half for order in Order}
    for code in _codes(heads, block_size, head_size, cache.dtype):
        scratch.zero_()
        tokens = code.transpose(0, 1).contiguous()  # [block_size, heads, head_size]
        layer.impl.do_kv_cache_update(layer, tokens, tokens, scratch, slots)
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
