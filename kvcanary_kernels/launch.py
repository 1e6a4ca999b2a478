"""Host side of a kernel launch, shared by the kernels and their references: argument checks,
the tile choice, the grid sizes, and the kernel arguments of each input type (one function per
type expands it; a tuple for a source, the mapping, the token table and the ring), so each
launcher names them once.

Checks read only shapes, dtypes and devices, so they never synchronise with the device.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .inputs import ForwardView, SlotMapping, VerifyEntries
from .records import RECORD_WIDTH, split_tag
from .ring import ViolationRing
from .sources import MAX_SOURCES, RealKvSource


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b) (Triton's helpers cost microseconds per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side smallest power of two >= n (>= 1)."""
    return 1 << max(n - 1, 0).bit_length()


class Tiling(NamedTuple):
    """Entries per program and source words per slot a program loads at a time (powers of two),
    and warps per program. Keep ``block >= 32 * num_warps``: with fewer entries than threads,
    Triton replicates the per-entry work across threads."""

    block: int
    chunk: int
    num_warps: int


# The tilings benchmarks/bench_kernels.py --sweep picked for verify_view in all mode on an H100:
# 128 entries x 16 words (128 bytes) per slot per step with 4 warps for 256-byte slots, 64 entries
# x 32 words with 2 warps for 2 KiB slots (94% of copy bandwidth against 88% with the former; the
# former is within 1% of the best for 256 bytes). Sizes between are untimed.
NARROW_TILING = Tiling(block=128, chunk=16, num_warps=4)
WIDE_TILING = Tiling(block=64, chunk=32, num_warps=2)
WIDE_READ_BYTES = 1024


def default_tiling(sources: Sequence[RealKvSource]) -> Tiling:
    """The tiling a launch over these sources uses when the caller names none."""
    widest = max((s.read_bytes for s in sources), default=0)
    return WIDE_TILING if widest >= WIDE_READ_BYTES else NARROW_TILING

# A view launch has about this many programs per multiprocessor at most (CPU: programs in all,
# since Triton's interpreter runs them one after another); a batch row's tiles are shared among
# its programs, which loop over them.
PROGRAMS_PER_SM = 64
CPU_PROGRAMS = 4


def check_tiling(tiling: Tiling) -> None:
    for name, value in zip(tiling._fields, tiling):
        if value < 1 or value & (value - 1):
            raise ValueError(f"tiling.{name} must be a power of two; got {value}")


def check_records(records: torch.Tensor) -> None:
    if not isinstance(records, torch.Tensor):
        raise ValueError(f"records must be a tensor; got {type(records).__name__}")
    if records.dtype != torch.int64:
        raise ValueError(f"records must be int64; got {records.dtype}")
    if records.dim() != 2 or records.shape[1] != RECORD_WIDTH:
        raise ValueError(f"records must be [num_slots, {RECORD_WIDTH}]; got {tuple(records.shape)}")
    if not records.is_contiguous():
        raise ValueError(f"records must be contiguous; got strides {records.stride()}")


def check_common(records: torch.Tensor, sources: Sequence[RealKvSource], ring: ViolationRing, tag: int) -> None:
    """Records, sources (on the records' device, covering every slot), ring and tag."""
    check_records(records)
    device = records.device
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"sources holds at most {MAX_SOURCES}; got {len(sources)}")
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            raise ValueError(f"sources[{i}] must be a RealKvSource; got {type(src).__name__}")
        if src.tensor.device != device:
            raise ValueError(f"sources[{i}].tensor is on {src.tensor.device}; records are on {device}")
        if src.num_slots < records.shape[0]:
            raise ValueError(f"sources[{i}] covers {src.num_slots} slots; records have {records.shape[0]}")
    if not isinstance(ring, ViolationRing):
        raise ValueError(f"ring must be a ViolationRing; got {type(ring).__name__}")
    if ring.rows.device != device:
        raise ValueError(f"ring is on {ring.rows.device}; records are on {device}")
    split_tag(tag)


def check_prev_records(records: torch.Tensor, prev_records: torch.Tensor | None) -> torch.Tensor:
    """The records a launch's prev_slots index: ``prev_records`` (checked: records on the same
    device) or, when None, ``records`` itself."""
    if prev_records is None:
        return records
    check_records(prev_records)
    if prev_records.device != records.device:
        raise ValueError(f"prev_records is on {prev_records.device}; records are on {records.device}")
    return prev_records


def check_vector(name: str, t: object, device: torch.device, length: int | None = None) -> None:
    """``t`` is a contiguous 1-D int64 tensor on ``device`` (of ``length``, when given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64; got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be 1-D and contiguous; got shape {tuple(t.shape)}, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; records are on {device}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} has length {t.shape[0]}; expected {length}")


def check_entries(entries: VerifyEntries, device: torch.device) -> None:
    if not isinstance(entries, VerifyEntries):
        raise ValueError(f"entries must be VerifyEntries; got {type(entries).__name__}")
    first = entries._fields[0]
    for name, t in zip(entries._fields, entries):
        field = f"VerifyEntries.{name}"
        check_vector(field, t, device)
        if t.shape[0] != entries.slots.shape[0]:
            raise ValueError(f"{field} has length {t.shape[0]}; VerifyEntries.{first} has {entries.slots.shape[0]}")


def check_mapping(mapping: SlotMapping, device: torch.device) -> None:
    """The mapping's tensors are on ``device`` (a SlotMapping checked the rest when it was made)."""
    if not isinstance(mapping, SlotMapping):
        raise ValueError(f"mapping must be a SlotMapping; got {type(mapping).__name__}")
    if mapping.table.device != device:
        raise ValueError(f"SlotMapping.table is on {mapping.table.device}; records are on {device}")
    f2g = mapping.full_to_group
    if f2g is not None and f2g.device != device:
        raise ValueError(f"SlotMapping.full_to_group is on {f2g.device}; records are on {device}")


def check_state_launch(records: torch.Tensor, sources: Sequence[RealKvSource], full_records: torch.Tensor,
                       full_mapping: SlotMapping, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                       extend: torch.Tensor | None, more: tuple[torch.Tensor, torch.Tensor] | None,
                       ring: ViolationRing, tag: int) -> None:
    """Everything a state launch reads; raises ValueError naming the argument and value."""
    check_common(records, sources, ring, tag)
    check_prev_records(records, full_records)
    check_mapping(full_mapping, records.device)
    check_vector("rows", rows, records.device)
    for name, t in (("slots", slots), ("lengths", lengths), ("extend", extend)):
        if t is not None:
            check_vector(name, t, records.device, rows.shape[0])
    for name, t in zip(("more slots", "more lengths"), more or ()):
        # [B] or [B, m], the same shape both; checked as the flat, contiguous vector the kernel reads
        if not isinstance(t, torch.Tensor) or t.shape[:1] != rows.shape[:1] or t.shape != more[0].shape or t.dim() > 2:
            raise ValueError(f"{name} must be a tensor [B] or [B, m] (B = {rows.shape[0]} rows), the same shape "
                             f"as more slots; got {_desc(t)}")
        check_vector(name, t.view(-1) if t.is_contiguous() else t, records.device)


def check_view(view: ForwardView, device: torch.device) -> None:
    if not isinstance(view, ForwardView):
        raise ValueError(f"view must be a ForwardView; got {type(view).__name__}")
    batch = view.rows.shape[0] if isinstance(view.rows, torch.Tensor) else None
    for name in ("rows", "prefix_lens", "extend_lens"):
        check_vector(f"ForwardView.{name}", getattr(view, name), device, batch)
    check_vector("ForwardView.input_ids", view.input_ids, device)
    check_vector("ForwardView.positions", view.positions, device, view.input_ids.shape[0])
    if view.context_keys is not None:
        check_vector("ForwardView.context_keys", view.context_keys, device, batch)
    tt = view.token_table
    if tt is not None:
        if not isinstance(tt, torch.Tensor) or tt.dim() != 2 or tt.dtype != torch.int64:
            raise ValueError(f"ForwardView.token_table must be a 2-D int64 tensor; got {_desc(tt)}")
        if tt.device != device:
            raise ValueError(f"ForwardView.token_table is on {tt.device}; records are on {device}")


def check_view_launch(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping,
                      view: ForwardView, ring: ViolationRing, tag: int) -> None:
    """Everything a view kernel reads; raises ValueError naming the argument and value."""
    check_common(records, sources, ring, tag)
    check_mapping(mapping, records.device)
    check_view(view, records.device)


def check_stamp_launch(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping,
                       view: ForwardView, ring: ViolationRing, tag: int,
                       written_source_hashes: torch.Tensor | None) -> None:
    """Everything stamp_view reads, written_source_hashes included; raises ValueError naming the argument."""
    check_view_launch(records, sources, mapping, view, ring, tag)
    if written_source_hashes is None:
        return
    name, t, n_tokens = "written_source_hashes", written_source_hashes, view.input_ids.shape[0]
    if not sources:
        raise ValueError(f"{name} needs >= 1 source (with none, every fingerprint is 0); got 0 sources")
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D int64 tensor with contiguous rows; got {_desc(t)}")
    if t.device != records.device:
        raise ValueError(f"{name} is on {t.device}; records are on {records.device}")
    if t.shape[0] != len(sources) or t.shape[1] < n_tokens:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({len(sources)} sources, >= {n_tokens} tokens)")


def rows_source(rows: torch.Tensor, read_bytes: int, out: torch.Tensor, sample_offset: int = 0,
                sample_stride: int = 16) -> RealKvSource | None:
    """The arguments of ``source_hash_rows``, checked, as a source of one slot per row (None when
    there are no rows)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() < 2:
        raise ValueError(f"rows must be a tensor with >= 2 dims; got {_desc(rows)}")
    check_vector("out", out, rows.device, rows.shape[0])
    if rows.shape[0] == 0:
        return None
    return RealKvSource(rows, page_size=1, num_bytes_per_token=rows[0].numel() * rows.element_size(),
                        read_bytes=read_bytes, sample_offset=sample_offset, sample_stride=sample_stride)


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


# ---- kernel arguments, one function per input type ------------------------------------------
# Each expands its input into the kernel's arguments in one place; the launchers splat them in.


def optional_ptr(t: torch.Tensor | None, records: torch.Tensor) -> torch.Tensor:
    """An optional tensor input as a kernel argument: the tensor, or ``records`` when absent (the
    kernel's constexpr flag for it is then off, so it is never read)."""
    return records if t is None else t


class SourceRead(NamedTuple):
    """A source's constexpr read shape (``slot_fingerprint``): words read per slot, words hashed at
    a time (a power of two), slots per row, the distance from one sample to the next in loaded
    units (int64 words for 16-byte samples, else elements), the sample's bytes, and slots per
    tile of a page."""

    read_words: int
    chunk: int
    page_size: int
    stride: int
    sample_bytes: int
    tile: int


class MapConsts(NamedTuple):
    """A slot mapping's constexpr part (``map_slot``): constants, so page and ring arithmetic
    compiles to shifts and masks."""

    page_size: int
    ring: int
    has_full_to_group: bool


def source_args(sources: Sequence[RealKvSource], chunk: int) -> tuple[tuple, tuple[SourceRead, ...]]:
    """Per source ``(words, row_stride, per_slot, per_tile)`` (what ``RealKvSource.words`` gives,
    its row stride, and the distances from one slot of a tile to the next and from one tile of a
    page to the next, in loaded units) and its constexpr ``SourceRead``, as two tuples for
    ``slot_fingerprint``."""
    args, reads = [], []
    for src in sources:
        words = src.words()
        unit = words.element_size()
        args.append((words, words.stride(0), src.slot_stride // unit, src.tile_stride // unit))
        read_words = src.read_bytes // 8
        reads.append(SourceRead(read_words, min(chunk, next_power_of_2(read_words)), src.page_size,
                                src.sample_stride // unit, src.sample_bytes, src.slots_per_tile))
    return tuple(args), tuple(reads)


def ring_args(ring: ViolationRing) -> tuple:
    """``(rows, count, step, kernel_runs, slot_runs, capacity)`` for ``violation_log``."""
    return ring.rows, ring.count, ring.step, ring.kernel_runs, ring.slot_runs, ring.capacity


def mapping_args(mapping: SlotMapping, records: torch.Tensor) -> tuple[tuple, MapConsts]:
    """The tuple ``lookup.map_slot`` takes and its constexpr ``MAP``."""
    table, f2g = mapping.table, mapping.full_to_group
    args = (table, table.stride(0), table.stride(1), table.shape[0], table.shape[1],
            optional_ptr(f2g, records), 0 if f2g is None else f2g.shape[0], records.shape[0])
    return args, MapConsts(mapping.page_size, mapping.ring, f2g is not None)


def token_args(view: ForwardView, records: torch.Tensor) -> tuple[tuple, bool]:
    """The tuple ``lookup.known_token`` takes and whether there is a token table."""
    tt = view.token_table
    if tt is None:
        return (records, 0, 0, 0, 0), False
    return (tt, tt.stride(0), tt.stride(1), tt.shape[0], tt.shape[1]), True


def batch_args(view: ForwardView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The view kernels' per-row arguments ``(rows, prefix_lens, extend_lens, n_batch)``."""
    return view.rows, view.prefix_lens, view.extend_lens, view.rows.shape[0]


def context_args(view: ForwardView, records: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The context keys as a kernel argument and the constexpr HAS_CONTEXT."""
    return optional_ptr(view.context_keys, records), view.context_keys is not None


def input_args(view: ForwardView) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The stamp kernels' per-token arguments ``(input_ids, positions, n_tokens)``."""
    return view.input_ids, view.positions, view.input_ids.shape[0]


# A launch over parts takes at most a pool group's two halves (K and V).
MAX_PARTS = 2


class RowsPart(NamedTuple):
    """One set of rows to hash and where the hashes go (``source_hash_rows``' arguments of those
    names): one layer's new K or V."""

    rows: torch.Tensor
    read_bytes: int
    out: torch.Tensor
    sample_offset: int = 0
    sample_stride: int = 16


class ViewPart(NamedTuple):
    """One records tensor a view launch checks with its sources, its ring tag and its optional
    read_hashes (``verify_view``'s arguments of those names): a pool group's K or V half."""

    records: torch.Tensor
    sources: Sequence[RealKvSource]
    tag: int
    read_hashes: torch.Tensor | None = None


class StampPart(NamedTuple):
    """One records tensor a stamp launch writes with its sources, its ring tag and its optional
    written_source_hashes (``stamp_view``'s arguments of those names): a pool group's K or V half."""

    records: torch.Tensor
    sources: Sequence[RealKvSource]
    tag: int
    written_source_hashes: torch.Tensor | None = None


def check_parts(parts: Sequence[RowsPart | ViewPart | StampPart], kind: type) -> None:
    """A launch over parts of this kind, after each part's own checks: 1 to MAX_PARTS of them, over
    the same tokens (RowsPart: as many rows) or the same slots (records as many, on one device);
    ValueError naming the part otherwise."""
    whose = "a layer's" if kind is RowsPart else "a group's"
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"parts must hold 1 to {MAX_PARTS} {kind.__name__}s ({whose} halves); got {len(parts)}")
    for i, part in enumerate(parts):
        if kind is RowsPart:
            if part.rows.shape[0] != parts[0].rows.shape[0]:
                raise ValueError(f"parts[{i}].rows has {part.rows.shape[0]} rows; parts[0].rows "
                                 f"{parts[0].rows.shape[0]}: parts hash the same tokens")
            continue
        first = parts[0].records
        if part.records.shape[0] != first.shape[0] or part.records.device != first.device:
            raise ValueError(f"parts[{i}].records holds {part.records.shape[0]} slots on {part.records.device}; "
                             f"parts[0].records {first.shape[0]} on {first.device}: parts share one mapping")


class ViewKernelArgs(NamedTuple):
    """A view launch's inputs as kernel arguments, each expanded once: the tiling, the sources and
    their constexpr READS, the mapping and its constexpr MAP, the token table and HAS_TOKENS, the
    per-row arguments (``batch_args``), the context keys and HAS_CONTEXT."""

    tiling: Tiling
    sources: tuple
    reads: tuple[SourceRead, ...]
    mapping: tuple
    map_consts: MapConsts
    tokens: tuple
    has_tokens: bool
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    context: torch.Tensor
    has_context: bool


def view_kernel_args(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping,
                     view: ForwardView, tiling: Tiling | None) -> ViewKernelArgs:
    """The arguments both view kernels take (``tiling`` None: ``default_tiling``), checked tiling."""
    tiling = tiling or default_tiling(sources)
    check_tiling(tiling)
    return ViewKernelArgs(tiling, *source_args(sources, tiling.chunk), *mapping_args(mapping, records),
                          *token_args(view, records), batch_args(view), *context_args(view, records))


def batch_lanes(view: ForwardView) -> int:
    """The constexpr lane count that holds a batch's per-row vectors (a power of two)."""
    return next_power_of_2(max(view.rows.shape[0], 1))


def row_grid(batch: int, span_cap: int, block: int, device: torch.device) -> tuple[int, int]:
    """The grid of a view launch: (batch rows, programs per row), from capacities only: a row
    spans at most ``span_cap`` positions, one tile of ``block`` each per program while the
    launch stays within its program budget."""
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
    else:
        budget = CPU_PROGRAMS
    per_row = max(1, min(cdiv(span_cap, block), budget // max(batch, 1)))
    return max(batch, 1), per_row


def check_selected(records: torch.Tensor, mapping: SlotMapping, view: ForwardView, ring: ViolationRing,
                   tag: int) -> None:
    """A selection check's inputs: the view (with ``selected``, two contiguous int64 ``[T, topk]``
    tensors, T the view's tokens), the mapping and the records on the ring's device; a tag in range."""
    check_common(records, (), ring, tag)
    check_mapping(mapping, records.device)
    check_view(view, records.device)
    if view.selected is None:
        raise ValueError("ForwardView.selected is None: a SELECT check needs the indexer's selection (SelectedInputs)")
    shape = (view.input_ids.shape[0],)
    for name, t in zip(("positions", "slots"), view.selected):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2 or not t.is_contiguous()
                or t.shape[:1] != shape):
            raise ValueError(f"ForwardView.selected.{name} must be a contiguous int64 tensor [T={shape[0]}, topk]; "
                             f"got {_desc(t)}")
        if t.device != records.device:
            raise ValueError(f"ForwardView.selected.{name} is on {t.device}; records are on {records.device}")
    if view.selected.positions.shape != view.selected.slots.shape:
        raise ValueError(f"ForwardView.selected: positions {tuple(view.selected.positions.shape)} and slots "
                         f"{tuple(view.selected.slots.shape)} differ in shape")


def check_scales(scales: torch.Tensor, guarded: torch.Tensor, ring: ViolationRing, tag: int) -> None:
    """A scale check's inputs: ``scales`` and ``guarded`` float32 ``[num_layers, W]`` tensors of
    one shape, contiguous, on the ring's device; a tag in range."""
    for name, t in (("scales", scales), ("guarded", guarded)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor [num_layers, W]; got {_desc(t)}"
                             + (f", strides {t.stride()}" if isinstance(t, torch.Tensor) else ""))
        if t.device != ring.rows.device:
            raise ValueError(f"{name} is on {t.device}; the ring is on {ring.rows.device}")
    if scales.shape != guarded.shape:
        raise ValueError(f"scales has shape {tuple(scales.shape)}; the guarded scales {tuple(guarded.shape)}")
    split_tag(tag)

