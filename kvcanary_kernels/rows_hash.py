"""Write-through: the source hash of each row a forward computed, before it lands in the pool."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .fingerprint import source_hash
from .hashing import as_i64
from .launch import RowsPart, Tiling, cdiv, check_parts, check_tiling, default_tiling, rows_source, source_args


@triton.jit
def _hash_rows(source, out, offs, on, READS: tl.constexpr):
    words, row_stride, words_per_token, per_tile = source[0]
    hashes = source_hash(words, row_stride, words_per_token, per_tile, offs, on, READS[0][0], READS[0][1],
                         READS[0][2], READS[0][3], READS[0][5])
    tl.store(out + offs, as_i64(hashes), mask=on)


@triton.jit
def _source_hash_rows_kernel(source0, out0, source1, out1, n_rows, READS0: tl.constexpr, READS1: tl.constexpr,
                             N_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (j, i) hashes rows [j * BLOCK, (j + 1) * BLOCK) of part i (N_PARTS 1 or 2; part 1's
    arguments repeat part 0's when there is one)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = offs < n_rows
    if tl.program_id(1) == 0:
        _hash_rows(source0, out0, offs, on, READS0)
    if N_PARTS == 2:
        if tl.program_id(1) == 1:
            _hash_rows(source1, out1, offs, on, READS1)


def source_hash_rows(rows: torch.Tensor, read_bytes: int, out: torch.Tensor, tiling: Tiling | None = None, *,
                     sample_offset: int = 0, sample_stride: int = 16) -> None:
    """``out[t]`` = the source hash of row t's read_bytes sampled as a RealKvSource samples them
    (``fingerprint.source_hash`` over its int64 words; defaults: the first read_bytes), for rows ``[T, ...]`` contiguous past dim 0 with 16-byte aligned rows (one
    layer's new K or V, in token order) and out int64 [T].
    A slot holding row t's bytes then fingerprints as ``mix(acc ^ out[t])`` folded over its
    sources. Graph-safe; the grid depends on T only."""
    source_hash_rows_parts([RowsPart(rows, read_bytes, out, sample_offset, sample_stride)], tiling)


def source_hash_rows_parts(parts: Sequence[RowsPart], tiling: Tiling | None = None) -> None:
    """``source_hash_rows`` of each part (the same number of rows in each: a layer's K and V) in one
    launch, the parts' programs side by side; at most MAX_PARTS."""
    sources = [rows_source(*part) for part in parts]
    check_parts(parts, RowsPart)
    n = parts[0].rows.shape[0]
    if n == 0:
        return
    tiling = tiling or default_tiling(sources)
    check_tiling(tiling)
    per_part = [(*source_args([source], tiling.chunk), part.out) for source, part in zip(sources, parts)]
    (args0, reads0, out0), (args1, reads1, out1) = per_part[0], per_part[-1]
    _source_hash_rows_kernel[(cdiv(n, tiling.block), len(parts))](
        args0, out0, args1, out1, n, READS0=reads0, READS1=reads1, N_PARTS=len(parts), BLOCK=tiling.block,
        num_warps=tiling.num_warps)
