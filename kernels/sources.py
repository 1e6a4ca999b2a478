"""Where a slot's real KV bytes live, and how many of them the fingerprint reads."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import torch

ALIGN = 16
PARTIAL_READ_BYTES = 16
MAX_SOURCES = 4


class RealDataMode(str, Enum):
    """How much of a slot's real KV bytes the fingerprint covers."""

    NONE = "none"
    PARTIAL = "partial"
    ALL = "all"

    @classmethod
    def parse(cls, value: "str | RealDataMode", field: str = "real_data") -> "RealDataMode":
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"{field} must be one of {allowed}; got {value!r}") from None


@dataclass(frozen=True)
class RealKvSource:
    """A view of real KV bytes: slot s lives at
    ``bytes[s // page_size, (s % page_size) * num_bytes_per_token : + num_bytes_per_token]``
    and the fingerprint folds its first ``read_bytes``.

    ``tensor`` has >= 2 dims; everything past dim 0 must be contiguous (it is read as one row of
    bytes per page; dim 0 may be strided). Sizes are multiples of 16 bytes.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

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

    def words(self) -> torch.Tensor:
        """The source as int64 words, shape [num_pages, page_size * num_bytes_per_token // 8]
        (a view of the tensor)."""
        return self._words

    @cached_property
    def _words(self) -> torch.Tensor:
        """``words()``, made once: every kernel launch reads it."""
        t = self.tensor
        flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
        return flat.view(torch.uint8).view(torch.int64)


def read_bytes_for(mode: RealDataMode, num_bytes_per_token: int) -> int:
    if mode is RealDataMode.NONE:
        return 0
    if mode is RealDataMode.PARTIAL:
        return min(PARTIAL_READ_BYTES, num_bytes_per_token)
    return num_bytes_per_token


def layer_source(layer: torch.Tensor, page_size: int, mode: RealDataMode) -> RealKvSource | None:
    """A source over one layer's K or V buffer shaped ``[num_pages, page_size, ...]`` (or
    ``[num_slots, ...]`` when page_size is 1). None when the mode reads nothing."""
    mode = RealDataMode.parse(mode)
    per_page = layer[0].numel() * layer.element_size()
    if per_page % page_size:
        raise ValueError(f"layer row of {per_page} bytes does not split into page_size={page_size} slots")
    nbpt = per_page // page_size
    read = read_bytes_for(mode, nbpt)
    if read == 0:
        return None
    return RealKvSource(tensor=layer, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read)


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)}"
    return type(t).__name__
