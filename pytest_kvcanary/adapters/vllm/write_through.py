"""Write-through for vLLM's CPU attention, its CPU MLA cache and its CUDA FlashAttention and
FlashInfer caches: what each layer's cache write was
handed, reported to the canary in the view's token order, so TAIL checks that every written slot
holds exactly it.

vLLM writes a layer's cache through its impl's ``do_kv_cache_update``:

- CPU_ATTN: ``(layer, key, value, kv_cache, slot_mapping)``, ``key`` / ``value`` ``[tokens,
  kv_heads, head_size]``; reported per KV head (K and V).
- CPU_MLA: ``(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)``,
  ``kv_c_normed`` ``[tokens, kv_lora_rank]``, ``k_pe`` ``[tokens, 1, rope_dim]``; the row it
  stores for a token is the two concatenated in the cache's dtype, reported as the latent pool's
  single half (K).
- FLASH_ATTN, FLASHINFER (CUDA): as CPU_ATTN's, key / value padded to the batch's padded token
  count (CUDA graphs); reported in the layout's halves and views (layout.PagedLayout).

All take tokens in the order of vLLM's input batch, ``slot_mapping`` the slot of each (-1 for
padding). The engine hands over, per forward, each view token's row in that batch: the identity
where the view lists the tokens the forward consumed as they are; a row that also counts slots
another row of the step computes takes those from the row that computed them (`rows_by_slot`). A
write that lands elsewhere than the slot the block table gives leaves that slot holding something
other than what is reported here, and TAIL says so.

Each wrap replaces the impl's ``do_kv_cache_update`` through a Patches record (../patches.py: the
engine's), so that closing the engine puts vLLM's own method back.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pytest_kvcanary.canary.seam import GroupKind, Half

from ..patches import Patches

# Called with (kind, index into the group's k_layers or v_layers, K rows, V rows): None for a half
# this call does not report.
Report = Callable[[GroupKind, int, "torch.Tensor | None", "torch.Tensor | None"], None]
# What a cache stores for the K/V rows a write is handed ([tokens, kv_heads, head_size] each).
Stored = Callable[["torch.Tensor", "torch.Tensor"], "tuple[torch.Tensor, torch.Tensor]"]


class WriteThrough:
    """Wraps the cache write of CPU_ATTN, CPU_MLA, FLASH_ATTN and FLASHINFER layers, recording each
    wrap in `patches` (the engine's; a record of its own when None); `index` is set per forward
    (None: report nothing)."""

    def __init__(self, report: Report, patches: Patches | None = None) -> None:
        self.report = report
        self.patches = patches if patches is not None else Patches()
        self.index: torch.Tensor | None = None  # per view token: its row in vLLM's batch this forward

    def start_forward(self, index: torch.Tensor | None) -> None:
        self.index = index

    def end_forward(self) -> None:
        self.index = None

    def wrap(self, layer: Any, kind: GroupKind, first_index: int, parts: dict[Half, int],
             stored: Stored | None = None) -> None:
        """Report this CPU_ATTN layer's writes as group `kind`'s layers: head h's K or V, in
        ``parts[half]`` equal parts of its dimensions (one per view of that head), as layers
        ``(first_index + h) * parts[half] + j`` of that half. stored: what the cache holds for the
        K/V handed (an FP8 cache's bytes, fp8_cache.stored_rows); None: the K/V as handed."""
        impl = layer.impl
        write = impl.do_kv_cache_update

        def do_kv_cache_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> None:
            write(layer, key, value, kv_cache, slot_mapping)
            if (index := self._rows(slot_mapping)) is None:
                return
            if stored is not None:
                key, value = stored(key, value)
            for head in range(key.shape[1]):
                for half, rows in ((Half.K, key), (Half.V, value)):
                    n = parts[half]
                    for j, chunk in enumerate(rows[index, head].chunk(n, dim=-1)):
                        k, v = (chunk, None) if half is Half.K else (None, chunk)
                        self.report(kind, (first_index + head) * n + j, k, v)

        self.patches.replace(impl, "do_kv_cache_update", do_kv_cache_update)

    def wrap_paged(self, layer: Any, kind: GroupKind, layout: Any, paths: dict[Half, list[tuple[int, ...]]],
                   first: dict[Half, int]) -> None:
        """Report this FLASH_ATTN / FLASHINFER layer's writes (``do_kv_cache_update(layer, key,
        value, kv_cache, slot_mapping)``, key / value padded to the batch's padded token count) as
        group `kind`'s layers: per half of `layout` (layout.PagedLayout), the view with path
        ``paths[half][j]`` as layer ``first[half] + j`` of that half."""
        impl = layer.impl
        write = impl.do_kv_cache_update

        def do_kv_cache_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            stored = write(layer, key, value, kv_cache, slot_mapping, *args, **kwargs)
            if (index := self._rows(slot_mapping)) is None:
                return stored
            for half, rows in layout.token_features(key[index], value[index]).items():
                rows = rows.to(kv_cache.dtype)
                for j, path in enumerate(paths[half]):
                    run = rows[(slice(None), *path)].reshape(rows.shape[0], -1)
                    k, v = (run, None) if half is Half.K else (None, run)
                    self.report(kind, first[half] + j, k, v)
            return stored

        self.patches.replace(impl, "do_kv_cache_update", do_kv_cache_update)

    def wrap_latent(self, layer: Any, kind: GroupKind, index: int) -> None:
        """Report this CPU_MLA layer's writes as group `kind`'s layer `index` (its latent rows)."""
        impl = layer.impl
        write = impl.do_kv_cache_update

        def do_kv_cache_update(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            stored = write(kv_c_normed, k_pe, kv_cache, slot_mapping, *args, **kwargs)
            if (rows := self._rows(slot_mapping)) is not None:
                latent = torch.cat([kv_c_normed[rows], k_pe[rows].flatten(1)], dim=-1).to(kv_cache.dtype)
                self.report(kind, index, latent, None)
            return stored

        self.patches.replace(impl, "do_kv_cache_update", do_kv_cache_update)

    def _rows(self, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Per view token, its row in this write's batch; None when there is nothing to report
        (no index this forward, or a layer that writes no slot)."""
        return None if self.index is None or slot_mapping.numel() == 0 else self.index


def rows_by_slot(slot_mapping: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """Per slot of `slots`, the row of vLLM's batch whose token ``slot_mapping`` stores there;
    None when one of them has no such row (the forward wrote other slots)."""
    written = slot_mapping.to(torch.int64)
    if written.numel() == 0:
        return None
    order = torch.argsort(written)
    at = torch.searchsorted(written[order], slots).clamp(max=written.numel() - 1)
    index = order[at]
    return index if torch.equal(written[index], slots) else None
