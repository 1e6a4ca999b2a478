"""CanaryRuntime: the engine-agnostic canary. An engine calls before_forward / after_forward."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from kvcanary_kernels import (
    RealDataMode,
    ViolationRing,
    stamp_records,
    stamp_records_ref,
    verify_records,
    verify_records_ref,
)
from kvcanary_kernels.records import Half, Phase, launch_tag

from ..config import CanaryConfig
from .groups import GroupState
from .health import CanaryStats, KvCanaryHealthError, LaunchCounter
from .host import CanaryHost, ForwardView
from .log import ViolationLog
from .plans import sweep_entries, verify_entries, write_entries


class ForwardObserver(Protocol):
    """Something that acts at the canary's two points of a forward (the fault injector)."""

    def before_forward(self, view: ForwardView) -> None:
        """Before HEAD verifies the slots this forward reads."""

    def after_stamp(self, view: ForwardView) -> None:
        """After TAIL stamped the slots this forward wrote, before the sweep and the log pump."""


# The Triton kernels (compiled on a GPU, interpreted on a CPU) or their pure-torch references,
# which compute bit-identical records and rows; tests that sweep many seeds on a CPU use the latter.
KERNEL_BACKENDS = {"triton": (stamp_records, verify_records), "torch": (stamp_records_ref, verify_records_ref)}


class CanaryRuntime:
    """Guards one engine's KV pools.

    Call order per forward: before_forward(view) once the batch's slots are allocated and mapped
    (HEAD: verify every prefix slot the forward will read), the forward, after_forward(view) (TAIL:
    stamp the written slots; every sweep_interval forwards SWEEP the radix cache; pump the log).
    In raise mode after_forward raises KvCanaryViolationError when new violations appeared.
    Observers run before HEAD and after TAIL, in the order added.
    """

    def __init__(
        self,
        config: CanaryConfig,
        host: CanaryHost,
        *,
        side: str = "single",
        device: torch.device | str | None = None,
        jsonl_path: Path | None = None,
        kernels: str = "triton",
    ) -> None:
        if kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_BACKENDS)}; got {kernels!r}")
        self._stamp_fn, self._verify_fn = KERNEL_BACKENDS[kernels]
        self.config = config
        self.host = host
        self.side = side
        pools = list(host.canary_groups())
        self.device = torch.device(device) if device is not None else pools[0].k_layers[0].device
        mode = RealDataMode.parse(config.real_data)
        self.groups = [GroupState.create(pool, mode, self.device) for pool in pools]
        self.ring = ViolationRing(config.ring_capacity, self.device)
        self.log = ViolationLog(self.ring, side, config.mode, jsonl_path)
        self.launches = LaunchCounter()
        self.forwards = 0
        self.sweeps = 0
        self.observers: list[ForwardObserver] = []

    def before_forward(self, view: ForwardView) -> None:
        for observer in self.observers:
            observer.before_forward(view)
        req_to_token = self.host.req_to_token()
        for group in self.groups:
            entries = verify_entries(view, req_to_token, group)
            self._verify(group, entries, Phase.HEAD)

    def after_forward(self, view: ForwardView) -> None:
        req_to_token = self.host.req_to_token()
        for group in self.groups:
            entries = write_entries(view, req_to_token, group)
            for half in Half:
                tag = launch_tag(Phase.TAIL, half, group.pool.kind)
                self._stamp_fn(group.records[half], entries, group.sources[half], self.ring, tag,
                              check_tokens=self.config.check_tokens,
                              check_write_inputs=self.config.check_write_inputs)
                self.launches.record(tag)
        for observer in self.observers:
            observer.after_stamp(view)
        self.forwards += 1
        if self.config.sweep_interval and self.forwards % self.config.sweep_interval == 0:
            self.sweep()
        self.ring.advance_step()
        self.log.pump()

    def sweep(self, *, unlocked_only: bool = False) -> bool:
        """Verify every slot the host's radix cache holds. False when the host has no radix cache."""
        walk = self.host.radix_walk()
        if walk is None:
            return False
        for group in self.groups:
            self._verify(group, sweep_entries(walk, group, unlocked_only=unlocked_only), Phase.SWEEP)
        self.sweeps += 1
        return True

    def _verify(self, group: GroupState, entries, phase: Phase) -> None:
        for half in Half:
            tag = launch_tag(phase, half, group.pool.kind)
            self._verify_fn(group.records[half], entries, group.sources[half], self.ring, tag,
                           check_tokens=self.config.check_tokens)
            self.launches.record(tag)

    def export_records(self, full_slots: torch.Tensor) -> list[dict[Half, torch.Tensor]]:
        """The records of these FULL slots, per group (FULL first) and half: ``[n, RECORD_WIDTH]``
        on the records' device, zero rows where a slot is not resident in the group. What a KV
        transfer sends along with the slots' KV."""
        out = []
        for group in self.groups:
            slots = group.to_group_slots(full_slots.to(group.device))
            resident = (slots != 0)[:, None]
            out.append({half: torch.where(resident, rec[slots], 0) for half, rec in group.records.items()})
        return out

    def import_records(self, full_slots: torch.Tensor, records: list[dict[Half, torch.Tensor]]) -> None:
        """Write exported records (any device) to these FULL slots of this engine, per group; slots
        not resident in a group are skipped there. Call before the forward that reads them."""
        for group, halves in zip(self.groups, records, strict=True):
            slots = group.to_group_slots(full_slots.to(group.device))
            keep = slots != 0
            for half, rec in group.records.items():
                rec[slots[keep]] = halves[half].to(group.device)[keep]

    def health_problems(self) -> list[str]:
        return self.launches.problems(self.ring, self.forwards)

    def check_health(self) -> None:
        problems = self.health_problems()
        if problems:
            raise KvCanaryHealthError(f"kv-canary on {self.side}: " + "; ".join(problems))

    def stats(self) -> CanaryStats:
        stamped = [launch_tag(Phase.TAIL, Half.K, g.pool.kind) for g in self.groups]
        protected = int(self.ring.slot_runs[stamped].sum().item())
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
        self.log.clear()
        self.launches.reset()
        self.forwards = self.sweeps = 0
