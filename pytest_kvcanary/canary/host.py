"""The seam between an inference engine and the canary runtime.

An engine (the reference engine or an adapter around a third-party one) implements `CanaryHost`
and calls `CanaryRuntime.before_forward(view)` just before its model forward reads the KV cache
and `CanaryRuntime.after_forward(view)` just after the forward has written the new slots. The
runtime never calls into the engine except through the methods below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from kvcanary_kernels.records import GroupKind


@dataclass(frozen=True)
class PoolGroup:
    """One KV pool the canary guards.

    k_layers / v_layers: the per-layer K and V buffers of this pool, each ``[num_pages, page_size,
    ...]`` (or ``[num_slots, ...]`` when page_size is 1), slot s at page s // page_size.
    num_slots: slots in this pool (slot 0 reserved). window: attention window in tokens for SWA
    groups, None for FULL. full_to_group: int64 ``[full_num_slots]`` map from a FULL-pool slot to
    this pool's slot (0 = not resident), required for SWA groups, None for FULL.
    """

    kind: GroupKind
    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    num_slots: int
    page_size: int = 1
    window: int | None = None
    full_to_group: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SWA and (self.window is None or self.window < 1 or self.full_to_group is None):
            raise ValueError("an SWA PoolGroup needs window >= 1 and a full_to_group map")
        if self.kind is GroupKind.FULL and (self.window is not None or self.full_to_group is not None):
            raise ValueError("a FULL PoolGroup takes no window and no full_to_group map")
        if not self.k_layers or len(self.k_layers) != len(self.v_layers):
            raise ValueError("PoolGroup needs the same, non-zero number of K and V layers")


@dataclass(frozen=True)
class ForwardView:
    """What one forward does, as the canary needs to see it. Host-side (CPU) int64 tensors.

    rows [B]: req_to_token row of each request in the batch. prefix_lens [B]: tokens already in
    the KV cache for that request before this forward (the forward reads them). extend_lens [B]:
    tokens this forward writes for it (1 in decode). input_ids / positions / out_cache_loc [sum
    extend_lens]: the tokens, their positions and the FULL-pool slots written, row-major in batch
    order. prefix_token_ids: optional [B] list of int64 tensors of length prefix_lens[b], the
    tokens the engine believes the prefix holds (enables the token check at HEAD).
    """

    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    prefix_token_ids: Sequence[torch.Tensor] | None = None


class RadixWalk(NamedTuple):
    """Everything a radix cache holds, as FULL-pool slots (int64 [M] each).

    prev_slots: slot of the previous position (PREV_CHAIN_HEAD = -1 at position 0). locked: True
    where a live request holds the node (the sweep can restrict itself to unlocked slots).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    prev_slots: torch.Tensor
    tokens: torch.Tensor
    locked: torch.Tensor


class ForwardHooks(Protocol):
    """What an engine calls around each forward (the CanaryRuntime is one)."""

    def before_forward(self, view: ForwardView) -> None:
        """Right before the forward reads the KV cache; the batch's slots are in req_to_token."""

    def after_forward(self, view: ForwardView) -> None:
        """Right after the forward wrote K/V for view.out_cache_loc, before its samples are used."""


@runtime_checkable
class CanaryHost(Protocol):
    """What an engine exposes to the canary runtime."""

    def canary_groups(self) -> Sequence[PoolGroup]:
        """The pools to guard, FULL first. Called once, when the runtime attaches; the tensors
        must stay the same objects for the engine's life (the runtime keeps views of them)."""
        ...

    def req_to_token(self) -> torch.Tensor:
        """The engine's ``[rows, max_context]`` table of FULL-pool slots (on the engine's device).
        Read by the runtime inside before_forward / after_forward only."""
        ...

    def radix_walk(self) -> RadixWalk | None:
        """A snapshot of the radix cache for the sweep, or None when the engine has none. Called
        by the runtime between forwards; slots must stay valid until the next forward."""
        ...
