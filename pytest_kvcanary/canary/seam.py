"""The seam between an inference engine and pytest-kvcanary: the one module an adapter imports
from. It declares everything an engine author implements or hands over, in the order an adapter is
written, and re-exports every type that goes with it (`__all__`), each documented field by field
where it is defined. Read this module top to bottom; docs/adapters.md is the same reference with a
worked example.

It loads without triton or torch, so a conftest can import it at module level.

An adapter is an `EngineUnderTest`:

1. What to guard (`GuardedEngine.canary_groups`): one `PoolGroup` per KV pool, FULL first, each
   with the `SlotMapping` that says how (row, position) finds a slot; a hybrid model's recurrent
   state is one more group, kind STATE, whose slots each forward names in `ForwardView.state`
   (`StateInputs`); a quantized pool's dequantization scales are one more, kind SCALES, whose
   scales each forward hands over in `ForwardView.scales` (`ScaleInputs`); a sparse attention's
   indexer keys are one more, kind INDEXER (the FULL group's slots and mapping), whose selections
   each forward fills in `ForwardView.selected` (`SelectedInputs`). `GroupKind` and `Half` name
   groups and halves.
2. How big a forward gets (`GuardedEngine.canary_capacities`): `Capacities`.
3. Each forward calls the `ForwardHooks` set by `set_forward_hooks`, with a `ForwardView` (and
   `GroupInputs` for a pool another model writes).
4. The prefix cache (`GuardedEngine.cache_walk`): a `CacheWalk` (or a `PagedWalk`; `page_entries`
   builds a walk from whole pages; `PREV_CHAIN_HEAD` and `UNKNOWN` fill its columns), swept between
   forwards; its recurrent-state checkpoints (`checkpoint_walk`, optional): a `CheckpointWalk`;
   frees it announces (`add_free_listener`, optional): a `FreeListener`; a host-memory tier behind
   it (`GuardedEngine.host_tier`, optional): a `HostTier` of `HostPool`s, heard by a
   `HostTierListener` (`copy_runs` copies pages in runs).
5. What the fixtures drive: `generate`, `reset`, and the optional members. Each optional member
   is declared below with its default: a method with a default body (`checkpoint_walk`,
   `request_at`, `finished_requests`, `engine_defects`, `capabilities`), a method *not offered*
   by default (`add_free_listener`, `feed_token`, `serve`, `score_uncached`: the harness falls
   back as each says), or a data member with a default value (`host_tier`, `prefix_caching`,
   `routed_experts`).
   `optional(engine, name)` reads one (None for a member not offered). The workload soak uses
   `serve` (requests arriving while others run, each an `Arrival`), `score_uncached` (its oracle,
   `TokenScores`) and `engine_defects` (`EngineDefect`) when an engine offers them.
   `Capabilities` says what an engine has (`capabilities_of` derives it); `RowOwners` keeps what
   `request_at` needs.
6. For kv_pd, a `PrefillDecodePair` of two of them, heard by a `TransferListener`; an attention
   kind an engine lacks raises `UnsupportedAttention` from its factory.

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
                                                point (write-through fingerprints, optional);
                                                with an INDEXER group, hooks.indices_selected(view,
                                                layer) after each sparse layer's selection, before
                                                its attention reads (SELECT)
        hooks.after_forward(view)               RECHECK the read set, TAIL-stamp the written slots
        hooks.end_forward(device_work)          host side, outside any graph: count the forward,
                                                sweep the prefix cache every sweep_interval
                                                forwards, drain the violation log every
                                                drain_interval forwards (raise mode raises here);
                                                that device work inside device_work() (optional)

    between forwards (STATE group only):
        hooks.states_copied(src, dst)           the engine copied recurrent states (a checkpoint
                                                saved or restored, a slot cleared from slot 0):
                                                their records follow the bytes

before_forward, kv_stored, indices_selected, after_forward and states_copied launch device work
only: no host copy, no host sync, no grid that depends on data. An engine may capture them with its
forward in one CUDA graph and replay it with the view's tensors refilled in place; end_forward is
never captured.

The types also import from where they are defined (`canary/seam_data.py`, `kvcanary_kernels.inputs`,
`kvcanary_kernels.records`, `soak/seam_types.py`): those paths keep working.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Generic, Mapping, Protocol, Sequence, TypeVar,
                    runtime_checkable)

from kvcanary_kernels.inputs import ForwardView, GroupInputs, ScaleInputs, SelectedInputs, SlotMapping, StateInputs
from kvcanary_kernels.records import PREV_CHAIN_HEAD, UNKNOWN, GroupKind, Half

from ..soak.seam_types import Arrival, EngineDefect, TokenScores
from .seam_data import CacheWalk, Capacities, CheckpointWalk, HostPool, PagedWalk, PoolGroup, copy_runs, page_entries

if TYPE_CHECKING:
    import torch

# In the order an adapter is written (the module docstring's steps).
__all__ = [
    # 1. what to guard
    "PoolGroup", "SlotMapping", "GroupKind", "Half", "SlotZeroUnguarded",
    # 2. how big a forward gets
    "Capacities",
    # 3. each forward
    "ForwardHooks", "ForwardView", "GroupInputs", "StateInputs", "ScaleInputs", "SelectedInputs",
    # 4. the prefix cache, its frees, its host tier
    "CacheWalk", "PagedWalk", "page_entries", "PREV_CHAIN_HEAD", "UNKNOWN", "CheckpointWalk", "FreeListener",
    "HostTier", "HostPool", "HostTierListener", "copy_runs",
    # 5. the protocols, what the fixtures and the soak drive, what an engine has
    "GuardedEngine", "EngineUnderTest", "Arrival", "TokenScores", "EngineDefect", "RowOwners", "Capabilities",
    "capabilities_of", "OPTIONAL_MEMBERS", "REQUIRED_METHODS", "missing_methods", "optional",
    # 6. prefill/decode pairs and registering
    "PrefillDecodePair", "TransferListener", "UnsupportedAttention",
]

Owner = TypeVar("Owner")
Method = TypeVar("Method", bound=Callable[..., Any])
_NOT_OFFERED = "__kvcanary_not_offered__"


def _not_offered(method: Method) -> Method:
    """Marks an optional method whose default is "not offered": an engine that leaves it out
    offers nothing there, and `optional` gives None for it (the harness falls back as the
    method's docstring says)."""
    setattr(method, _NOT_OFFERED, True)
    return method


class SlotZeroUnguarded(UserWarning):
    """Issued at attach to an engine that declares ``Capabilities(spare_slot=False)``: the tokens its
    pools hold at slot 0 (block 0 of a block table) are not guarded."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine has, declared by its adapter (`EngineUnderTest.capabilities`): a stock
    example, a kv_perturb mode or a soak configuration that needs something an engine lacks skips,
    naming the field, instead of failing. The defaults are what an engine that declares nothing is
    taken to have (`capabilities_of` derives most of them from the optional members it offers).

    prefix_cache: a later request reuses the KV a finished one left (the examples that expect
    reuse). cache_walk: `cache_walk()` lists what the cache holds (the sweep; real_kv_unused_cache).
    concurrent: one forward may batch several requests (max_batch > 1). feed_token: `feed_token`
    is offered (next_token_swap). host_tier: `host_tier` is offered (real_kv_host). spare_slot: slot 0 of every pool (or block 0 of a block
    table) is a spare the engine never stores a token in; an engine without one declares False: the
    canary then checks no sentinel there and still skips it, so the tokens it holds go unguarded,
    which attaching says (`SlotZeroUnguarded`); allotting a spare guards every token
    (docs/adapters.md).

    Prefill/decode and parallel ranks are declared by the hooks that build them
    (`pytest_kvcanary_make_pd_pair`, the built-in engines' shards): kv_pd and kv_parallel skip,
    naming the hook, where none does.
    """

    prefix_cache: bool = True
    cache_walk: bool = True
    concurrent: bool = True
    feed_token: bool = False
    host_tier: bool = False
    spare_slot: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"Capabilities.{f.name} must be True or False; got {getattr(self, f.name)!r}")

    def missing(self, *names: str) -> list[str]:
        """The named capabilities this engine lacks, in the order given."""
        for name in names:
            if name not in {f.name for f in fields(self)}:
                raise ValueError(f"no capability {name!r}; capabilities: {', '.join(f.name for f in fields(self))}")
        return [name for name in names if not getattr(self, name)]

# Called with (group, slots of that group's mapping space, cause) whenever slots stop holding their
# data, before they are released. For a group mapped through full_to_group the slots are FULL slots.
# Never for a SCALES group: its rows are layers, which no request holds or frees.
FreeListener = Callable[[GroupKind, "torch.Tensor", str], None]


class HostTierListener(Protocol):
    """Hears what a host-memory tier does with KV pages (the canary's records travel with the
    bytes; the fault ledger follows damage). Per pool group: slots in the group's mapping space
    (as a FreeListener's), host slots in the group's `HostPool`, CPU int64, position by position.
    Each call comes on the stream the tier copies on, once its KV copies are launched, so work a
    listener launches there is ordered with them."""

    def written_back(self, kind: GroupKind, slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """These slots' KV is copied to these host slots; before the slots' frees are announced."""

    def loaded_back(self, kind: GroupKind, host_slots: torch.Tensor, slots: torch.Tensor) -> None:
        """These host slots' KV is copied to these slots, before any forward reads them (the
        engine makes its next forward wait for the copies)."""

    def host_freed(self, kind: GroupKind, host_slots: torch.Tensor, cause: str) -> None:
        """These host slots no longer hold their data (cause: why)."""


class HostTier(Protocol):
    """A host-memory tier behind the prefix cache (SGLang's HiCache, one host level): pages the
    cache evicts are written back to host memory and loaded back on a later hit. pools: its
    buffers per pool group it keeps (`HostPool`)."""

    pools: Sequence[HostPool]

    def add_listener(self, listener: HostTierListener) -> None:
        """listener hears every write-back, load-back and host free from now on."""

    def synchronize(self) -> None:
        """Wait until every copy launched so far has landed: host memory may then be read or
        written from the CPU."""


class GuardedEngine(Protocol):
    """What an engine exposes to the canary runtime (and to the fault injector and the sweep)."""

    def canary_groups(self) -> Sequence[PoolGroup]:
        """The pools to guard, FULL first. Called once, when the runtime attaches; the tensors
        must stay the same objects for the engine's life (the runtime keeps views of them)."""
        ...

    def canary_capacities(self) -> Capacities:
        """The largest forward; called once, when the runtime attaches."""
        ...

    def cache_walk(self) -> CacheWalk | PagedWalk | None:
        """A snapshot of the prefix cache for the sweep, or None when the engine has none. Called
        by the runtime between forwards (end_forward); slots stay valid until the next forward.
        Build it on the host (CPU tensors): the sweep checks and plans a host walk without
        synchronising with the device. Return the same object again while the cache is
        unchanged, or a walk whose columns but ``locked`` are the very tensors of the last one
        while only the locks changed (never change a tensor in place): the sweep then skips
        checking and planning (an unlocked-only sweep plans again when ``locked`` changed). A
        paged engine may return a `PagedWalk` it updates in place instead: the sweep checks and
        plans it again when its version changed, page by page on the host and slot by slot on the
        device."""
        ...

    @_not_offered
    def add_free_listener(self, listener: FreeListener) -> None:
        """Optional: from now on, `listener(group, slots, cause)` hears every free, before the slots
        are released, so the fault ledger can say why an injected fault was never read. Not offered
        by default: the engine does not announce frees (a damaged slot written again is then
        reported as overwritten)."""
        raise NotImplementedError

    @_not_offered
    def feed_token(self, view: ForwardView, index: int, token: int) -> None:
        """Optional: make the forward about to run embed `token` at view token `index` (the last
        token of its batch row) instead of the one it was to be fed: write it where the forward
        will read it, and into view.input_ids when they are a copy already made. Called from a
        forward observer in before_forward (before HEAD, eager forwards only), by the fault
        injector's next_token_swap, on forwards whose view has a token_table (the token the engine
        believes each position holds). Not offered by default: next_token_swap skips on this
        engine, naming the capability."""
        raise NotImplementedError

    # Optional data member: the engine's host-memory tier, when it has one (None, the default:
    # none). The runtime then keeps the records of the pages it holds beside them (written back
    # and loaded back with the bytes), so the HEAD of the first forward that reads a loaded-back
    # page verifies it; the fault injector can damage pages while they are there (real_kv_host).
    host_tier: HostTier | None = None

    def checkpoint_walk(self) -> CheckpointWalk | None:
        """Optional: the recurrent-state checkpoints the prefix cache holds (an engine with a STATE
        group), which the sweep verifies with the rest of the cache; called when cache_walk is.
        None (the default): the cache holds none."""
        return None


class ForwardHooks(Protocol):
    """What an engine calls around each forward, in the order of the module docstring (the
    CanaryRuntime is one)."""

    def before_forward(self, view: ForwardView) -> None:
        """Before the forward reads KV; the batch's slots are in the mapping. Device work only."""

    def kv_stored(self, kind: GroupKind, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Optional write-through, inside the forward at the KV-store point of ``layer`` (an index
        into the group's k_layers for k, into its v_layers for v): the K and V rows the forward computed for its
        tokens (either may be None: that half is not reported here), shaped ``[T, ...]`` in view
        token order, any strides (only the layers the canary samples are copied, and only when
        not contiguous past dim 0). TAIL then checks each written slot holds exactly that.
        Device work only."""

    def indices_selected(self, view: ForwardView, layer: int) -> None:
        """With an INDEXER group, inside the forward: sparse layer ``layer`` (an index into the
        group's k_layers) wrote its tokens' KV and indexer keys, its indexer filled
        ``view.selected`` (`SelectedInputs`), and its attention has not read them yet. SELECT
        checks every selected entry against the query's own row. Device work only."""

    def after_forward(self, view: ForwardView) -> None:
        """After the forward wrote its KV, before its samples are used. Device work only."""

    def states_copied(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The engine copied the recurrent state of STATE slots ``src`` to slots ``dst`` (int64
        [n] on its device; a checkpoint saved or restored, or ``src`` 0: ``dst`` cleared to the
        initial, all-zero state that reserved slot 0 holds), between forwards, once the copies are
        launched on the stream the forwards run on. The records follow the bytes, so the HEAD of
        the next forward that reads ``dst`` checks the state against its row's prefix. Device work
        only."""

    def end_forward(self, device_work: Callable[[], ContextManager[None]] = nullcontext) -> None:
        """Once per forward, after after_forward (eager) or after the graph replay; host side. The
        device work it launches now and then (a sweep, a log snapshot) runs inside device_work()
        (an engine that computes on a stream of its own passes what orders that work with it). It
        may be called as soon as the forward is launched, before the engine waits for its outputs:
        its host work (the walk, a sweep's plan, a log poll) then overlaps the device's forward."""


# The name GuardedEngine had before round five ("host" now means CPU memory only); kept so the
# imports documented before keep working.
CanaryHost = GuardedEngine


class EngineUnderTest(GuardedEngine, Protocol):
    """An engine the kv fixtures can drive. `pytest_kvcanary_make_engine` returns one."""

    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        """The engine calls the hooks around each forward in the order of the module docstring:
        before_forward(view) once the batch's slots are mapped and before the forward reads KV,
        kv_stored(...) at its KV-store point if it offers write-through, after_forward(view)
        once the forward wrote its K/V, end_forward() outside any CUDA graph. None detaches."""
        ...

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy output ids per prompt (a sequence of prompts, never one bare string), running
        until every request is done. An engine with per-request contexts also takes
        context_keys=[one int per prompt] (0 = none)."""
        ...

    def reset(self) -> None:
        """Drop every request and flush the prefix cache."""
        ...

    # Optional data member: False where the engine runs without a prefix cache, so a test expects
    # reuse only where it can happen (True, the default: it has one).
    prefix_caching: bool = True

    # Optional data member: True where the model sends each token to some of its experts (a mixture
    # of experts). Below float32 a router's near tie can go one way in a decode and the other in a
    # recomputation, moving a logit by far more than rounding; the soak's oracle allows for it.
    routed_experts: bool = False

    def request_at(self, row: int, step: int) -> tuple[str, str] | None:
        """Optional: the (request id, prompt text) that held mapping row `row` at forward `step`
        since the last reset, or None; a failure report then names the request beside the row.
        The default knows no request; `RowOwners` keeps what an engine needs to answer it."""
        return None

    def finished_requests(self) -> int | None:
        """Optional: how many requests finished since the last reset, or None where the engine
        cannot tell (the default); the progress line of a long generation shows it."""
        return None

    @_not_offered
    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """Optional: output ids per arrival, greedy: requests submitted while others run
        (`Arrival.at_forward`) and aborted mid-run (`Arrival.abort_after`), running until every
        one is done or aborted. Not offered by default: the workload soak submits each wave with
        `generate`."""
        raise NotImplementedError

    @_not_offered
    def score_uncached(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TokenScores]:
        """Optional: one `TokenScores` per (prompt ids, output ids) request: what greedy decoding
        picks after each prefix of its output without reading any cached KV (no prefix reuse: a
        recomputation from the tokens), one forward per request or fewer; an engine with contexts
        also takes context_keys=[one int per request]. The workload soak's oracle, called between
        its rounds: it may run forwards of the engine, which the canary checks too. Not offered by
        default: the soak generates each request alone after a reset instead, comparing outputs
        exactly."""
        raise NotImplementedError

    def engine_defects(self) -> list[EngineDefect]:
        """Optional: the documented defects of the engine itself the adapter saw since the last
        reset (`EngineDefect`): the workload soak tells the violations they explain apart from
        suspected false alarms. The default: none known."""
        return []

    def liveness(self) -> Mapping[str, int]:
        """Optional: what the engine's workloads exercised since it started, by counter: the
        workload soak's liveness gate reads "prefix hits" (requests admitted with a cached prefix)
        and fails a soak that left it unmoved on an engine with a prefix cache. The default: nothing
        counted ({}), and the gate checks nothing it cannot count."""
        return {}

    def capabilities(self) -> Capabilities:
        """Optional: what the engine has (`Capabilities`). The default derives it from the optional
        members the engine offers (`capabilities_of`): prefix_cache from `prefix_caching`,
        cache_walk likewise, feed_token and host_tier from those members. Declare it where the
        derivation is wrong for your engine (no cache walk, one request per forward, no spare
        slot, a PD pair or parallel ranks), e.g. ``return replace(capabilities_of(self, derive_only=True),
        concurrent=False)``."""
        return capabilities_of(self, derive_only=True)


class RowOwners(Generic[Owner]):
    """Which request held each mapping row from which forward on, since the last `clear`: what
    an engine keeps to answer `request_at`."""

    def __init__(self) -> None:
        self._rows: dict[int, list[tuple[int, Owner]]] = {}

    def note(self, row: int, step: int, owner: Owner) -> None:
        """`owner` holds `row` from forward `step` on (noting the current holder again changes nothing)."""
        held = self._rows.setdefault(row, [])
        if not held or held[-1][1] is not owner:
            held.append((step, owner))

    def at(self, row: int, step: int) -> Owner | None:
        """The owner of `row` at forward `step`, or None."""
        owner = None
        for first, candidate in self._rows.get(row, []):
            if first > step:
                break
            owner = candidate
        return owner

    def clear(self) -> None:
        self._rows.clear()


# Called with (prefill FULL slots, decode FULL slots) of one transferred prompt, position by
# position, once its KV landed on the decode side and before the decode side's next forward.
TransferListener = Callable[["torch.Tensor", "torch.Tensor"], None]


@runtime_checkable
class PrefillDecodePair(Protocol):
    """Two engines of one model with a KV transfer between them: what kv_pd drives.
    `pytest_kvcanary_make_pd_pair` returns one; the reference pair is reference_engine/pd.py's PDPair.

    prefill / decode: the two EngineUnderTest. generate: greedy output ids per prompt (and
    context_keys, as for EngineUnderTest.generate); each prompt is prefilled on `prefill`, its KV
    transferred, and decoded on `decode`.
    add_transfer_listener: the listener hears every transfer (the harness moves the canary
    records of the transferred slots with the KV there, so the decode side's first read
    re-verifies the whole transferred prefix).
    Optional, for engines with a STATE group: add_state_transfer_listener(listener), where the
    listener hears (prefill state slots, decode state slots) of every request's recurrent state
    moved with its KV, once the copy is launched and before the decode side's next forward.
    """

    prefill: EngineUnderTest
    decode: EngineUnderTest

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    def add_transfer_listener(self, listener: TransferListener) -> None: ...


class UnsupportedAttention(LookupError):
    """An engine factory raises it for an attention kind its engine lacks (transformers has no
    latent pool for mla); tests of that kind skip with this message, which names the engine."""


OPTIONAL_MEMBERS = ("add_free_listener", "feed_token", "host_tier", "checkpoint_walk", "prefix_caching",
                    "routed_experts", "request_at",
                    "finished_requests", "serve", "score_uncached", "engine_defects", "liveness", "capabilities")


def _required_methods() -> tuple[str, ...]:
    """EngineUnderTest's methods, in declaration order (GuardedEngine's first), less the optional."""
    protocols = [c for c in reversed(EngineUnderTest.__mro__) if getattr(c, "_is_protocol", False) and c is not Protocol]
    return tuple(name for cls in protocols for name, member in vars(cls).items()
                 if inspect.isfunction(member) and not name.startswith("_") and name not in OPTIONAL_MEMBERS)


REQUIRED_METHODS = _required_methods()


def missing_methods(engine: object) -> list[str]:
    """The methods EngineUnderTest requires that `engine` lacks (not callable), in REQUIRED_METHODS order."""
    return [name for name in REQUIRED_METHODS if not callable(getattr(engine, name, None))]


def optional(engine: object, name: str) -> Any:
    """The engine's optional member `name` (one of OPTIONAL_MEMBERS), else the default declared
    on the protocol: a method bound to the engine, None for a method not offered by default, or
    the data member's default value. An engine that subclasses the protocol and leaves the member
    out gets the default too."""
    if name not in OPTIONAL_MEMBERS:
        raise ValueError(f"name must be one of {', '.join(OPTIONAL_MEMBERS)}; got {name!r}")
    default = inspect.getattr_static(EngineUnderTest, name)
    if hasattr(engine, name) and inspect.getattr_static(engine, name, None) is not default:
        return getattr(engine, name)
    if getattr(default, _NOT_OFFERED, False):
        return None
    return default.__get__(engine, type(engine)) if inspect.isfunction(default) else default


def capabilities_of(engine: object, *, derive_only: bool = False) -> Capabilities:
    """The engine's `Capabilities`: what its `capabilities()` declares, else (or with derive_only)
    what its optional members imply. A declaration that is not a Capabilities is an adapter bug,
    raised as a TypeError naming the engine."""
    declared = getattr(engine, "capabilities", None)
    if not derive_only and callable(declared):
        caps = declared()
        if not isinstance(caps, Capabilities):
            raise TypeError(f"{type(engine).__name__}.capabilities() must return a Capabilities; got {caps!r}")
        return caps
    prefix = bool(optional(engine, "prefix_caching"))
    return Capabilities(prefix_cache=prefix, cache_walk=prefix,
                        feed_token=optional(engine, "feed_token") is not None,
                        host_tier=optional(engine, "host_tier") is not None)
