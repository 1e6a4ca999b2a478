"""Sparse attention, DeepSeek-V3.2-style (NSA/DSA): each layer's indexer keeps a small key per token
beside the latent KV and selects the tokens each query attends to.

A layer's indexer projects each token's input embedding (the first layer's input, not the layer's
own hidden state as DeepSeek's does: a selection is then a function of the tokens alone, so the
cached path and the no-cache recomputation select the same tokens bit for bit) to a key of
index_head_dim and, per index head, a query and a weight. Keys are stored in FP8 (e4m3) with a
float32 scale per token (amax / 448; kv_quant's codec), as one row of bytes per slot of the FULL
pool, at the same slot as the token's latent row: the scale's 4 bytes, the codes, zeros up to a
multiple of 16 (so a partial fingerprint reads the scale). Queries are quantized the same way, per
token and head. The score of query token p for visible position j <= p is
``sum_h w_h * relu(q_h . k_j)``: with both sides FP8 codes times scales, each ``q_h . k_j`` is an
exact sum of exact products in float64, and the heads are summed in a fixed order, so equal inputs
give equal scores whatever the batch. The index_topk highest scores are selected (ties: the lower
position first); a query that sees <= index_topk tokens selects them all. The layer's attention
then reads the latent rows of the selected tokens only.

`PagedSparseKV` runs a forward over the pools: it writes the new tokens' latent rows and index
keys, selects through the keys the cache holds, fills the view's `SelectedInputs` (the positions and
the FULL slots it will read), tells the hooks (`indices_selected`: the canary's SELECT check) and
attends over the slots in it. `DenseSparseKV` is the no-cache recomputation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn
import torch.nn.functional as F

from kvcanary_kernels.inputs import SelectedInputs
from kvcanary_kernels.records import GroupKind

from .config import INDEX_SCALE_BYTES as SCALE_BYTES, ModelConfig, index_row_bytes
from .kv_pool import KVPools, token_slots
from .kv_quant import KVCodec

if TYPE_CHECKING:
    from pytest_kvcanary.canary.seam import ForwardHooks, ForwardView

    from .scheduler import Batch

E4M3 = torch.float8_e4m3fn
_CODEC = KVCodec(E4M3, torch.float64, scaled=True)
_MAX = torch.finfo(E4M3).max


def empty_selection(tokens: int, topk: int, device: torch.device) -> SelectedInputs:
    """A forward's selection buffers, ``[tokens, topk]``: no position selected yet (-1), slot 0."""
    return SelectedInputs(torch.full((tokens, topk), -1, dtype=torch.int64, device=device),
                          torch.zeros((tokens, topk), dtype=torch.int64, device=device))


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., dim]`` as FP8 codes and a float32 scale per row (amax / 448, kv_quant's codec)."""
    scale = (rows.float().abs().amax(-1) / _MAX).clamp(min=torch.finfo(torch.float32).tiny)
    flat = rows.reshape(-1, rows.shape[-1])
    return _CODEC.store(flat, scale.reshape(-1)).view(rows.shape), scale


def pack(keys: torch.Tensor) -> torch.Tensor:
    """Index keys ``[T, dim]`` as the stored rows, uint8 ``[T, index_row_bytes(dim)]``."""
    codes, scale = quantize(keys)
    pad = keys.new_zeros((keys.shape[0], index_row_bytes(keys.shape[1]) - SCALE_BYTES - keys.shape[1]),
                         dtype=torch.uint8)
    return torch.cat([scale[:, None].view(torch.uint8), codes.view(torch.uint8), pad], dim=-1)


def unpack(rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows back as the codes' values ``[N, dim]`` and the scales ``[N]``, in float64."""
    scale = rows[:, :SCALE_BYTES].contiguous().view(torch.float32)[:, 0]
    codes = rows[:, SCALE_BYTES:SCALE_BYTES + dim].contiguous().view(E4M3)
    return codes.double(), scale.double()


class IndexQueries(NamedTuple):
    """A forward's index queries: FP8 code values ``[T, heads, dim]`` and, per head, the head's
    weight times its query's scale ``[T, heads]`` (float64)."""

    codes: torch.Tensor
    weights: torch.Tensor


class IndexInputs(NamedTuple):
    """What a sparse layer hands its KV access besides the latent rows: the new tokens' index keys
    ``[T, dim]`` (float64, before storing) and their index queries."""

    keys: torch.Tensor
    queries: IndexQueries


class Indexer(nn.Module):
    """A layer's indexer: wq (a query per index head), wk (one key), weights_proj (a weight per
    head), over the tokens' input embeddings, computed in float64."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden, cfg.index_n_heads, bias=False)

    def forward(self, embeddings: torch.Tensor) -> IndexInputs:
        e = embeddings.double()
        q = F.linear(e, self.wq.weight.double()).view(-1, self.heads, self.dim)
        codes, scale = quantize(q)
        weights = F.linear(e, self.weights_proj.weight.double()) * self.heads ** -0.5
        return IndexInputs(F.linear(e, self.wk.weight.double()), IndexQueries(codes.double(), weights * scale.double()))


def scores(queries: IndexQueries, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[T, N]``: each query's score for each key (codes ``[N, dim]``, scales ``[N]``), float64,
    the same bits for the same inputs in any batch (exact dot products, heads summed in order)."""
    dots = torch.einsum("thd,nd->thn", queries.codes, codes).clamp(min=0)
    total = torch.zeros_like(dots[:, 0])
    for h in range(dots.shape[1]):
        total = total + queries.weights[:, h, None] * dots[:, h]
    return total * scales[None, :]


def select(queries: IndexQueries, codes: torch.Tensor, scales: torch.Tensor, q_pos: torch.Tensor,
           topk: int) -> torch.Tensor:
    """The positions ``[T, topk]`` each query (at q_pos) attends to among keys at positions 0, 1,
    ...: those of the topk highest scores it sees (key position <= its own), the lower position
    first among equal scores, in that order; -1 past the keys it sees."""
    s = scores(queries, codes, scales)
    k_pos = torch.arange(codes.shape[0], device=codes.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    s = torch.where(visible, s, -torch.inf)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.gather(visible, 1, order)
    picked = torch.where(chosen, order, -1)
    if picked.shape[1] < topk:
        picked = F.pad(picked, (0, topk - picked.shape[1]), value=-1)
    return picked


def attend_selected(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Latent attention of queries q ``[T, H, D]`` over their own selected latent rows ``keys [T,
    K, D]`` (values are the keys), entries off ``valid [T, K]`` masked out."""
    logits = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * q.shape[-1] ** -0.5
    probs = torch.softmax(logits.masked_fill(~valid[:, None, :], -torch.inf), dim=-1)
    return torch.einsum("thk,tkd->thd", probs, keys.float()).to(q.dtype)


class DenseSparseKV:
    """No cache: one whole sequence selects among its own index keys, as they read back once
    stored, and attends over its own latent rows. The reference the paged path matches."""

    def __init__(self, positions: torch.Tensor, topk: int) -> None:
        self.positions, self.topk = positions, topk

    def __call__(self, layer: int, q: torch.Tensor, latent: torch.Tensor, index: IndexInputs) -> torch.Tensor:
        codes, scales = unpack(pack(index.keys), index.keys.shape[1])
        picked = select(index.queries, codes, scales, self.positions, self.topk)
        return attend_selected(q, latent[picked.clamp(min=0)], picked >= 0)


class PagedSparseKV:
    """One forward batch over the pools (see the module docstring): each layer refills the view's
    `SelectedInputs` (``[T, topk]`` for the batch's T tokens) and, with hooks, reports its KV and
    keys (``kv_stored``) and its selection before its attention reads it (``indices_selected``).
    Nothing is checked here: a wrong slot in the selection silently reads another token's KV."""

    def __init__(self, pools: KVPools, req_to_token: torch.Tensor, batch: Batch, view: ForwardView,
                 out_cache_loc: torch.Tensor, hooks: ForwardHooks | None = None) -> None:
        self.pools, self.table = pools, req_to_token
        self.seqs = list(zip(batch.rows, batch.prefix_lens, batch.extend_lens))
        self.out_cache_loc, self.view, self.hooks = out_cache_loc, view, hooks

    def __call__(self, layer: int, q: torch.Tensor, latent: torch.Tensor, index: IndexInputs) -> torch.Tensor:
        buf, keys = self.pools.layer(layer), self.pools.indexer[layer]
        loc = self.out_cache_loc
        rows = pack(index.keys)
        buf.k[loc] = latent[:, None, :].to(buf.k.dtype)
        keys[loc] = rows
        if self.hooks is not None:
            self.hooks.kv_stored(buf.group, buf.index, latent[:, None, :], None)
            self.hooks.kv_stored(GroupKind.INDEXER, layer, rows, None)
        positions, slots = self.view.selected
        t = 0
        for row, prefix, extend in self.seqs:
            seq_slots = token_slots(self.table[row], self.pools.page_size, 0, prefix + extend)
            codes, scales = unpack(keys[seq_slots], index.keys.shape[1])
            q_pos = torch.arange(prefix, prefix + extend, device=q.device)
            picked = select(_rows(index.queries, t, extend), codes, scales, q_pos, positions.shape[1])
            positions[t:t + extend] = picked
            slots[t:t + extend] = torch.where(picked >= 0, seq_slots[picked.clamp(min=0)], 0)
            t += extend
        if self.hooks is not None:
            self.hooks.indices_selected(self.view, layer)
        return attend_selected(q, buf.k[slots, 0], positions >= 0)


def _rows(queries: IndexQueries, start: int, n: int) -> IndexQueries:
    """Queries of tokens [start, start + n)."""
    return IndexQueries(queries.codes[start:start + n], queries.weights[start:start + n])
