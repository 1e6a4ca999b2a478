"""CanaryRuntime: the engine-agnostic canary. An engine calls it around each forward (see seam.py
for the call order); everything it does per forward is device work on buffers sized at attach."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Callable, ContextManager, Protocol

import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import GroupKind, Half, Phase, launch_tag

from ..config import CanaryConfig
from .groups import GroupState
from .health import CanaryStats, KvCanaryHealthError, LaunchCounter
from .host_records import HostRecords
from .launch_replay import LaunchReplay, buffers_key
from .seam import GuardedEngine, ForwardView, SlotZeroUnguarded, capabilities_of, optional
from .scales import ScaleGuard
from .state import StateGuard
from .log import ViolationLog
from .plans import SweepPlan
from .readout import RuntimeReadout
from .violation import Violation


def view_tensors(view: ForwardView) -> list[torch.Tensor | None]:
    """Every tensor of a view, its groups' inputs included, in a fixed order."""
    tensors = [view.rows, view.prefix_lens, view.extend_lens, view.input_ids, view.positions,
               view.token_table, view.context_keys]
    for kind in sorted(view.group_inputs or ()):
        tensors.extend(view.group_inputs[kind])
    if view.state is not None:
        tensors.extend(view.state)
    if view.scales is not None:
        tensors.extend(view.scales)
    if view.selected is not None:
        tensors.extend(view.selected)
    return tensors


class ForwardObserver(Protocol):
    """Something that acts at the canary's two points of an eager forward (the fault injector).
    Observers may synchronise with the device; they are not called while a CUDA graph is being
    captured."""

    def before_forward(self, view: ForwardView) -> None:
        """Before HEAD verifies the slots this forward reads."""

    def after_stamp(self, view: ForwardView) -> None:
        """After TAIL stamped the slots this forward wrote."""

    def states_copied(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """After the engine copied recurrent states (and the runtime their records)."""

    def indices_selected(self, view: ForwardView, layer: int) -> None:
        """After a sparse layer's indexer filled view.selected, before SELECT checks it."""


class KernelSet:
    """The launch functions: Triton kernels (compiled on a GPU, interpreted on a CPU) or their
    pure-torch references, which compute bit-identical records and rows (tests that sweep many
    seeds on a CPU use the latter), as CanaryConfig.kernels names them."""

    def __init__(self, name: str) -> None:
        suffix = {"triton": "", "torch": "_ref"}[name]  # CanaryConfig checked the name
        self.verify_view_parts: Callable = getattr(K, "verify_view_parts" + suffix)
        self.stamp_view_parts: Callable = getattr(K, "stamp_view_parts" + suffix)
        self.verify_records: Callable = getattr(K, "verify_records" + suffix)
        self.state_launch: Callable = getattr(K, "state_launch" + suffix)
        self.verify_scales: Callable = getattr(K, "verify_scales" + suffix)
        self.verify_selected: Callable = getattr(K, "verify_selected" + suffix)
        self.source_hash_rows_parts: Callable = getattr(K, "source_hash_rows_parts" + suffix)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class CanaryRuntime:
    """Guards one engine's KV pools. Observers run before HEAD and after TAIL, in the order added;
    the callables in `on_end_forward` at every end_forward (replayed forwards too). In raise mode,
    end_forward (every drain_interval forwards) and drain() raise KvCanaryViolationError when new
    violations appeared. host_records: the records of the pages the engine's host tier holds (None
    without one), moved with the bytes. groups: the KV groups (FULL first); state: the STATE
    group's canary (canary/state.py), None without one; scales: the SCALES group's
    (canary/scales.py), None without one; indexer: the INDEXER group (one of ``groups``, guarded as
    the FULL group is), whose selections SELECT checks, None without one."""

    def __init__(
        self,
        config: CanaryConfig,
        host: GuardedEngine,
        *,
        side: str = "single",
        device: torch.device | str | None = None,
        jsonl_path: Path | None = None,
    ) -> None:
        self.kernels = KernelSet(config.kernels)
        self.config = config
        self.host = host
        self.side = side
        pools = list(host.canary_groups())
        self.capacities = host.canary_capacities()
        self.device = torch.device(device) if device is not None else pools[0].k_layers[0].device
        if config.kernels == "triton" and self.device.type == "cpu" and not K.interpreted():
            raise ValueError(
                f"CanaryConfig.kernels is 'triton' and {type(host).__name__}'s KV is on the CPU, where Triton runs "
                f"the kernels only in its interpreter: set TRITON_INTERPRET=1 before triton is first imported "
                f"(pytest --kv-canary does on a CPU), or set kernels to 'torch' (allowed: 'triton', 'torch')")
        mode = K.RealDataMode(config.real_data)  # the one conversion (CanaryConfig checked it)
        self.groups = [GroupState.create(pool, mode, self.device, self.capacities, recheck=config.recheck)
                       for pool in pools if pool.kind not in (GroupKind.STATE, GroupKind.SCALES)]
        for group in self.groups:
            group.seal_reserved_slot()
        # Slot 0 holds no token: its bytes never change, and a read mapped there is a missing slot.
        self.sentinel = capabilities_of(host).spare_slot
        if not self.sentinel:
            warnings.warn(SlotZeroUnguarded(
                f"{type(host).__name__} declares spare_slot=False: the tokens its pools hold at slot 0 (block 0 of a "
                f"block table) are not guarded, and neither a sentinel nor a missing slot is checked there; allot "
                f"one slot the engine never stores a token in to guard every token "
                f"(docs/adapters.md#no-spare-slot)"), stacklevel=2)
        state = [GroupState.create(pool, mode, self.device, self.capacities, recheck=False)
                 for pool in pools if pool.kind is GroupKind.STATE]
        self.state = None if not state else StateGuard(state[0], self.groups[0], self.kernels.state_launch,
                                                         self.kernels.verify_records)
        scales = [pool for pool in pools if pool.kind is GroupKind.SCALES]
        self.scales = ScaleGuard(scales[0], self.kernels.verify_scales) if scales else None
        tier = optional(host, "host_tier")
        held = self.groups + ([] if self.state is None else [self.state.group])
        self.host_records = None if tier is None else HostRecords(held, tier)
        self.ring = K.ViolationRing(config.ring_capacity, self.device)
        self.log = ViolationLog(self.ring, side, config.mode, jsonl_path)
        phases = [Phase.HEAD, Phase.TAIL] + ([Phase.RECHECK] if config.recheck else [])
        state_tags = [] if self.state is None else self.state.per_forward_tags()
        scale_tags = [] if self.scales is None else self.scales.phase_tags(Phase.HEAD)
        self.indexer = next((g for g in self.groups if g.pool.kind is GroupKind.INDEXER), None)
        self._select_tag = launch_tag(Phase.SELECT, Half.K, GroupKind.INDEXER)
        select_tags = [] if self.indexer is None else [self._select_tag] * len(self.indexer.pool.k_layers)
        self.launches = LaunchCounter(self._tags(phases) + state_tags + scale_tags + select_tags)
        self.forwards = 0
        self.sweeps = 0
        self._sweep_plan: SweepPlan | None = None
        self._sweep_graph: torch.cuda.CUDAGraph | None = None
        self._swept = [g for g in self.groups if g.swept_by_walk()]  # the groups a cache walk reaches
        self._sweep_tags = self._tags([Phase.SWEEP], self._swept) + (
            [] if self.state is None else [self.state.tags[Phase.SWEEP]]) + (
            [] if self.scales is None else self.scales.phase_tags(Phase.SWEEP))
        full = self.groups[0]  # every token has a FULL-group slot; a walk names FULL slots
        self._walk_tag = launch_tag(Phase.SWEEP, next(iter(full.halves)), full.pool.kind)  # a malformed walk's rows
        self._one_device = self.device.type != "cuda" or torch.cuda.device_count() == 1
        self._replay = LaunchReplay(self.device, self.device.type == "cuda" and config.kernels == "triton")
        self.observers: list[ForwardObserver] = []
        self.on_end_forward: list[Callable[[], None]] = []

    def _tags(self, phases: list[Phase], groups: list[GroupState] | None = None) -> list[int]:
        return [launch_tag(phase, half, g.pool.kind)
                for g in (self.groups if groups is None else groups) for half in g.halves for phase in phases]

    def _on_device(self) -> ContextManager:
        """Kernels launch on the current CUDA device: make it the engine's for the launches (no
        device switch when it already is or there is one device: even asking which device is
        current costs microseconds of host time a call)."""
        if self._one_device or self.device.index in (None, torch.cuda.current_device()):
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def group(self, kind: GroupKind) -> GroupState:
        """The group of that kind, the STATE group included."""
        if kind is GroupKind.STATE and self.state is not None:
            return self.state.group
        return next(g for g in self.groups if g.pool.kind is kind)

    @property
    def group_kinds(self) -> list[GroupKind]:
        """Every guarded group's kind, FULL first, then STATE and SCALES."""
        return ([g.pool.kind for g in self.groups] + ([] if self.state is None else [GroupKind.STATE])
                + ([] if self.scales is None else [GroupKind.SCALES]))

    # ForwardHooks ---------------------------------------------------------------------------

    def before_forward(self, view: ForwardView) -> None:
        if self.observers and not _capturing():
            for observer in self.observers:
                observer.before_forward(view)
        with self._on_device():
            self._replay.run((Phase.HEAD, self._buffers_key(view)), lambda: self._launch_head(view))

    def _launch_head(self, view: ForwardView) -> None:
        self._verify_view(view, Phase.HEAD)
        if self.state is not None:
            self.state.verify(self._state_view(view), self.ring)
        if self.scales is not None:  # the scales this forward dequantizes with, before it reads KV
            self.scales.verify(view, self.ring)

    def _state_view(self, view: ForwardView) -> ForwardView:
        if view.state is None:
            raise ValueError("ForwardView.state is None: an engine with a STATE group names each forward's state "
                             "slots in the view (StateInputs)")
        return view

    def states_copied(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.state is None:
            raise ValueError("states_copied: this engine's canary_groups() has no STATE group")
        with self._on_device():
            self.state.copied(src, dst)
        for observer in self.observers:
            observer.states_copied(src, dst)

    def kv_stored(self, kind: GroupKind, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """The layer's halves that are sources hashed in one launch."""
        group, parts, stored = self.group(kind), [], []
        for half, rows in ((Half.K, k), (Half.V, v)):
            state = group.halves.get(half)
            if state is None or rows is None or layer not in state.source_layers:
                continue
            i = state.source_layers.index(layer)
            src = state.sources[i]
            offset, stride = src.row_read()  # the stored read, over the rows as the forward computed them
            parts.append(K.RowsPart(rows.contiguous(), src.read_bytes, state.stored_hashes[i][:rows.shape[0]],
                                    offset, stride))
            stored.append((state, i))
        if parts:
            with self._on_device():
                self.kernels.source_hash_rows_parts(parts)
        for state, i in stored:
            state.stored.add(i)

    def indices_selected(self, view: ForwardView, layer: int) -> None:
        """SELECT: every entry layer ``layer``'s indexer selected points at its query's own slot of a
        position the query sees (kvcanary_kernels/index_check.py), before the attention reads them."""
        if self.indexer is None:
            raise ValueError("indices_selected: this engine's canary_groups() has no INDEXER group")
        if self.observers and not _capturing():
            for observer in self.observers:
                observer.indices_selected(view, layer)
        with self._on_device():
            self.kernels.verify_selected(next(iter(self.indexer.halves.values())).records, self.groups[0].mapping,
                                         view, self.ring, self._select_tag)

    def after_forward(self, view: ForwardView) -> None:
        with self._on_device():
            self._recheck_and_stamp(view)
        if self.observers and not _capturing():
            for observer in self.observers:
                observer.after_stamp(view)
        self.ring.advance_step()
        self.log.note_forward()

    def _recheck_and_stamp(self, view: ForwardView) -> None:
        written = [state.take_stored_hashes() for group in self.groups for state in group.halves.values()]
        key = (Phase.TAIL, self._buffers_key(view), tuple(w is None for w in written))
        self._replay.run(key, lambda: self._launch_recheck_and_stamp(view, written))

    def _launch_recheck_and_stamp(self, view: ForwardView, written: list[torch.Tensor | None]) -> None:
        """RECHECK, then TAIL; ``written``: each half's write-through hashes (None: not handed
        over this forward), in the order of the groups and their halves."""
        if self.config.recheck:
            self._verify_view(view, Phase.RECHECK)
        hashes = iter(written)
        for group in self.groups:  # one stamp a group: its halves side by side
            self.kernels.stamp_view_parts(
                [K.StampPart(state.records, state.sources, launch_tag(Phase.TAIL, half, group.pool.kind), next(hashes))
                 for half, state in group.halves.items()],
                group.mapping, view.for_group(group.pool.kind), self.ring, check_tokens=self.config.check_tokens,
                check_write_inputs=self.config.check_write_inputs,
            )
        if self.state is not None:  # after the FULL group's TAIL: a state chains onto its last token's record
            self.state.stamp(self._state_view(view), self.ring)

    def _buffers_key(self, view: ForwardView) -> tuple:
        """The buffers a view launch takes that the runtime does not own (launch_replay.py)."""
        return buffers_key(view_tensors(view) + [t for g in self.groups
                                                 for t in (g.mapping.table, g.mapping.full_to_group)])

    def end_forward(self, device_work: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        self.forwards += 1
        for listener in self.on_end_forward:
            listener()
        sweeps = bool(self.config.sweep_interval) and self.forwards % self.config.sweep_interval == 0
        if self.config.drain_interval == 1:  # the debugging setting: every forward, synchronously
            with device_work():
                if sweeps:
                    self.sweep()
                self.log.drain()
            return
        if sweeps:
            with device_work():
                self.sweep()
        if self.forwards % self.config.drain_interval == 0:
            self.log.poll(device_work)

    def _verify_view(self, view: ForwardView, phase: Phase) -> None:
        """One launch a group: its halves side by side."""
        for group in self.groups:
            self.kernels.verify_view_parts(
                [K.ViewPart(state.records, state.sources, launch_tag(phase, half, group.pool.kind), state.read_hashes)
                 for half, state in group.halves.items()],
                group.mapping, view, self.ring, window=group.window, max_context=self.capacities.max_context,
                check_tokens=self.config.check_tokens, sentinel=self.sentinel, missing_at_zero=self.sentinel,
                after_forward=phase is Phase.RECHECK,
            )

    # Between forwards -------------------------------------------------------------------------

    def sweep(self, *, unlocked_only: bool = False) -> bool:
        """Verify every slot the host's prefix cache holds, in each group the walk reaches (FULL
        and groups mapped through full_to_group). A malformed walk is reported (walk.py) and its
        checkable entries swept; a walk the host returned before (its columns, or a paged walk's
        version, seam.py) is not checked or planned again (plans.SweepPlan). With the Triton
        kernels on a CUDA device the first sweep's launches run eagerly and are captured in a CUDA
        graph that later sweeps replay. False when the host has no prefix cache. It runs in
        inference mode wherever it is called from (an engine's forward loop may run in it, and the
        plan's buffers are made on the first sweep)."""
        walk = self.host.cache_walk()
        if walk is None:
            return False
        with self._on_device(), torch.inference_mode():
            if self._sweep_plan is None:
                self._sweep_plan = SweepPlan(self._swept, self.groups[0].pool.num_slots, self.device)
            plan = self._sweep_plan
            plan.refresh(walk, unlocked_only)
            if self.state is not None:
                self.state.plan_sweep(optional(self.host, "checkpoint_walk")())
            self.ring.append(plan.malformed, self._walk_tag)
            if self._sweep_graph is not None:
                self._sweep_graph.replay()
            else:
                self._launch_sweep(plan)
                if self.device.type == "cuda" and self.config.kernels == "triton" and not _capturing():
                    self._sweep_graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self._sweep_graph):  # captures; runs nothing
                        self._launch_sweep(plan)
        self.launches.sweep(self._sweep_tags)
        self.sweeps += 1
        return True

    def _launch_sweep(self, plan: SweepPlan) -> None:
        for group in plan.groups:
            for half, state in group.halves.items():
                self.kernels.verify_records(state.records, plan.entries[group.pool.kind], state.sources, self.ring,
                                            launch_tag(Phase.SWEEP, half, group.pool.kind),
                                            check_tokens=self.config.check_tokens)
        if self.state is not None:  # the checkpoints the prefix cache holds
            self.state.sweep(self.ring)
        if self.scales is not None:
            self.scales.sweep(self.ring)

    def drain(self) -> list[Violation]:
        """Move every row the device logged so far into `log` (synchronous); returns the new
        violations. Raise mode raises when there are any."""
        return self.log.drain()

    def export_records(self, full_slots: torch.Tensor) -> list[dict[Half, torch.Tensor]]:
        """The records of these FULL slots, per group (FULL first) and half: ``[n, RECORD_WIDTH]``
        on the records' device, zero rows where a slot is not resident in the group. What a KV
        transfer sends along with the slots' KV."""
        out = []
        for group in self.groups:
            slots = group.to_group_slots(full_slots.to(group.device))
            resident = (slots != 0)[:, None]
            out.append({half: torch.where(resident, s.records[slots], 0) for half, s in group.halves.items()})
        return out

    def import_records(self, full_slots: torch.Tensor, records: list[dict[Half, torch.Tensor]]) -> None:
        """Write exported records (any device) to these FULL slots of this engine, per group; slots
        not resident in a group are skipped there. Call before the forward that reads them."""
        for group, halves in zip(self.groups, records, strict=True):
            slots = group.to_group_slots(full_slots.to(group.device))
            keep = slots != 0
            for half, state in group.halves.items():
                state.records[slots[keep]] = halves[half].to(group.device)[keep]

    def health_problems(self) -> list[str]:
        return self.launches.problems(self.ring, self.forwards)

    def check_health(self) -> None:
        problems = self.health_problems()
        if problems:
            raise KvCanaryHealthError(f"kv-canary on {self.side}: " + "; ".join(problems))

    def stats(self) -> CanaryStats:
        self.drain()
        full = self.groups[0]  # every token has a FULL-group slot
        protected = int(self.ring.slot_runs[launch_tag(Phase.TAIL, next(iter(full.halves)), full.pool.kind)])
        problems = self.health_problems()
        return CanaryStats(
            forwards=self.forwards,
            protected_tokens=protected,
            sweeps=self.sweeps,
            violations=len(self.log.violations),
            rows=self.log.total,
            dropped=self.log.dropped,
            health="ok" if not problems else "; ".join(problems),
        )

    def reset(self) -> None:
        """Forget records, log and counters (the engine has flushed its caches)."""
        for group in self.groups:
            group.clear()
        if self.state is not None:
            self.state.clear()
        if self.host_records is not None:
            self.host_records.clear()
        self.log.clear()
        self.launches.reset()
        self.forwards = self.sweeps = 0
        self._sweep_plan = self._sweep_graph = None

    def readout(self) -> RuntimeReadout:
        """What callers outside the canary (the soak, the fault injector, tools) read of it: its
        groups' slots, bytes and counts, through the canary's own code (canary/readout.py). Valid
        for the runtime's life."""
        return RuntimeReadout(self.groups, self.state, self.host_records)
