"""Where a slot's real KV bytes live, and which of them the fingerprint reads.

A fingerprint reads a slot's bytes in 16-byte samples: ``read_bytes // 16`` of them, the k-th at
byte ``sample_offset + k * sample_stride`` of the slot's row (``sample_stride == 16``: one run
from ``sample_offset``). ``all`` mode reads the whole row; ``partial`` mode reads 16 bytes of
each KV head the layer is dealt (``layer_source``), so a fault confined to one head is seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .inputs import RealDataMode

ALIGN = 16
PARTIAL_READ_BYTES = 16
MAX_SOURCES = 4


@dataclass(frozen=True)
class RealKvSource:
    """A view of real KV bytes: slot s lives at
    ``bytes[s // page_size, (s % page_size) * num_bytes_per_token : + num_bytes_per_token]``
    and the fingerprint folds ``read_bytes`` of them, 16 bytes per sample, the k-th sample at
    byte ``sample_offset + k * sample_stride`` of the slot (defaults: the first ``read_bytes``).

    ``tensor`` has >= 2 dims; everything past dim 0 must be contiguous (it is read as one row of
    bytes per page; dim 0 may be strided). Sizes are multiples of 16 bytes.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    sample_offset: int = 0
    sample_stride: int = ALIGN

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
        if self.sample_offset < 0 or self.sample_offset % ALIGN or self.sample_stride < ALIGN \
                or self.sample_stride % ALIGN:
            raise ValueError("RealKvSource.sample_offset (>= 0) and sample_stride (>= 16) must be multiples of 16; "
                             f"got {self.sample_offset}, {self.sample_stride}")
        if self.sample_end > self.num_bytes_per_token:
            raise ValueError(f"RealKvSource samples end at byte {self.sample_end}, past num_bytes_per_token "
                             f"({self.num_bytes_per_token})")
        if not t[0].is_contiguous():
            raise ValueError("RealKvSource.tensor must be contiguous past dim 0 (one byte row per page)")
        row_bytes = t[0].numel() * t.element_size()
        if row_bytes != self.page_size * self.num_bytes_per_token:
            raise ValueError(
                "RealKvSource.tensor row holds "
                f"{row_bytes} bytes; page_size * num_bytes_per_token = "
                f"{self.page_size * self.num_bytes_per_token}"
            )
        stride_bytes = t.stride(0) * t.element_size()
        if stride_bytes % ALIGN or t.data_ptr() % ALIGN:
            raise ValueError(
                f"RealKvSource.tensor rows must start on 16-byte boundaries; row stride is {stride_bytes} bytes"
            )

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0] * self.page_size

    @property
    def num_samples(self) -> int:
        return self.read_bytes // ALIGN

    @property
    def sample_end(self) -> int:
        """One past the last byte of the slot's row a fingerprint reads."""
        return self.sample_offset + (self.num_samples - 1) * self.sample_stride + ALIGN

    def sampled_bytes(self) -> list[int]:
        """The byte offsets within a slot's row the fingerprint reads, in order."""
        return [self.sample_offset + k * self.sample_stride + b for k in range(self.num_samples) for b in range(ALIGN)]

    def words(self) -> torch.Tensor:
        """The source as int64 words from the first sample's word on (a view of the tensor, with
        the row stride of ``[num_pages, page_size * num_bytes_per_token // 8]``): slot s's k-th
        sample is words ``[(s % page_size) * num_bytes_per_token // 8 + k * sample_stride // 8
        + (0, 1)]`` of row ``s // page_size``."""
        return self._words

    @cached_property
    def _words(self) -> torch.Tensor:
        """``words()``, made once: every kernel launch reads it."""
        t = self.tensor
        flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
        return flat.view(torch.uint8).view(torch.int64)[:, self.sample_offset // 8:]


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
    (H heads), so the S layers together sample every head. All mode reads the whole row."""
    per_page = layer[0].numel() * layer.element_size()
    if per_page % page_size:
        raise ValueError(f"layer row of {per_page} bytes does not split into page_size={page_size} slots")
    nbpt = per_page // page_size
    if mode == RealDataMode.NONE:  # == : a str enum, so its value works too
        return None
    if mode == RealDataMode.ALL:
        return RealKvSource(tensor=layer, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=nbpt)
    j, count = share
    head = head_bytes_of(layer, nbpt)
    heads = range(j % (nbpt // head), nbpt // head, count)
    return RealKvSource(tensor=layer, page_size=page_size, num_bytes_per_token=nbpt,
                        read_bytes=PARTIAL_READ_BYTES * len(heads), sample_offset=heads[0] * head,
                        sample_stride=count * head if len(heads) > 1 else ALIGN)


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)}"
    return type(t).__name__
