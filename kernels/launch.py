"""Host side of a kernel launch, shared by the kernels and their references: argument checks,
the tile choice, and the per-source kernel arguments.

Checks read only shapes, dtypes and devices, so they never synchronise with the device.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton

from .records import RECORD_WIDTH, split_tag
from .ring import ViolationRing
from .sources import MAX_SOURCES, RealKvSource

# Segment fields of WriteEntries; every other field has one value per entry.
SEGMENT_FIELDS = ("seg_starts", "seg_lens", "seed_slots")


class Tiling(NamedTuple):
    """Entries per program and source words per slot a program loads at a time (powers of two),
    and warps per program. Keep ``block >= 32 * num_warps``: with fewer entries than threads,
    Triton replicates the per-entry work across threads."""

    block: int
    chunk: int
    num_warps: int


# 128 entries x 16 words (128 bytes) per slot per step, 4 warps: the best verify tiling on an H200
# for 256- and 2048-byte slots (benchmarks/bench_kernels.py --sweep).
DEFAULT_TILING = Tiling(block=128, chunk=16, num_warps=4)


def check_tiling(tiling: Tiling) -> None:
    for name, value in zip(tiling._fields, tiling):
        if value < 1 or value & (value - 1):
            raise ValueError(f"tiling.{name} must be a power of two; got {value}")


def check_launch(records: torch.Tensor, entries: NamedTuple, sources: Sequence[RealKvSource],
                 ring: ViolationRing, tag: int) -> None:
    """Raises ValueError naming the offending argument and value."""
    if not isinstance(records, torch.Tensor):
        raise ValueError(f"records must be a tensor; got {type(records).__name__}")
    if records.dtype != torch.int64:
        raise ValueError(f"records must be int64; got {records.dtype}")
    if records.dim() != 2 or records.shape[1] != RECORD_WIDTH:
        raise ValueError(f"records must be [num_slots, {RECORD_WIDTH}]; got {tuple(records.shape)}")
    if not records.is_contiguous():
        raise ValueError(f"records must be contiguous; got strides {records.stride()}")
    device = records.device
    _check_entries(entries, device)
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"sources holds at most {MAX_SOURCES}; got {len(sources)}")
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            raise ValueError(f"sources[{i}] must be a RealKvSource; got {type(src).__name__}")
        if src.tensor.device != device:
            raise ValueError(f"sources[{i}].tensor is on {src.tensor.device}; records are on {device}")
        if src.num_slots < records.shape[0]:
            raise ValueError(
                f"sources[{i}] covers {src.num_slots} slots; records have {records.shape[0]}"
            )
    if not isinstance(ring, ViolationRing):
        raise ValueError(f"ring must be a ViolationRing; got {type(ring).__name__}")
    if ring.rows.device != device:
        raise ValueError(f"ring is on {ring.rows.device}; records are on {device}")
    split_tag(tag)


def _check_entries(entries: NamedTuple, device: torch.device) -> None:
    kind = type(entries).__name__
    lengths: dict[bool, tuple[str, int]] = {}
    for name, t in zip(entries._fields, entries):
        field = f"{kind}.{name}"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{field} must be a tensor; got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise ValueError(f"{field} must be int64; got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{field} must be 1-D and contiguous; got shape {tuple(t.shape)}, strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"{field} is on {t.device}; records are on {device}")
        per_segment = name in SEGMENT_FIELDS
        first = lengths.setdefault(per_segment, (name, t.shape[0]))
        if first[1] != t.shape[0]:
            raise ValueError(f"{field} has length {t.shape[0]}; {kind}.{first[0]} has {first[1]}")


def source_args(sources: Sequence[RealKvSource], dummy: torch.Tensor, chunk: int) -> tuple[list, dict[str, int]]:
    """Positional ``(words, row_stride, page_size, words_per_token)`` x MAX_SOURCES (unused slots
    point at ``dummy``) and the constexprs NUM_SOURCES, RW<k>, CHUNK<k> of ``slot_fingerprint``."""
    args: list = []
    consts = {"NUM_SOURCES": len(sources)}
    for k in range(MAX_SOURCES):
        if k < len(sources):
            src = sources[k]
            words = src.words()
            args += [words, words.stride(0), src.page_size, src.num_bytes_per_token // 8]
            read_words = src.read_bytes // 8
        else:
            args += [dummy, 0, 1, 0]
            read_words = 0
        consts[f"RW{k}"] = read_words
        consts[f"CHUNK{k}"] = min(chunk, triton.next_power_of_2(max(read_words, 1)))
    return args, consts
