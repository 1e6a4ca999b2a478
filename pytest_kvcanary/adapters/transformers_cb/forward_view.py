"""The canary's ForwardView of a transformers forward, derived on the device from the static input
buffers transformers fills for that forward and hands to it (``ContinuousBatchingIOs``):

    extend_lens[r]  cu_seq_lens_q[r + 1] - cu_seq_lens_q[r]               (the row's query tokens)
    prefix_lens[r]  cu_seq_lens_k["full_attention"] difference - extend    (the cached tokens it reads)
    input_ids       the input ids the forward embedded
    positions       the position ids its rotary embedding used

With async batching transformers keeps two sets of these buffers (one per IO pair) and
alternates; the engine derives the view from the set the forward at hand consumes (one
DerivedView per set, all filling the same view).

Rows at or past the batch size (uploaded by the host) are padding: prefix 0, extend 0 (transformers
leaves stale cumulative lengths there). Positions are never derived from the lengths nor the
lengths from the positions, so TAIL's write_position compares two things the forward consumed: the
position its RoPE used and the slot its KV store wrote. Everything here is fixed-shape device work
on persistent buffers (capturable in a CUDA graph); the buffers are refilled in place.
"""

from __future__ import annotations

from typing import Any

import torch

from ...canary.host import Capacities, ForwardView
from .versions import FULL_ATTENTION, UnsupportedModel


def empty_view(capacities: Capacities, lanes: torch.Tensor, token_table: torch.Tensor) -> ForwardView:
    """The view's persistent buffers (zeros), on the token table's device; its rows are `lanes`
    (each batch row's mapping row, staged by the host)."""
    b, t, device = capacities.max_batch, capacities.max_tokens, token_table.device
    lens = torch.zeros(2, b, dtype=torch.int64, device=device)
    return ForwardView(rows=lanes, prefix_lens=lens[0],
                       extend_lens=lens[1], input_ids=torch.zeros(t, dtype=torch.int64, device=device),
                       positions=torch.zeros(t, dtype=torch.int64, device=device), token_table=token_table)


class DerivedView:
    """Refills `view` by ``derive_lengths`` (before HEAD) and ``copy_inputs`` (after the forward,
    before TAIL: the inputs as the forward left them) from one set of transformers' IO buffers."""

    def __init__(self, io: Any, capacities: Capacities, batch: torch.Tensor, view: ForwardView) -> None:
        b, t = capacities.max_batch, capacities.max_tokens
        self.cu_q = io.cumulative_seqlens_q[:b + 1]
        self.cu_k = io.cumulative_seqlens_k[FULL_ATTENTION][:b + 1]
        self.input_ids, self.position_ids = io.input_ids[:t], io.position_ids[:t]
        if self.cu_q.shape[0] != b + 1 or self.input_ids.shape[0] != t:
            raise UnsupportedModel(f"transformers' static inputs hold {self.cu_q.shape[0] - 1} rows and "
                                   f"{self.input_ids.shape[0]} tokens; the canary was sized for {b} and {t}")
        self.batch = batch
        self.view = view
        self._row_numbers = torch.arange(b, dtype=torch.int64, device=batch.device)

    def derive_lengths(self) -> None:
        live = self._row_numbers < self.batch
        extend = torch.diff(self.cu_q) * live
        self.view.extend_lens.copy_(extend)
        self.view.prefix_lens.copy_(torch.diff(self.cu_k) * live - extend)

    def copy_inputs(self) -> None:
        self.view.input_ids.copy_(self.input_ids)
        self.view.positions.copy_(self.position_ids)
