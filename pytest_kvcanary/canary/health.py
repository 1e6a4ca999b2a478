"""Run statistics and the kernel-run-counter health check."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from kvcanary_kernels import ViolationRing
from kvcanary_kernels.records import NUM_TAGS, tag_name


class KvCanaryHealthError(RuntimeError):
    """A launch the canary counts on did not run: it is no longer guarding what it claims."""


@dataclass(frozen=True)
class CanaryStats:
    """violations: distinct violations reported; rows: every row the kernels logged (a damaged
    slot is seen again by each later read); dropped: rows lost past the ring capacity."""

    forwards: int
    protected_tokens: int
    sweeps: int
    violations: int
    rows: int
    dropped: int
    health: str


class LaunchCounter:
    """What the device's kernel-run counters must read, from what the host knows happened.

    Every forward the engine reports (end_forward) must have run each per-forward launch exactly
    once, whether the launches were made eagerly or replayed from a CUDA graph; every sweep its
    sweep launches. A HEAD that lags means before_forward was skipped for some forward (the engine
    read KV the canary never checked)."""

    def __init__(self, per_forward: Iterable[int]) -> None:
        self.per_forward = Counter(per_forward)
        self.expected = [0] * NUM_TAGS

    def forward(self) -> None:
        for tag, n in self.per_forward.items():
            self.expected[tag] += n

    def sweep(self, tags: Iterable[int]) -> None:
        for tag in tags:
            self.expected[tag] += 1

    def reset(self) -> None:
        self.expected = [0] * NUM_TAGS

    def problems(self, ring: ViolationRing) -> list[str]:
        """Why the canary is not healthy (empty when it is); call between forwards (syncs)."""
        ran = ring.kernel_runs.tolist()
        return [f"{tag_name(tag)} ran {ran[tag]} of {self.expected[tag]} launches"
                for tag in range(NUM_TAGS) if ran[tag] != self.expected[tag]]
