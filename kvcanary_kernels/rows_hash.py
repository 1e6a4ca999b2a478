"""Write-through: the source hash of each row a forward computed, before it lands in the pool."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .fingerprint import source_hash
from .hashing import as_i64
from .launch import RowsPart, Tiling, cdiv, check_tiling, default_tiling, rows_source, source_args


@triton.jit
def _source_hash_rows_kernel(sources, n_rows, outs, READS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (j, i) hashes rows [j * BLOCK, (j + 1) * BLOCK) of part i into outs[i]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = offs < n_rows
    for i in tl.static_range(len(READS)):
        if tl.program_id(1) == i:
            words, row_stride, words_per_token, per_tile = sources[i]
            hashes = source_hash(words, row_stride, words_per_token, per_tile, offs, on, READS[i][0], READS[i][1],
                                 READS[i][2], READS[i][3], READS[i][5])
            tl.store(outs[i] + offs, as_i64(hashes), mask=on)


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
    launch, the parts' programs side by side."""
    if not parts:
        raise ValueError("parts must hold >= 1 RowsPart; got none")
    sources = [rows_source(*part) for part in parts]
    n = parts[0].rows.shape[0]
    for i, part in enumerate(parts):
        if part.rows.shape[0] != n:
            raise ValueError(f"parts[{i}].rows has {part.rows.shape[0]} rows; parts[0].rows {n}: parts hash the same tokens")
    if n == 0:
        return
    tiling = tiling or default_tiling(sources)
    check_tiling(tiling)
    args, reads = source_args(sources, tiling.chunk)
    _source_hash_rows_kernel[(cdiv(n, tiling.block), len(parts))](
        args, n, tuple(part.out for part in parts), READS=reads, BLOCK=tiling.block, num_warps=tiling.num_warps)
