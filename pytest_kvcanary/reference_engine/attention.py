"""Attention over K/V: one masked-softmax core and two ways to feed it (no cache, paged pools).

The model calls ``kv(layer, q, k, v, window)`` with the new tokens' q [T, H, D] and k, v
[T, KVH, D] (RoPE applied) and gets the attention output [T, H, D] back. A latent (mla) layer
passes v None: its values are its keys (one latent row per token, k [T, 1, latent_dim]), and it
stores only those. Where the pools store another dtype than the model's (kv_quant.py), K/V go in
and come out through a `KVCodec`, FP8 and FP4 through the layer's scales the forward is handed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from kvcanary_kernels.inputs import ScaleInputs
from kvcanary_kernels.records import GroupKind

from .kv_pool import KVPools, token_slots
from .kv_quant import KVCodec

KVAccess = Callable[[int, torch.Tensor, torch.Tensor, "torch.Tensor | None", "int | None"], torch.Tensor]
# Told, at each layer's KV-store point, the pool group, the layer's index in it and the K and V rows
# just computed for the batch's tokens, as stored (V None for a latent layer; a canary's write-through).
KVStoreListener = Callable[[GroupKind, int, torch.Tensor, "torch.Tensor | None"], None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window: int | None) -> torch.Tensor:
    """Causal GQA attention: query i sees key j iff k_pos[j] <= q_pos[i] and, for a windowed
    layer, q_pos[i] - k_pos[j] <= window. v None: the values are the keys (a latent layer)."""
    v = k if v is None else v
    delta = q_pos[:, None] - k_pos[None, :]
    mask = delta >= 0
    if window is not None:
        mask &= delta <= window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def layer_scales(scales: ScaleInputs | None, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Layer ``layer``'s K and V scales ``[W]`` (None: not quantized, or a latent layer's V)."""
    if scales is None:
        return None, None
    return scales.k[layer], None if scales.v is None else scales.v[layer]


class DenseKV:
    """No cache: one whole sequence attends to its own K/V, as they read back once stored (codec,
    scales: the pools'; codec None: as computed). The reference the paged path matches."""

    def __init__(self, positions: torch.Tensor, codec: KVCodec | None = None,
                 scales: ScaleInputs | None = None) -> None:
        self.positions, self.codec, self.scales = positions, codec, scales

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 window: int | None) -> torch.Tensor:
        if self.codec is not None:
            k_scale, v_scale = layer_scales(self.scales, layer)
            k = self.codec.round_trip(k, k_scale)
            v = None if v is None else self.codec.round_trip(v, v_scale)
        return attend(q, k, v, self.positions, self.positions, window)


class PagedKV:
    """One forward batch over the paged pools. Each layer first writes the new tokens' K/V into
    their slots (out_cache_loc, through the SWA map for windowed layers), then each request
    attends to the K/V gathered through its req_to_token row (in pages of pools.page_size):
    positions [0, prefix + extend), or [prefix - window, prefix + extend) for a windowed layer.
    codec (None: the pools store the model's dtype) stores and reads K/V back, FP8 and FP4 through
    the layer's row of ``scales``, the scales this forward is handed (its view's). Nothing is checked
    here: a wrong mapping, a stale slot or a wrong scale silently reads wrong K/V, which is what the
    canary is for."""

    def __init__(self, pools: KVPools, req_to_token: torch.Tensor, rows: Sequence[int],
                 prefix_lens: Sequence[int], extend_lens: Sequence[int], positions: torch.Tensor,
                 out_cache_loc: torch.Tensor, on_store: KVStoreListener | None = None, *,
                 codec: KVCodec | None = None, scales: ScaleInputs | None = None) -> None:
        self.pools, self.table = pools, req_to_token
        self.seqs = list(zip(rows, prefix_lens, extend_lens))
        self.positions, self.out_cache_loc = positions, out_cache_loc
        self.on_store = on_store
        self.codec, self.scales = codec, scales

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 window: int | None) -> torch.Tensor:
        buf = self.pools.layer(layer)
        loc = self.out_cache_loc if buf.slot_map is None else buf.slot_map[self.out_cache_loc]
        k_scale, v_scale = layer_scales(self.scales, layer)
        if self.codec is not None:
            k, v = self.codec.store(k, k_scale), None if v is None else self.codec.store(v, v_scale)
        buf.k[loc] = k
        if buf.v is not None:
            buf.v[loc] = v
        if self.on_store is not None:
            self.on_store(buf.group, buf.index, k, v)
        outs, t = [], 0
        for row, prefix, extend in self.seqs:
            start, end = (0 if window is None else max(0, prefix - window)), prefix + extend
            slots = token_slots(self.table[row], self.pools.page_size, start, end)
            if buf.slot_map is not None:
                slots = buf.slot_map[slots]
            k_pos = torch.arange(start, end, device=q.device)
            keys, values = buf.k[slots], None if buf.v is None else buf.v[slots]
            if self.codec is not None:
                keys = self.codec.load(keys, k_scale)
                values = None if values is None else self.codec.load(values, v_scale)
            outs.append(attend(q[t:t + extend], keys, values, self.positions[t:t + extend], k_pos, window))
            t += extend
        return torch.cat(outs)
