"""Write-through for vLLM's CPU attention: what each layer's cache write was handed, reported to
the canary in the view's token order, so TAIL checks that every written slot holds exactly it.

vLLM writes a layer's K/V through ``impl.do_kv_cache_update(layer, key, value, kv_cache,
slot_mapping)`` (CPU_ATTN): ``key`` / ``value`` ``[tokens, kv_heads, head_size]`` in the order of
vLLM's input batch, ``slot_mapping`` the slot of each. The view lists the slots it writes in its
own order (a row may also count slots another row of the step computes), so each view token takes
the row of vLLM's token with its slot. A write that lands elsewhere than its slot leaves the slot
holding something other than what is reported here, and TAIL says so.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvcanary_kernels.records import GroupKind

# Called with (kind, index into the group's k_layers, K rows, V rows).
Report = Callable[[GroupKind, int, torch.Tensor, torch.Tensor], None]


class WriteThrough:
    """Wraps the cache write of CPU_ATTN layers; `written_slots` is set per forward (None: report
    nothing)."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.written_slots: torch.Tensor | None = None  # the view's written slots, in view token order
        self._index: torch.Tensor | None = None  # per view token: its row in vLLM's batch this forward

    def start_forward(self, written_slots: torch.Tensor) -> None:
        self.written_slots = written_slots
        self._index = None

    def end_forward(self) -> None:
        self.written_slots = self._index = None

    def wrap(self, layer: Any, kind: GroupKind, first_index: int) -> None:
        """Report this layer's writes as group `kind`'s layers first_index + head."""
        impl = layer.impl
        write = impl.do_kv_cache_update

        def do_kv_cache_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> None:
            write(layer, key, value, kv_cache, slot_mapping)
            if self.written_slots is None:
                return
            index = self._batch_rows(slot_mapping)
            if index.numel() == 0:
                return
            for head in range(key.shape[1]):
                self.report(kind, first_index + head, key[index, head].contiguous(), value[index, head].contiguous())

        impl.do_kv_cache_update = do_kv_cache_update

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
