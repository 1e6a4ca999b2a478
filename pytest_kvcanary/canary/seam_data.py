"""The data the canary seam hands over: the pool groups, the capacities, the cache walks, a host
tier's pools and the page helpers, documented field by field here. An engine author imports them
from `canary/seam.py`, the one module an adapter imports from (docs/adapters.md); the names below
keep working from here too.

It loads without triton and without importing torch (the tensor types below are annotations only).
The types an engine fills for the kernels, SlotMapping (where a slot lives), ForwardView (one
forward's batch), GroupInputs and StateInputs, are defined with the kernels
(``kvcanary_kernels.inputs``), which read them as they are; the soak's types (Arrival,
TokenScores, EngineDefect) in ``soak/seam_types.py``. Both are re-exported here and by the seam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

from kvcanary_kernels.checks import check_int
# The kernels' input types are the seam's: one definition, read by the kernels as they are.
from kvcanary_kernels.inputs import ForwardView, GroupInputs, ScaleInputs, SelectedInputs, SlotMapping, StateInputs
from kvcanary_kernels.records import GroupKind, Half

# The soak's types, defined with the soak; re-exported for the paths documented before they moved.
from ..soak.seam_types import Arrival, EngineDefect, TokenScores

__all__ = ["Arrival", "CacheWalk", "Capacities", "CheckpointWalk", "EngineDefect", "ForwardView", "GroupInputs",
           "HostPool", "PagedWalk", "PoolGroup", "ScaleInputs", "SelectedInputs", "SlotMapping", "StateInputs",
           "TokenScores", "copy_runs", "page_entries"]

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PoolGroup:
    """One KV pool the canary guards.

    page_size is the buffers' layout, not the mapping's block size (a block table may map into flat
    ``[num_slots, ...]`` buffers): leave it out and it is read from them, ``num_slots //
    k_layers[0].shape[0]`` (1 for flat buffers, the block size for ``[num_pages, page_size, ...]``).

    kind: FULL, SWA, DRAFT, or STATE (a hybrid model's recurrent state: k_layers are its state
    layers' buffers, each ``[num_slots, ...]`` with one request's or checkpoint's state per slot,
    v_layers empty, no mapping: a forward names its state slots in `ForwardView.state`), or SCALES
    (a quantized pool's dequantization scales: k_layers and v_layers one float32 buffer each,
    ``[num_layers, W]``, the scales of every layer, per KV head or per tensor; v_layers empty for a
    latent pool; num_slots = num_layers, no slot reserved; no mapping: a forward names the scales it
    uses in `ForwardView.scales`), or INDEXER (a sparse attention's indexer keys: k_layers one
    buffer per sparse layer, a row per slot, v_layers empty, the FULL group's num_slots and mapping:
    slot s holds the indexer key of the token whose latent KV FULL slot s holds; a forward names the
    slots its indexer selected in `ForwardView.selected`).
    k_layers / v_layers: the per-layer buffers, each ``[num_pages, page_size,
    ...]`` (or ``[num_slots, ...]`` when page_size is 1), slot s at ``[s // page_size, s %
    page_size]``, or ``[num_pages, tiles, tile, ...]`` for a page kept in tiles, slot s at
    ``[s // page_size, s % page_size // tile, s % tile]``; v_layers is empty for a latent pool (one
    half). The halves may split a layer into different numbers of buffers (vLLM's amx path: V in
    parts of 16 dimensions per head, K one buffer per head). num_slots: slots in the pool; slot 0
    is reserved (never holds a token; padding may point there) and is the canary's
    sentinel: its bytes must stay what they were when the canary attached. mapping: how (row,
    position) finds a slot. window: attention window in tokens (SWA: a forward reads positions
    [prefix_len - window, prefix_len)), None for FULL. fingerprintable: False when the
    fingerprint cannot read a slot's bytes at that address: they are neither one contiguous run of
    a multiple of 16 bytes nor evenly strided within a page (``kvcanary_kernels.sources.
    strided_read``; only real_data none is honoured then). opaque_halves: the halves for which that holds in an
    otherwise fingerprintable group: the fingerprint skips them, their records keep token,
    position and chain.
    """

    kind: GroupKind
    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    num_slots: int
    mapping: SlotMapping | None
    page_size: int | None = None
    window: int | None = None
    fingerprintable: bool = True
    opaque_halves: frozenset[Half] = frozenset()

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SWA and (self.window is None or self.window < 1):
            raise ValueError(f"an SWA PoolGroup needs window >= 1; got {self.window!r}")
        if self.kind is GroupKind.FULL and self.window is not None:
            raise ValueError(f"a FULL PoolGroup takes no window; got {self.window!r}")
        if self.kind is GroupKind.INDEXER and (self.window is not None or self.v_layers):
            raise ValueError(f"an INDEXER PoolGroup has k_layers only and no window; got {len(self.v_layers)} "
                             f"v_layers, window={self.window!r}")
        if not self.k_layers:
            raise ValueError("PoolGroup.k_layers must hold at least one layer")
        if self.page_size is None:
            rows = self.k_layers[0].shape[0]
            if rows >= self.num_slots:  # flat buffers: a slot per row (spare rows past num_slots allowed)
                rows = self.num_slots
            if rows < 1 or self.num_slots % rows:
                raise ValueError(f"PoolGroup: num_slots={self.num_slots} is not a whole number of slots per row of "
                                 f"k_layers[0] (shape {tuple(self.k_layers[0].shape)}); give page_size, the slots "
                                 f"each row of the buffers holds")
            object.__setattr__(self, "page_size", self.num_slots // rows)
        unmapped = self.kind in (GroupKind.STATE, GroupKind.SCALES)
        if (self.mapping is None) != unmapped:
            raise ValueError(f"PoolGroup.mapping must be {'None' if unmapped else 'a SlotMapping'} "
                             f"for a {self.kind.name} group; got {type(self.mapping).__name__}")
        if self.kind is GroupKind.SCALES:
            _check_scales(self)
            return
        if self.kind is not GroupKind.STATE:
            for name, layers in (("k_layers", self.k_layers), ("v_layers", self.v_layers)):
                for i, buffer in enumerate(layers):
                    if _head_major(buffer, self.page_size):
                        raise ValueError(
                            f"PoolGroup {self.kind.name} {name}[{i}] of shape {tuple(buffer.shape)} and strides "
                            f"{tuple(buffer.stride())} is head-major ([num_pages, heads, page_size, head_dim]); the "
                            f"canary finds slot s at [s // page_size, s % page_size] (page_size={self.page_size}). Hand "
                            f"one buffer per head instead, [{name[0]}[:, h] for h in range({buffer.shape[1]})] (views, "
                            "no copy; a [batch, heads, positions, head_dim] cache is one page per batch row)")
        if self.kind is GroupKind.STATE and (self.v_layers or self.page_size != 1 or self.window is not None):
            raise ValueError("a STATE PoolGroup has k_layers only (one slot per row of each), page_size 1 and no "
                             "window")
        if self.num_slots < 2:
            raise ValueError(f"PoolGroup.num_slots must be >= 2 (slot 0 is reserved); got {self.num_slots}")


def _check_scales(group: PoolGroup) -> None:
    """A SCALES group: one float32 buffer ``[num_slots, W]`` per half (the layers' scales), contiguous."""
    import torch

    if len(group.k_layers) != 1 or len(group.v_layers) > 1 or group.window is not None:
        raise ValueError(f"a SCALES PoolGroup has one k_layers buffer, at most one v_layers buffer and no window; got "
                         f"{len(group.k_layers)}, {len(group.v_layers)}, window={group.window!r}")
    for name, layers in (("k_layers", group.k_layers), ("v_layers", group.v_layers)):
        for buffer in layers:
            if (buffer.dtype != torch.float32 or buffer.dim() != 2 or buffer.shape[0] != group.num_slots
                    or not buffer.is_contiguous()):
                raise ValueError(f"a SCALES PoolGroup's {name}[0] must be a contiguous float32 [num_slots="
                                 f"{group.num_slots}, W] tensor; got {buffer.dtype} of shape {tuple(buffer.shape)}")


def _head_major(buffer: torch.Tensor, page_size: int) -> bool:
    """``[num_pages, heads, page_size, head_dim]``: a page's slots along dim 2, not dim 1 (nor tiled
    over dims 1 and 2)."""
    shape = buffer.shape
    return (page_size > 1 and len(shape) >= 4 and shape[1] != page_size and shape[2] == page_size
            and shape[1] * shape[2] != page_size)


@dataclass(frozen=True)
class HostPool:
    """One pool group's KV in an engine's host-memory tier: per-layer K and V buffers in host
    memory, each laid out as the group's device buffer of the same layer past its first dimension
    (host slot h where device slot s would be), num_slots host slots. The fault injector flips
    bytes there (real_kv_host) where the fingerprint reads them on the device."""

    kind: GroupKind
    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    num_slots: int


@dataclass(frozen=True)
class Capacities:
    """The largest forward the engine will run, declared once at attach: the kernels' grids are
    sized from these, never from a forward's data. max_batch: rows of a ForwardView (a padded
    batch's size); max_tokens: its token arrays' length; max_context: positions are < this."""

    max_batch: int
    max_tokens: int
    max_context: int

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_tokens", "max_context"):
            check_int(f"Capacities.{name}", getattr(self, name), 1)


class CacheWalk(NamedTuple):
    """Everything a prefix cache holds, as FULL-group slots (int64 [M] each, any device), each slot
    once (the sweep reports a walk that breaks this, canary/walk.py).

    positions: the token's position; prev_slots: slot of the previous position on its path
    (PREV_CHAIN_HEAD = -1 at position 0); tokens: the token (UNKNOWN = -1 when the cache does not
    keep tokens); locked: True where a live request holds the slot (the sweep can restrict itself
    to unlocked slots); context_keys: optional per-slot context key (0 = none). Other groups are
    swept through their mapping's full_to_group map, when they have one.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    prev_slots: torch.Tensor
    tokens: torch.Tensor
    locked: torch.Tensor
    context_keys: torch.Tensor | None = None


class CheckpointWalk(NamedTuple):
    """The recurrent-state checkpoints a prefix cache holds (a hybrid model's STATE group), int64
    [M] each on the host, each slot once. slots: the checkpoint's state slot; lengths: how many
    tokens of its path the state summarizes (>= 1); prev_slots: the FULL slot of its path's token
    at lengths - 1 (the state's last token); locked: True where a live request holds the path;
    context_keys: the path's context key (0 = none)."""

    slots: torch.Tensor
    lengths: torch.Tensor
    prev_slots: torch.Tensor
    locked: torch.Tensor
    context_keys: torch.Tensor


class PagedWalk(NamedTuple):
    """A prefix cache kept in whole pages of the FULL pool, as a table indexed by page that the host
    updates in place: the cheap walk of a paged engine, whose cached blocks each hold page_size
    consecutive positions. Page p is slots ``[p * page_size, (p + 1) * page_size)`` (P * page_size
    is the FULL group's slot count); slot s of a listed page holds the position after slot s - 1's,
    its first slot the position after ``prev_slots[p]``'s. On the host (CPU tensors).

    first_positions: int64 [P], the position of the page's first slot, or -1 where the cache holds
    nothing in the page; prev_slots: int64 [P], the slot holding the position before its first
    slot (PREV_CHAIN_HEAD at position 0); tokens: int64 [P * page_size], each slot's token (UNKNOWN
    when the cache does not keep it); locked: bool [P], True where a live request holds the page;
    version: changes whenever any of them but ``locked`` does (an unlocked-only sweep reads
    ``locked`` afresh every time). The sweep checks it page by page (the rules of canary/walk.py)
    and plans it on the device, so its host work does not grow with the slots cached.
    """

    page_size: int
    first_positions: torch.Tensor
    prev_slots: torch.Tensor
    tokens: torch.Tensor
    locked: torch.Tensor
    version: int


def page_entries(page_size: int, pages: Sequence[int], first_positions: Sequence[int], prev_slots: Sequence[int],
                 tokens: Sequence[Sequence[int]], locked: Sequence[bool]) -> CacheWalk:
    """Whole pages as a list of entries: for each page (its id, its first slot's position, the slot
    before its first slot, its page_size tokens, its lock) its slots in order, each after the one
    before it. Built with numpy (imported here, not at the seam's load)."""
    import numpy as np
    import torch

    offsets = np.arange(page_size, dtype=np.int64)
    slots = np.asarray(pages, dtype=np.int64).reshape(-1, 1) * page_size + offsets
    prev = slots - 1
    prev[:, 0] = prev_slots
    positions = np.asarray(first_positions, dtype=np.int64).reshape(-1, 1) + offsets
    columns = (slots, positions, prev, np.asarray(tokens, dtype=np.int64))
    return CacheWalk(*(torch.from_numpy(np.ascontiguousarray(c).reshape(-1)) for c in columns),
                     torch.from_numpy(np.repeat(np.asarray(locked, dtype=bool), page_size)))


def copy_runs(dst: torch.Tensor, dst_index: torch.Tensor | None, src: torch.Tensor,
              src_index: torch.Tensor | None) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` for every i (an index None: 0, 1, ...; indices are
    CPU int64), as one slice copy per run of entries consecutive on both sides: whole pages move in
    a few copies, asynchronous between pinned host memory and a device (non_blocking), where an
    indexed copy would wait for the device."""
    import torch

    index = dst_index if dst_index is not None else src_index
    n = 0 if index is None else index.numel()
    if n == 0:
        return
    d = dst_index if dst_index is not None else torch.arange(n)
    s = src_index if src_index is not None else torch.arange(n)
    breaks = ((d[1:] - d[:-1] != 1) | (s[1:] - s[:-1] != 1)).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), n]
    starts_d, starts_s = d[bounds[:-1]].tolist(), s[bounds[:-1]].tolist()
    for a, b, at_d, at_s in zip(bounds, bounds[1:], starts_d, starts_s):
        dst[at_d:at_d + b - a].copy_(src[at_s:at_s + b - a], non_blocking=True)
