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
        self.swept = [0] * NUM_TAGS  # sweep launches

    def sweep(self, tags: Iterable[int]) -> None:
        for tag in tags:
            self.swept[tag] += 1

    def reset(self) -> None:
        self.swept = [0] * NUM_TAGS

    def expected(self, forwards: int) -> list[int]:
        """Launches each tag's kernel-run counter must have counted after `forwards` forwards."""
        return [swept + forwards * self.per_forward[tag] for tag, swept in enumerate(self.swept)]

    def problems(self, ring: ViolationRing, forwards: int) -> list[str]:
        """Why the canary is not healthy after `forwards` forwards (empty when it is); call between
        forwards (syncs)."""
        ran, expected = ring.kernel_runs.tolist(), self.expected(forwards)
        return [f"{tag_name(tag)} ran {ran[tag]} of {expected[tag]} launches"
                for tag in range(NUM_TAGS) if ran[tag] != expected[tag]]
