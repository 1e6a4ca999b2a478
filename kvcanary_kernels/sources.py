"""Where a slot's real KV bytes live, and which of them the fingerprint reads.

A fingerprint reads a slot's bytes in samples: ``read_bytes // sample_bytes`` of them, the k-th at
byte ``sample_offset + k * sample_stride`` of the slot. A sample is 16 bytes where a slot's
features lie in runs (``sample_stride == 16``: one run from ``sample_offset``), or one element
(1, 2, 4 or 8 bytes) where they lie one element every ``sample_stride`` bytes: a feature-major
page, as vLLM's CPU attention keeps K (a block's dimension d of every token together; one byte a
value in an FP8 cache). ``all`` mode reads the whole slot; ``partial`` mode reads 16 bytes of each
KV head the layer is dealt (``layer_source``), so a fault confined to one head is seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .inputs import RealDataMode

ALIGN = 16
PARTIAL_READ_BYTES = 16
MAX_SOURCES = 4
SAMPLE_BYTES = (1, 2, 4, 8, ALIGN)  # an element of a feature-major page, or a 16-byte run
_UNSIGNED_AS_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RealKvSource:
    """A view of real KV bytes: slot s lives in row ``s // page_size`` of ``tensor`` (read as one
    row of bytes per page) from byte ``(s % page_size) * slot_stride`` on, ``num_bytes_per_token``
    of features per slot; the fingerprint folds ``read_bytes`` of them, ``sample_bytes`` per
    sample, the k-th sample at byte ``sample_offset + k * sample_stride`` of the slot (defaults:
    the first ``read_bytes``, in 16-byte samples).

    ``slot_stride`` (``token_stride``, default ``num_bytes_per_token``): bytes from one slot of a
    page to the next. A page may hold its slots in tiles of ``tile`` slots, ``tile_stride`` bytes
    apart: slot ``s`` then starts at byte ``(s % page_size) // tile * tile_stride + s % tile *
    slot_stride`` of its row (``slot_offset``; default: one tile, the whole page).
    ``sample_bytes`` 16: a sample is a 16-byte run; 1, 2, 4 or 8: one element (one group of features),
    the samples being consecutive features ``sample_stride`` apart (a feature-major page:
    ``token_stride == sample_bytes``, ``sample_stride == page_size * sample_bytes``).

    ``tensor`` has >= 2 dims; everything past dim 0 must be contiguous (dim 0 may be strided). Sizes
    are multiples of 16 bytes, offsets and strides multiples of ``sample_bytes``.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    sample_offset: int = 0
    sample_stride: int = ALIGN
    sample_bytes: int = ALIGN
    token_stride: int | None = None
    tile: int = 0
    tile_stride: int = 0

    def __post_init__(self) -> None:
        t = self.tensor
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"RealKvSource.tensor must be a tensor with >= 2 dims; got {_desc(t)}")
        if self.page_size < 1:
            raise ValueError(f"RealKvSource.page_size must be >= 1; got {self.page_size}")
        if self.num_bytes_per_token <= 0 or self.num_bytes_per_token % ALIGN:
            raise ValueError(
                "RealKvSource.num_bytes_per_token must be a positive multiple of 16; "
                f"got {self.num_bytes_per_token}"
            )
        if not 0 < self.read_bytes <= self.num_bytes_per_token or self.read_bytes % ALIGN:
            raise ValueError(
                "RealKvSource.read_bytes must be a positive multiple of 16 and <= "
                f"num_bytes_per_token ({self.num_bytes_per_token}); got {self.read_bytes}"
            )
        if self.sample_bytes not in SAMPLE_BYTES:
            raise ValueError(f"RealKvSource.sample_bytes must be one of {', '.join(map(str, SAMPLE_BYTES))}; "
                             f"got {self.sample_bytes}")
        unit = self.sample_bytes
        if self.sample_offset < 0 or self.sample_offset % unit or self.sample_stride < unit \
                or self.sample_stride % unit or self.slot_stride < unit or self.slot_stride % unit:
            raise ValueError(f"RealKvSource.sample_offset (>= 0), sample_stride and token_stride (>= {unit}) must be "
                             f"multiples of sample_bytes ({unit}); got {self.sample_offset}, {self.sample_stride}, "
                             f"{self.slot_stride}")
        if self.tile < 0 or (self.tile and self.page_size % self.tile) or self.tile_stride < 0 \
                or self.tile_stride % unit:
            raise ValueError(f"RealKvSource.tile must divide page_size ({self.page_size}) and tile_stride be a "
                             f"multiple of sample_bytes ({unit}); got {self.tile}, {self.tile_stride}")
        row_bytes = t[0].numel() * t.element_size()
        if not self.elementwise and self.sample_end > self.num_bytes_per_token:  # runs stay in their slot
            raise ValueError(f"RealKvSource samples end at byte {self.sample_end}, past num_bytes_per_token "
                             f"({self.num_bytes_per_token})")
        if not t[0].is_contiguous():
            raise ValueError("RealKvSource.tensor must be contiguous past dim 0 (one byte row per page)")
        if row_bytes != self.page_size * self.num_bytes_per_token:
            raise ValueError(
                "RealKvSource.tensor row holds "
                f"{row_bytes} bytes; page_size * num_bytes_per_token = "
                f"{self.page_size * self.num_bytes_per_token}"
            )
        if self.slot_offset(self.page_size - 1) + self.sample_end > row_bytes:
            raise ValueError(f"RealKvSource: the last slot of a page reads up to byte "
                             f"{self.slot_offset(self.page_size - 1) + self.sample_end}, past the row's {row_bytes}")
        stride_bytes = t.stride(0) * t.element_size()
        if stride_bytes % ALIGN or t.data_ptr() % ALIGN:
            raise ValueError(
                f"RealKvSource.tensor rows must start on 16-byte boundaries; row stride is {stride_bytes} bytes"
            )

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0] * self.page_size

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot of a page to the next."""
        return self.num_bytes_per_token if self.token_stride is None else self.token_stride

    @property
    def slots_per_tile(self) -> int:
        return self.tile or self.page_size

    def slot_offset(self, within: int) -> int:
        """Byte of its page's row where the slot ``within`` the page starts."""
        return within // self.slots_per_tile * self.tile_stride + within % self.slots_per_tile * self.slot_stride

    @property
    def elementwise(self) -> bool:
        """Samples are single elements (or packed element groups) of a strided page, not 16-byte runs."""
        return self.sample_bytes != ALIGN

    @property
    def num_samples(self) -> int:
        return self.read_bytes // self.sample_bytes

    @property
    def sample_end(self) -> int:
        """One past the last byte of the slot's row a fingerprint reads."""
        return self.sample_offset + (self.num_samples - 1) * self.sample_stride + self.sample_bytes

    def sampled_bytes(self) -> list[int]:
        """The byte offsets from the slot's start the fingerprint reads, in order."""
        return [self.sample_offset + k * self.sample_stride + b for k in range(self.num_samples)
                for b in range(self.sample_bytes)]

    def row_read(self) -> tuple[int, int]:
        """``(sample_offset, sample_stride)`` of the same read in the slot's features laid out as
        one contiguous row (what the forward computed, for write-through)."""
        if self.elementwise:
            return self.sample_offset // self.sample_stride * self.sample_bytes, ALIGN
        return self.sample_offset, self.sample_stride

    def row_bytes(self) -> torch.Tensor:
        """The source as bytes, a row per page, from the first sampled byte on (a view)."""
        t = self.tensor
        flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
        return flat.view(torch.uint8)[:, self.sample_offset:]

    def words(self) -> torch.Tensor:
        """What the kernels load, from the first sample on, a row per page: int64 words for 16-byte
        samples (slot s's k-th sample is words ``[(slot_offset(s % page_size) + k * sample_stride)
        // 8 + (0, 1)]``), else elements of ``sample_bytes`` (slot s's k-th sample is element
        ``(slot_offset(s % page_size) + k * sample_stride) // sample_bytes``)."""
        return self._words

    @cached_property
    def _words(self) -> torch.Tensor:
        """``words()``, made once: every kernel launch reads it."""
        unit = 8 if not self.elementwise else self.sample_bytes
        return self.row_bytes().view(_UNSIGNED_AS_SIGNED[unit])


def head_bytes_of(layer: torch.Tensor, num_bytes_per_token: int) -> int:
    """Bytes of one KV head in a slot's row: the last dim's, when it is a multiple of 16 that
    splits the row; else the whole row (one span)."""
    last = layer.shape[-1] * layer.element_size()
    return last if last % ALIGN == 0 and num_bytes_per_token % last == 0 else num_bytes_per_token


def layer_source(layer: torch.Tensor, page_size: int, mode: RealDataMode, share: tuple[int, int] = (0, 1)
                 ) -> RealKvSource | None:
    """A source over one layer's K or V buffer shaped ``[num_pages, page_size, ..., head_dim]`` (or
    ``[num_slots, ..., head_dim]`` when page_size is 1). None when the mode reads nothing.

    ``share = (j, S)``: this layer is the j-th of S the fingerprint folds. Partial mode deals the
    slot's KV heads over them: layer j reads the first 16 bytes of heads ``j % H, j % H + S, ...``
    (H heads), so the S layers together sample every head. All mode reads the whole row.

    A view whose slots' features are not one run (``strided_read``) is read element by element,
    its features in order (all: every one; partial: the first 16 bytes)."""
    if mode == RealDataMode.NONE:  # == : a str enum, so its value works too
        return None
    if not layer[0].is_contiguous():
        source = strided_read(layer, page_size, mode)
        if source is None:
            raise ValueError(
                f"a K/V buffer of shape {tuple(layer.shape)} and strides {layer.stride()} (page_size={page_size}) "
                "keeps a slot's features neither in one run nor evenly spaced, so the fingerprint cannot read them "
                "(a transposed head-major cache, [pages, page_size, heads, head_dim] over [pages, heads, page_size, "
                "head_dim], is one). Hand one buffer per KV head (buffer[:, :, h]: each slot's head_dim in one "
                "run), or declare the group fingerprintable=False (real_data none)")
        return source
    per_page = layer[0].numel() * layer.element_size()
    if per_page % page_size:
        raise ValueError(f"layer row of {per_page} bytes does not split into page_size={page_size} slots")
    nbpt = per_page // page_size
    if mode == RealDataMode.ALL:
        return RealKvSource(tensor=layer, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=nbpt)
    j, count = share
    head = head_bytes_of(layer, nbpt)
    heads = range(j % (nbpt // head), nbpt // head, count)
    return RealKvSource(tensor=layer, page_size=page_size, num_bytes_per_token=nbpt,
                        read_bytes=PARTIAL_READ_BYTES * len(heads), sample_offset=heads[0] * head,
                        sample_stride=count * head if len(heads) > 1 else ALIGN)


def strided_read(layer: torch.Tensor, page_size: int, mode: RealDataMode = RealDataMode.ALL) -> RealKvSource | None:
    """The source reading ``layer`` (``[num_pages, page_size, *features]``, or ``[num_pages, tiles,
    tile, *features]`` with ``tiles * tile == page_size``) element by element in ``mode`` (all or
    partial: the first 16 bytes of its features), or None when it cannot be read so: each page
    must be one contiguous run of ``page_size * features`` elements, the slots of a tile evenly
    spaced, and the features (in order) in runs of 1, 2, 4 or 8 bytes evenly spaced (the longest
    run that fits), a multiple of 16 bytes in all. Feature-major pages (vLLM's CPU K, FP8 included)
    and tiled, pair-packed ones (its AMX path) are read so."""
    slot_dims = 1 if layer.dim() >= 3 and layer.shape[1] == page_size else 2
    if layer.dim() < 2 + slot_dims or (slot_dims == 2 and layer.shape[1] * layer.shape[2] != page_size):
        return None
    elem = layer.element_size()
    shape, strides = layer.shape[1 + slot_dims:], layer.stride()[1 + slot_dims:]
    features = math.prod(shape)
    offsets = torch.zeros((), dtype=torch.int64)  # each feature's element offset, in feature order
    for size, stride in zip(shape, strides):
        offsets = (offsets[..., None] + torch.arange(size) * stride).flatten()
    run = next((r for r in (8 // elem, 4 // elem, 2 // elem, 1 // elem) if r and features % r == 0
                and torch.equal(offsets.view(-1, r) - offsets.view(-1, r)[:, :1], torch.arange(r).expand(features // r, r))), 0)
    if not run or features * elem % ALIGN:
        return None
    starts = offsets[::run]
    group = int(starts[1] - starts[0]) if starts.numel() > 1 else run
    if not torch.equal(starts - starts[0], torch.arange(starts.numel()) * group):
        return None
    if slot_dims == 1:
        tiles, tile, tile_step, token = 1, page_size, 0, layer.stride(1)
    else:
        tiles, tile, tile_step, token = layer.shape[1], layer.shape[2], layer.stride(1), layer.stride(2)
    slot_starts = (torch.arange(tiles)[:, None] * tile_step + torch.arange(tile) * token).flatten()
    page = (slot_starts[:, None] + offsets - offsets.min()).flatten().sort().values
    if not torch.equal(page, torch.arange(page_size * features)) or int(offsets[0]) != int(offsets.min()):
        return None
    rows = layer.as_strided((layer.shape[0], page_size * features), (layer.stride(0), 1), layer.storage_offset())
    nbpt = features * elem
    return RealKvSource(tensor=rows, page_size=page_size, num_bytes_per_token=nbpt,
                        read_bytes=nbpt if mode == RealDataMode.ALL else PARTIAL_READ_BYTES,
                        sample_stride=group * elem, sample_bytes=run * elem, token_stride=token * elem,
                        tile=0 if slot_dims == 1 else tile, tile_stride=tile_step * elem)


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)}"
    return type(t).__name__
