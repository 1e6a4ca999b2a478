"""Write-through for vLLM's CPU attention and its CPU MLA cache: what each layer's cache write was
handed, reported to the canary in the view's token order, so TAIL checks that every written slot
holds exactly it.

vLLM writes a layer's cache through its impl's ``do_kv_cache_update``:

- CPU_ATTN: ``(layer, key, value, kv_cache, slot_mapping)``, ``key`` / ``value`` ``[tokens,
  kv_heads, head_size]``; reported per KV head (K and V).
- CPU_MLA: ``(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)``,
  ``kv_c_normed`` ``[tokens, kv_lora_rank]``, ``k_pe`` ``[tokens, 1, rope_dim]``; the row it
  stores for a token is the two concatenated in the cache's dtype, reported as the latent pool's
  single half (K).

Both take tokens in the order of vLLM's input batch, ``slot_mapping`` the slot of each (-1 for
padding). The view lists the slots it writes in its own order (a row may also count slots another
row of the step computes), so each view token takes the row of vLLM's token with its slot. A write
that lands elsewhere than its slot leaves the slot holding something other than what is reported
here, and TAIL says so.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvcanary_kernels.records import GroupKind, Half

# Called with (kind, index into the group's k_layers or v_layers, K rows, V rows): None for a half
# this call does not report.
Report = Callable[[GroupKind, int, "torch.Tensor | None", "torch.Tensor | None"], None]


class WriteThrough:
    """Wraps the cache write of CPU_ATTN and CPU_MLA layers; `written_slots` is set per forward
    (None: report nothing)."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.written_slots: torch.Tensor | None = None  # the view's written slots, in view token order
        self._index: torch.Tensor | None = None  # per view token: its row in vLLM's batch this forward

    def start_forward(self, written_slots: torch.Tensor) -> None:
        self.written_slots = written_slots
        self._index = None

    def end_forward(self) -> None:
        self.written_slots = self._index = None

    def wrap(self, layer: Any, kind: GroupKind, first_index: int, parts: dict[Half, int]) -> None:
        """Report this CPU_ATTN layer's writes as group `kind`'s layers: head h's K or V, in
        ``parts[half]`` equal parts of its dimensions (one per view of that head), as layers
        ``(first_index + h) * parts[half] + j`` of that half."""
        impl = layer.impl
        write = impl.do_kv_cache_update

        def do_kv_cache_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> None:
            write(layer, key, value, kv_cache, slot_mapping)
            if (index := self._rows(slot_mapping)) is None:
                return
            for head in range(key.shape[1]):
                for half, rows in ((Half.K, key), (Half.V, value)):
                    n = parts[half]
                    for j, chunk in enumerate(rows[index, head].chunk(n, dim=-1)):
                        k, v = (chunk.contiguous(), None) if half is Half.K else (None, chunk.contiguous())
                        self.report(kind, (first_index + head) * n + j, k, v)

        impl.do_kv_cache_update = do_kv_cache_update

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

        impl.do_kv_cache_update = do_kv_cache_update

    def _rows(self, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Per view token, its row in this write's batch; None when there is nothing to report."""
        if self.written_slots is None:
            return None
        index = self._batch_rows(slot_mapping.flatten())
        return index if index.numel() else None

    def _batch_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        if self._index is None:
            assert self.written_slots is not None
            slots = slot_mapping.to(torch.int64)
            if slots.numel() == 0:  # this forward writes no slot through this layer: no rows
                self._index = slots
                return self._index
            order = torch.argsort(slots)
            at = torch.searchsorted(slots[order], self.written_slots).clamp(max=slots.numel() - 1)
            index = order[at]
            # A forward that writes other slots than the view says (an engine bug the view's own
            # checks report at the slots) reports no rows through here: nothing to match them to.
            self._index = index if torch.equal(slots[index], self.written_slots) else index[:0]
        return self._index
