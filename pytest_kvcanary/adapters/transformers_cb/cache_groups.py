"""What every release's cache layout (layout_sectors.py, layout_block_manager.py) hands the engine:
a ``GroupCache`` per attention type, the causes it announces frees with (``Causes``), and
``UnsupportedModel`` for a cache it cannot describe."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ...canary.seam import GroupKind
from ..patches import Patches

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
KINDS = {FULL_ATTENTION: GroupKind.FULL, SLIDING_ATTENTION: GroupKind.SWA}

FreeCallback = Callable[[GroupKind, list[int], str], None]
MarkedCallback = Callable[[Any], None]  # called with the RequestState whose blocks were hashed

CAUSE_RELEASED = "request released its blocks"
CAUSE_OFFLOADED = "request offloaded (its KV copied to CPU memory, or dropped to be recomputed)"
CAUSE_EVICTED = "evicted from the prefix cache"
CAUSE_DEDUPLICATED = "deduplicated: the request adopted an identical hashed block"
CAUSE_RESET = "engine reset"


class UnsupportedModel(ValueError):
    """A model whose cache layout the adapter cannot describe to the canary."""


@dataclass(frozen=True)
class GroupCache:
    """One attention type's KV as the canary sees it: per-layer ``[num_blocks, page_size, H, D]``
    views (block b's slots are ``b * page_size + offset``) of the model layers ``layers``, the
    read window and the ring of a sliding-window group (tokens sit at ``position % ring``), and
    the allocator's key, the group's place in the per-group read and write index lists transformers
    hands the forward, and the physical cache rows per block in those indices (an index is
    ``block * index_stride + offset``)."""

    kind: GroupKind
    layers: tuple[int, ...]
    k_layers: tuple[torch.Tensor, ...]
    v_layers: tuple[torch.Tensor, ...]
    num_blocks: int
    page_size: int
    window: int | None
    ring: int
    key: Any
    io_index: int
    index_stride: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def fingerprintable(self) -> bool:
        row = self.k_layers[0][0, 0]
        return row.numel() * row.element_size() % 16 == 0


class Causes:
    """The reason the blocks being released right now are released: set by the outermost
    transformers call that releases them (an engine reset releases through the others)."""

    def __init__(self) -> None:
        self.current: str | None = None

    @contextmanager
    def cause(self, cause: str) -> Iterator[None]:
        outer = self.current
        self.current = outer or cause
        try:
            yield
        finally:
            self.current = outer

    def wrap(self, patches: Patches, obj: Any, name: str, cause: str | Callable[..., str]) -> None:
        """Run obj.name under `cause` (a string, or a function of the call's arguments)."""
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                with self.cause(cause if isinstance(cause, str) else cause(*args, **kwargs)):
                    return original(*args, **kwargs)
            return wrapped

        patches.wrap(obj, name, make)


def group_window(kind: GroupKind, config: Any) -> tuple[int | None, int]:
    """(canary read window, ring) of a group: a sliding layer reads the window - 1 cached tokens
    before its query (transformers' get_read_indices) from a ring of `window` slots."""
    if kind is GroupKind.FULL:
        return None, 0
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < 2:
        raise UnsupportedModel(f"a sliding-window layer group needs config.sliding_window >= 2; got {window!r}")
    return window - 1, window


def full_first(name: str) -> int:
    """Sort key: the full-attention group first."""
    return 0 if name == FULL_ATTENTION else 1
