"""The view's per-forward device work in one kernel each (CUDA): a full-attention group's block
table with the view's lengths (DerivedView.derive), the forward's inputs into the view
(DerivedView.copy_inputs), the staged token entries into the token table, only as many as the host
staged (BatchBuffers.apply_tokens), and the sampled tokens into it (DerivedView.sampled_at then
BatchBuffers.put_tokens). Their torch forms stay in forward_view.py and batch_buffers.py, the
reference these match on every input (tests/adapters/transformers/test_view_kernels.py).

Each replaces a dozen or more small torch launches (a node each in a captured forward, where a
decode step at batch 1 paid about 2.5 us a node); the arithmetic is the torch form's, entry by
entry. Imported on first use: importing the adapter imports no triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _floor_div(a, b):
    """a // b rounded down (torch's floor_divide) for b > 0; triton's // truncates toward zero."""
    q = a // b
    return tl.where((a % b != 0) & (a < 0), q - 1, q)


@triton.jit(do_not_specialize=["starts_ptr", "index_ptr", "index_len"])
def _derive_full_kernel(cu_q_ptr, cu_k_ptr, starts_ptr, batch_ptr, rows_ptr, prefix_ptr, extend_ptr,
                        index_ptr, index_len, table_ptr, table_stride, width, page_size, index_stride, scratch,
                        WRITE_TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """Batch row r (one program): its extend and prefix lengths (zero past the batch), and with
    WRITE_TABLE its lane's table row: entry j is the block of index[start + j * page_size] (clamped
    into the index) while j * page_size is short of prefix + extend, else 0 (rows past the batch
    write the scratch row)."""
    r = tl.program_id(0)
    live = r < tl.load(batch_ptr)
    extend = tl.where(live, tl.load(cu_q_ptr + r + 1) - tl.load(cu_q_ptr + r), 0).to(tl.int64)
    prefix = tl.where(live, tl.load(cu_k_ptr + r + 1) - tl.load(cu_k_ptr + r), 0).to(tl.int64) - extend
    tl.store(extend_ptr + r, extend)
    tl.store(prefix_ptr + r, prefix)
    if WRITE_TABLE:
        lane = tl.where(live, tl.load(rows_ptr + r), scratch).to(tl.int64)
        start = tl.load(starts_ptr + r).to(tl.int64)
        for first in range(0, width, BLOCK):
            j = first + tl.arange(0, BLOCK)
            inside = j < width
            block_start = j.to(tl.int64) * page_size
            at = tl.maximum(tl.minimum(start + block_start, index_len - 1), 0)
            entry = tl.load(index_ptr + at, mask=inside, other=0).to(tl.int64)
            block = tl.where(block_start < prefix + extend, _floor_div(entry, index_stride), 0)
            tl.store(table_ptr + lane * table_stride + j, block, mask=inside)


@triton.jit(do_not_specialize=["logits_ptr", "positions_ptr", "tokens_ptr"])
def _put_sampled_kernel(logits_ptr, cu_q_ptr, batch_ptr, sampled_ptr, rows_ptr, positions_ptr, n_positions,
                        tokens_ptr, table_ptr, table_stride, table_cols, scratch, n_rows, ROWS: tl.constexpr):
    """Sampled token i (one program): the row whose query holds its logits' token (the live rows
    ending at or before it, counted, at most n_rows - 1), written to that row's lane at the position
    after the token's; a token past the sampled count, or past the table, goes to the scratch row."""
    i = tl.program_id(0)
    at = tl.load(logits_ptr + i).to(tl.int64)
    r = tl.arange(0, ROWS)
    rows_before = (tl.load(cu_q_ptr + r + 1, mask=r < n_rows, other=0) <= at) & (r < tl.load(batch_ptr)) & (r < n_rows)
    row = tl.minimum(tl.sum(rows_before.to(tl.int64), axis=0), n_rows - 1)
    lane = tl.load(rows_ptr + row).to(tl.int64)
    position = tl.load(positions_ptr + tl.maximum(tl.minimum(at, n_positions - 1), 0)).to(tl.int64) + 1
    valid = (i < tl.load(sampled_ptr)) & (position < table_cols)
    token = tl.load(tokens_ptr + i).to(tl.int64)
    tl.store(table_ptr + tl.where(valid, lane, scratch) * table_stride + tl.where(valid, position, 0), token)


@triton.jit
def _copy_inputs_kernel(ids_ptr, positions_ptr, view_ids_ptr, view_positions_ptr, n, BLOCK: tl.constexpr):
    """view_ids[i] = ids[i] and view_positions[i] = positions[i] (as int64) for one block of i."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    tl.store(view_ids_ptr + i, tl.load(ids_ptr + i, mask=inside).to(tl.int64), mask=inside)
    tl.store(view_positions_ptr + i, tl.load(positions_ptr + i, mask=inside).to(tl.int64), mask=inside)


@triton.jit
def _apply_entries_kernel(entries_ptr, count_ptr, n_entries, table_ptr, table_stride, BLOCK: tl.constexpr):
    """table[lane, position] = token for the staged entries [3, n_entries] (lanes, positions,
    tokens) of one block, those before the staged count only (the rest are unused)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    used = i < tl.load(count_ptr)
    lane = tl.load(entries_ptr + i, mask=used, other=0)
    position = tl.load(entries_ptr + n_entries + i, mask=used, other=0)
    token = tl.load(entries_ptr + 2 * n_entries + i, mask=used, other=0)
    tl.store(table_ptr + lane * table_stride + position, token, mask=used)


def copy_inputs(ids: torch.Tensor, positions: torch.Tensor, view_ids: torch.Tensor,
                view_positions: torch.Tensor) -> None:
    """view_ids[:] = ids and view_positions[:] = positions, one launch (see _copy_inputs_kernel)."""
    n, block = view_ids.shape[0], 1024
    _copy_inputs_kernel[(triton.cdiv(n, block),)](ids, positions, view_ids, view_positions, n, BLOCK=block)


def apply_entries(entries: torch.Tensor, count: torch.Tensor, table: torch.Tensor) -> None:
    """The first `count` staged entries into `table` (see _apply_entries_kernel)."""
    n, block = entries.shape[1], 1024
    _apply_entries_kernel[(triton.cdiv(n, block),)](entries, count, n, table, table.stride(0), BLOCK=block)


def derive_full(cu_q: torch.Tensor, cu_k: torch.Tensor, batch: torch.Tensor, rows: torch.Tensor,
                prefix_lens: torch.Tensor, extend_lens: torch.Tensor, index: torch.Tensor | None = None,
                starts: torch.Tensor | None = None, table: torch.Tensor | None = None, page_size: int = 1,
                index_stride: int = 1, scratch: int = 0) -> None:
    """The view's lengths of every row of cu_q; with a table (and its index and the rows' starts in
    it), that table's rows too (see _derive_full_kernel)."""
    n_rows = cu_q.shape[0] - 1
    write = table is not None
    width = table.shape[1] if write else 0
    _derive_full_kernel[(n_rows,)](
        cu_q, cu_k, starts if write else cu_q, batch, rows, prefix_lens, extend_lens, index if write else cu_q,
        index.shape[0] if write else 1, table if write else prefix_lens, table.stride(0) if write else 0, width,
        page_size, index_stride, scratch, WRITE_TABLE=write, BLOCK=min(triton.next_power_of_2(max(width, 1)), 1024))


def put_sampled(logits_indices: torch.Tensor, cu_q: torch.Tensor, batch: torch.Tensor, sampled: torch.Tensor,
                rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor,
                scratch: int) -> None:
    """The first len(cu_q) - 1 sampled tokens into `table` (see _put_sampled_kernel)."""
    n_rows = cu_q.shape[0] - 1
    _put_sampled_kernel[(n_rows,)](logits_indices, cu_q, batch, sampled, rows, positions, positions.shape[0], tokens,
                                   table, table.stride(0), table.shape[1], scratch, n_rows,
                                   ROWS=triton.next_power_of_2(n_rows))
