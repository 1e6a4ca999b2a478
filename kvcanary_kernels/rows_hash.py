"""Write-through: the source hash of each row a forward computed, before it lands in the pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fingerprint import source_hash
from .hashing import as_i64
from .launch import Tiling, cdiv, check_tiling, default_tiling, rows_source, source_args


@triton.jit
def _source_hash_rows_kernel(source, n_rows, out, READS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = offs < n_rows
    words, row_stride, words_per_token, per_tile = source[0]
    hashes = source_hash(words, row_stride, words_per_token, per_tile, offs, on, READS[0][0], READS[0][1],
                         READS[0][2], READS[0][3], READS[0][5])
    tl.store(out + offs, as_i64(hashes), mask=on)


def source_hash_rows(rows: torch.Tensor, read_bytes: int, out: torch.Tensor, tiling: Tiling | None = None, *,
                     sample_offset: int = 0, sample_stride: int = 16) -> None:
    """``out[t]`` = the source hash of row t's read_bytes sampled as a RealKvSource samples them
    (``fingerprint.source_hash`` over its int64 words; defaults: the first read_bytes), for rows ``[T, ...]`` contiguous past dim 0 with 16-byte aligned rows (one
    layer's new K or V, in token order) and out int64 [T].
    A slot holding row t's bytes then fingerprints as ``mix(acc ^ out[t])`` folded over its
    sources. Graph-safe; the grid depends on T only."""
    source = rows_source(rows, read_bytes, out, sample_offset, sample_stride)
    if source is None:
        return
    tiling = tiling or default_tiling([source])
    check_tiling(tiling)
    src, reads = source_args([source], tiling.chunk)
    n = rows.shape[0]
    _source_hash_rows_kernel[(cdiv(n, tiling.block),)](src, n, out, READS=reads, BLOCK=tiling.block,
                                                             num_warps=tiling.num_warps)
