"""The canary's ForwardView of a transformers forward, derived on the device from the static input
buffers transformers fills for that forward and hands to it (``ContinuousBatchingIOs``):

    extend_lens[r]  cu_seq_lens_q[r + 1] - cu_seq_lens_q[r]               (the row's query tokens)
    prefix_lens[r]  cu_seq_lens_k["full_attention"] difference - extend    (the cached tokens it reads)
    input_ids       the input ids the forward embedded
    positions       the position ids its rotary embedding used

and each group's block table, for the lanes of the batch's rows, from the read and write indices
the forward hands each layer's cache update (physical cache rows, ``block * index_stride + offset``):

    FULL      every block the row reads: read_index[cu_k[r] + j * page_size] (the write index
              from cu_q[r] when the batch reads no cache: every row a fresh prefill)
    sliding   the ring page of each token the forward stores (a query's last ``ring`` tokens)
              gets the block it is written to, then the ring page of each cached position it
              reads the block it is read from (the read wins); a lane's ring persists across
              forwards

So a block table transformers re-points (de-duplication, or a bug) is seen by the forward that
reads through it, exactly as that forward does. With async batching transformers keeps two sets of
these buffers (one per IO pair) and alternates; the engine derives the view from the set the
forward at hand consumes (one DerivedView per set, all filling the same view).

Rows at or past the batch size (uploaded by the host) are padding: prefix 0, extend 0 (transformers
leaves stale cumulative lengths there). Positions are never derived from the lengths nor the
lengths from the positions, so TAIL's write_position compares two things the forward consumed: the
position its RoPE used and the slot its KV store wrote. Everything here is fixed-shape device work
on persistent buffers (capturable in a CUDA graph); the buffers are refilled in place.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Mapping, Sequence

import torch

from ...canary.seam import Capacities, ForwardView, GroupKind
from .batch_buffers import BatchBuffers
from .versions import FULL_ATTENTION, SLIDING_ATTENTION, GroupCache, UnsupportedModel


def empty_view(capacities: Capacities, lanes: torch.Tensor, token_table: torch.Tensor) -> ForwardView:
    """The view's persistent buffers (zeros), on the token table's device; its rows are `lanes`
    (each batch row's mapping row, staged by the host)."""
    b, t, device = capacities.max_batch, capacities.max_tokens, token_table.device
    lens = torch.zeros(2, b, dtype=torch.int64, device=device)
    return ForwardView(rows=lanes, prefix_lens=lens[0],
                       extend_lens=lens[1], input_ids=torch.zeros(t, dtype=torch.int64, device=device),
                       positions=torch.zeros(t, dtype=torch.int64, device=device), token_table=token_table)


def empty_tables(groups: Sequence[GroupCache], capacities: Capacities, lanes: int,
                 device: torch.device) -> dict[GroupKind, torch.Tensor]:
    """Each group's block table, zeros ``[lanes + 1, width]`` (the last row: scratch): a row holds
    the blocks of ``max_context`` positions, or of a sliding group's ring."""
    return {g.kind: torch.zeros(lanes + 1, -(-(g.ring or capacities.max_context) // g.page_size), dtype=torch.int64,
                                device=device) for g in groups}


class DerivedView:
    """Refills `view` by ``derive`` (before HEAD: lengths and block tables) and ``copy_inputs``
    (before HEAD: the inputs a forward observer sees; after the forward, before TAIL: the inputs
    as the forward left them) from one set of
    transformers' IO buffers. `tables`: per group kind, ``[lanes + 1, width]``, the last row a
    scratch row padded batch rows write to."""

    def __init__(self, io: Any, capacities: Capacities, batch: torch.Tensor, view: ForwardView,
                 groups: Sequence[GroupCache], tables: Mapping[GroupKind, torch.Tensor], fused: bool = False) -> None:
        """fused: the lengths, full-attention tables, inputs and sampled tokens by view_kernels.py's
        Triton kernels (one launch each; CUDA, or the Triton interpreter), else by the torch forms here."""
        b, t = capacities.max_batch, capacities.max_tokens
        self.cu_q = io.cumulative_seqlens_q[:b + 1]
        self.cu_k = io.cumulative_seqlens_k[FULL_ATTENTION][:b + 1]
        self.input_ids, self.position_ids = io.input_ids[:t], io.position_ids[:t]
        if self.cu_q.shape[0] != b + 1 or self.input_ids.shape[0] != t:
            raise UnsupportedModel(f"transformers' static inputs hold {self.cu_q.shape[0] - 1} rows and "
                                   f"{self.input_ids.shape[0]} tokens; the canary was sized for {b} and {t}")
        self.batch = batch
        self.view = view
        self.groups, self.tables = groups, tables
        self._scratch = tables[groups[0].kind].shape[0] - 1
        device = batch.device
        self._row_numbers = torch.arange(b, dtype=torch.int64, device=device)
        self._tokens = torch.arange(t, dtype=torch.int64, device=device)
        self._block_starts = {g.kind: torch.arange(tables[g.kind].shape[1], dtype=torch.int64, device=device) *
                              g.page_size for g in groups}
        sliding = io.cumulative_seqlens_k.get(SLIDING_ATTENTION)
        self.cu_k_sliding = None if sliding is None else sliding[:b + 1]
        self._ring = {g.kind: torch.arange(g.ring, dtype=torch.int64, device=device) for g in groups if g.ring}
        self._full = [g for g in groups if not g.ring]
        self._sliding = [g for g in groups if g.ring]
        self._kernels = import_module(".view_kernels", __package__) if fused else None  # triton, when fused

    def derive(self, read_index: Sequence[torch.Tensor], write_index: Sequence[torch.Tensor]) -> None:
        """The view's lengths, then each group's table rows of this forward's lanes from the
        indices its cache updates get (`read_index`, `write_index`: per group, in transformers'
        order)."""
        if self._kernels is not None:
            self._derive_fused(read_index, write_index)
            if not self._sliding:
                return
        live = self._row_numbers < self.batch
        lanes = torch.where(live, self.view.rows, self._scratch)
        if self._kernels is None:
            extend = torch.diff(self.cu_q) * live
            self.view.extend_lens.copy_(extend)
            self.view.prefix_lens.copy_(torch.diff(self.cu_k) * live - extend)
            for group in self._full:
                self._full_table(group, lanes, read_index[group.io_index], write_index[group.io_index])
        for group in self._sliding:
            self._sliding_table(group, live, lanes, read_index[group.io_index], write_index[group.io_index])

    def _derive_fused(self, read_index: Sequence[torch.Tensor], write_index: Sequence[torch.Tensor]) -> None:
        """derive's lengths and full-attention tables, a kernel launch a full group (one for the
        lengths alone without one)."""
        lengths = (self.cu_q, self.cu_k, self.batch, self.view.rows, self.view.prefix_lens, self.view.extend_lens)
        if not self._full:
            self._kernels.derive_full(*lengths)
        for group in self._full:
            reads, writes = read_index[group.io_index], write_index[group.io_index]
            index, starts = (reads, self.cu_k) if reads.numel() else (writes, self.cu_q)
            self._kernels.derive_full(*lengths, index, starts, self.tables[group.kind], group.page_size,
                                      group.index_stride, self._scratch)

    def _full_table(self, group: GroupCache, lanes: torch.Tensor, reads: torch.Tensor, writes: torch.Tensor) -> None:
        view, block_starts = self.view, self._block_starts[group.kind]
        index, starts = (reads, self.cu_k[:-1]) if reads.numel() else (writes, self.cu_q[:-1])
        at = (starts[:, None] + block_starts).clamp(max=index.shape[0] - 1)
        reached = block_starts < (view.prefix_lens + view.extend_lens)[:, None]
        self.tables[group.kind][lanes] = torch.where(reached, index[at].long() // group.index_stride, 0)

    def _sliding_table(self, group: GroupCache, live: torch.Tensor, lanes: torch.Tensor, reads: torch.Tensor,
                       writes: torch.Tensor) -> None:
        view, table, scratch = self.view, self.tables[group.kind], self._scratch
        ends = torch.cumsum(view.extend_lens, 0)  # cu_q past the batch is stale
        row = torch.searchsorted(ends, self._tokens, right=True).clamp(max=live.shape[0] - 1)
        extend = view.extend_lens[row]
        j = self._tokens - (ends[row] - extend)  # the token's place in its row's query
        stored = (j < extend) & (j >= extend - group.ring)
        page = (view.prefix_lens[row] + j) % group.ring // group.page_size
        blocks = writes[self._tokens.clamp(max=writes.shape[0] - 1)].long() // group.index_stride
        table.index_put_((torch.where(stored, lanes[row], scratch), torch.where(stored, page, 0)), blocks)
        if reads.numel():  # per row: its cached positions, then a sentinel per query token
            cached = torch.diff(self.cu_k_sliding) * live - view.extend_lens
            i = self._ring[group.kind]
            at = (self.cu_k_sliding[:-1, None] + i).clamp(max=reads.shape[0] - 1)
            read = i < cached[:, None]
            page = (view.prefix_lens[:, None] - cached[:, None] + i) % group.ring // group.page_size
            table.index_put_((torch.where(read, lanes[:, None], scratch), torch.where(read, page, 0)),
                             reads[at].long() // group.index_stride)

    def sampled_at(self, logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lanes, positions) of the tokens sampled from the logits at `logits_indices` (device
        work): each follows the token its logits are of, in that token's row's lane."""
        b = self._row_numbers.shape[0]
        at = logits_indices[:b].long()
        live = self._row_numbers < self.batch  # cu_q past the batch is stale
        row = ((self.cu_q[1:] <= at[:, None]) & live).sum(1).clamp(max=b - 1)
        return self.view.rows[row], self.position_ids[at].long() + 1

    def put_sampled(self, logits_indices: torch.Tensor, tokens: torch.Tensor, buffers: BatchBuffers) -> None:
        """buffers.put_tokens of the tokens sampled from the logits at `logits_indices`, at
        sampled_at's lanes and positions (device work; fused: one kernel launch)."""
        if self._kernels is None:
            buffers.put_tokens(*self.sampled_at(logits_indices), tokens)
            return
        self._kernels.put_sampled(logits_indices, self.cu_q, self.batch, buffers.sampled, self.view.rows,
                                  self.position_ids, tokens, buffers.scratch_table, buffers.scratch_row)

    def copy_inputs(self, view: ForwardView) -> None:
        """The forward's input ids and positions into `view`'s token arrays (the view's, cut to a
        span: as many tokens as they hold)."""
        n = view.input_ids.shape[0]
        if self._kernels is not None:
            self._kernels.copy_inputs(self.input_ids[:n], self.position_ids[:n], view.input_ids, view.positions)
            return
        view.input_ids.copy_(self.input_ids[:n])
        view.positions.copy_(self.position_ids[:n])
