"""Where a slot's K and V bytes lie in vLLM's CPU caches, found by asking vLLM.

vLLM's CPU attention backend (CPU_ATTN) keeps each layer as ``[num_blocks, kv_heads, block_size,
2 * head_size]``, used as ``[num_blocks, kv_heads, 2 * block_size, head_size]``: per head, the
first block_size rows hold K, the next hold V. Inside those rows the order depends on the
instruction set the backend picked (on its portable paths K is stored transposed, one row per
head dimension, while V is one row per token). Its latent backend (CPU_MLA) keeps one row per
token, ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (registered with a head axis of 1).

So nothing is assumed: each probe writes coded tokens through the layer's own cache write into a
scratch cache and reads back whether token t is exactly row t (of its head's half). A half that is
gets views ``[num_blocks, block_size, width]`` (slot s at ``[s // block_size, s % block_size]``,
contiguous per block) the fingerprint can read; a half that is not gets the same addressing as a
strided view the fingerprint must not read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvcanary_kernels.records import Half


class HalfViews(NamedTuple):
    """One half's per-(layer, head) views, in layer-major order, and whether each token's bytes
    are one contiguous run in them."""

    views: list[torch.Tensor]
    token_major: bool


def _code(block_size: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Row t holds t + 1 everywhere (exact in every float type for blocks up to 255 tokens)."""
    return (torch.arange(block_size) + 1).to(dtype)[:, None].expand(block_size, width).contiguous()


def probe(layer: Any, cache: torch.Tensor) -> dict[Half, bool]:
    """Per half of a CPU_ATTN layer: True when its cache write puts token t of each head at row t
    of that head's half, as one contiguous run of head_size elements."""
    _, heads, block_size, two_d = cache.shape
    head_size = two_d // 2
    scratch = torch.zeros(2, heads, block_size, two_d, dtype=cache.dtype)
    rows = scratch.view(2, heads, 2 * block_size, head_size)
    slots = torch.arange(block_size, dtype=torch.int64) + block_size  # block 1: block 0 is vLLM's null block
    code = _code(block_size, head_size, cache.dtype)
    token_major = {Half.K: True, Half.V: True}
    for head in range(heads):
        scratch.zero_()
        tokens = torch.zeros(block_size, heads, head_size, dtype=cache.dtype)
        tokens[:, head] = code
        layer.impl.do_kv_cache_update(layer, tokens, tokens, scratch, slots)
        for half, offset in ((Half.K, 0), (Half.V, block_size)):
            written = rows[1, :, offset:offset + block_size]
            others = torch.cat([written[:head], written[head + 1:]])
            if not (torch.equal(written[head], code) and not others.any()):
                token_major[half] = False
    return token_major


def probe_latent(layer: Any, cache: torch.Tensor) -> bool:
    """True when a CPU_MLA layer's cache write puts token t's latent row (compressed KV, then the
    rotary key) at row t of its block."""
    _, block_size, width = cache.shape
    scratch = torch.zeros(2, block_size, width, dtype=cache.dtype)
    code = _code(block_size, width, cache.dtype)
    slots = torch.arange(block_size, dtype=torch.int64) + block_size
    rank = layer.kv_lora_rank
    layer.impl.do_kv_cache_update(code[:, :rank], code[:, None, rank:], scratch, slots, "auto", layer._k_scale)
    return torch.equal(scratch[1], code) and not scratch[0].any()


def half_views(caches: list[torch.Tensor], token_major: dict[Half, bool]) -> dict[Half, HalfViews]:
    """Per half, one view per (layer, head) of these CPU_ATTN layer caches: ``[num_blocks,
    block_size, head_size]``, element [b, t, d] = dimension d of the token in slot b * block_size + t."""
    out = {}
    for half, offset in ((Half.K, 0), (Half.V, 1)):
        views = []
        for cache in caches:
            blocks, heads, block_size, two_d = cache.shape
            rows = cache.view(blocks, heads, 2, block_size * (two_d // 2))[:, :, offset]
            for head in range(heads):
                if token_major[half]:
                    views.append(rows[:, head].view(blocks, block_size, two_d // 2))
                else:  # one row per head dimension: [b, d, t] -> [b, t, d]
                    views.append(rows[:, head].view(blocks, two_d // 2, block_size).transpose(1, 2))
        out[half] = HalfViews(views, token_major[half])
    return out
