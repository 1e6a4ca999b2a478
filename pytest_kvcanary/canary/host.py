"""The seam between an inference engine and the canary runtime.

What an engine author imports from here loads without triton and without importing torch (the
tensor types below are annotations only), so a conftest can import it at module level. The two
types an engine fills for the kernels, SlotMapping (where a slot lives) and ForwardView (one
forward's batch), with GroupInputs, are defined with the kernels (``kvcanary_kernels.inputs``),
which read them as they are; they are imported here for engine authors.

Call order (one engine, eager or inside a CUDA graph):

    runtime = CanaryRuntime(config, engine)     attach: reads canary_groups() and
                                                canary_capacities() once, allocates every buffer,
                                                fingerprints the reserved slot 0
    engine.set_forward_hooks(runtime)
    per forward:
        the engine maps the batch's slots (the mapping tables hold every slot the forward reads
        and writes) and fills the view's tensors
        hooks.before_forward(view)              HEAD: verify every slot the forward will read
        forward                                 may call hooks.kv_stored(...) at its KV-store
                                                point (write-through fingerprints, optional)
        hooks.after_forward(view)               RECHECK the read set, TAIL-stamp the written slots
        hooks.end_forward()                     host side, outside any graph: count the forward,
                                                sweep the prefix cache every sweep_interval
                                                forwards, drain the violation log every
                                                drain_interval forwards (raise mode raises here)

before_forward, kv_stored and after_forward launch device work only: no host copy, no host sync,
no grid that depends on data. An engine may capture them with its forward in one CUDA graph and
replay it with the view's tensors refilled in place; end_forward is never captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

from kvcanary_kernels.checks import check_int
# The kernels' input types are the seam's: one definition, read by the kernels as they are.
from kvcanary_kernels.inputs import ForwardView, GroupInputs, SlotMapping
from kvcanary_kernels.records import GroupKind, Half

__all__ = [
    "CacheWalk", "CanaryHost", "Capacities", "ForwardHooks", "ForwardView", "FreeListener", "GroupInputs", "PoolGroup",
    "SlotMapping", "TransferListener",
]

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PoolGroup:
    """One KV pool the canary guards.

    kind: FULL or SWA. k_layers / v_layers: the per-layer buffers, each ``[num_pages, page_size,
    ...]`` (or ``[num_slots, ...]`` when page_size is 1), slot s at ``[s // page_size, s %
    page_size]``; v_layers is empty for a latent pool (one half). num_slots: slots in the pool;
    slot 0 is reserved (never holds a token; padding may point there) and is the canary's
    sentinel: its bytes must stay what they were when the canary attached. mapping: how (row,
    position) finds a slot. window: attention window in tokens (SWA: a forward reads positions
    [prefix_len - window, prefix_len)), None for FULL. fingerprintable: False when a slot's bytes
    are not one contiguous run at that address (only real_data none is honoured then).
    opaque_halves: the halves for which that holds in an otherwise fingerprintable group (vLLM's
    CPU cache stores K transposed inside a block, V token by token): the fingerprint skips them,
    their records keep token, position and chain.
    """

    kind: GroupKind
    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    num_slots: int
    mapping: SlotMapping
    page_size: int = 1
    window: int | None = None
    fingerprintable: bool = True
    opaque_halves: frozenset[Half] = frozenset()

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SWA and (self.window is None or self.window < 1):
            raise ValueError(f"an SWA PoolGroup needs window >= 1; got {self.window!r}")
        if self.kind is GroupKind.FULL and self.window is not None:
            raise ValueError(f"a FULL PoolGroup takes no window; got {self.window!r}")
        if not self.k_layers:
            raise ValueError("PoolGroup.k_layers must hold at least one layer")
        if self.v_layers and len(self.v_layers) != len(self.k_layers):
            raise ValueError(f"PoolGroup.v_layers must be empty (a latent pool) or hold as many layers as "
                             f"k_layers ({len(self.k_layers)}); got {len(self.v_layers)}")
        if self.num_slots < 2:
            raise ValueError(f"PoolGroup.num_slots must be >= 2 (slot 0 is reserved); got {self.num_slots}")


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


# Called with (group, slots of that group's mapping space, cause) whenever slots stop holding their
# data, before they are released. For a group mapped through full_to_group the slots are FULL slots.
FreeListener = Callable[[GroupKind, "torch.Tensor", str], None]

# Called with (prefill FULL slots, decode FULL slots) of one transferred prompt, position by
# position, once its KV landed on the decode side and before the decode side's next forward.
TransferListener = Callable[["torch.Tensor", "torch.Tensor"], None]


class ForwardHooks(Protocol):
    """What an engine calls around each forward (the CanaryRuntime is one). Order: module docstring."""

    def before_forward(self, view: ForwardView) -> None:
        """Before the forward reads KV; the batch's slots are in the mapping. Device work only."""

    def kv_stored(self, kind: GroupKind, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Optional write-through, inside the forward at the KV-store point of ``layer`` (an index
        into the group's k_layers): the K (and V) rows the forward computed for its tokens, shaped
        ``[T, ...]`` in view token order. TAIL then checks each written slot holds exactly that.
        Device work only."""

    def after_forward(self, view: ForwardView) -> None:
        """After the forward wrote its KV, before its samples are used. Device work only."""

    def end_forward(self) -> None:
        """Once per forward, after after_forward (eager) or after the graph replay; host side."""


@runtime_checkable
class CanaryHost(Protocol):
    """What an engine exposes to the canary runtime."""

    def canary_groups(self) -> Sequence[PoolGroup]:
        """The pools to guard, FULL first. Called once, when the runtime attaches; the tensors
        must stay the same objects for the engine's life (the runtime keeps views of them)."""
        ...

    def canary_capacities(self) -> Capacities:
        """The largest forward; called once, when the runtime attaches."""
        ...

    def cache_walk(self) -> CacheWalk | None:
        """A snapshot of the prefix cache for the sweep, or None when the engine has none. Called
        by the runtime between forwards (end_forward); slots stay valid until the next forward."""
        ...
