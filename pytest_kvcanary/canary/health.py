"""Run statistics and the kernel-run-counter health check."""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary_kernels import ViolationRing
from kvcanary_kernels.records import NUM_TAGS, Phase, split_tag, tag_name


class KvCanaryHealthError(RuntimeError):
    """An active launch tag stopped running: the canary is no longer guarding what it claims."""


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
    """Host-side count of launches per tag, checked against the device's kernel-run counters."""

    def __init__(self) -> None:
        self.launched = [0] * NUM_TAGS

    def record(self, tag: int) -> None:
        self.launched[tag] += 1

    def reset(self) -> None:
        self.launched = [0] * NUM_TAGS

    def problems(self, ring: ViolationRing, forwards: int) -> list[str]:
        """Why the canary is not healthy (empty when it is); call between forwards.

        Every launch the runtime made must have run on the device, and every HEAD/TAIL tag that
        ever ran must have run once per forward: a HEAD that lags means before_forward was skipped
        for some forwards (the engine reads KV the canary never checked)."""
        ran = ring.kernel_runs.tolist()
        out = []
        for tag in range(NUM_TAGS):
            if ran[tag] != self.launched[tag]:
                out.append(f"{tag_name(tag)} ran {ran[tag]} of {self.launched[tag]} launches")
            phase = split_tag(tag)[0]
            if phase is not Phase.SWEEP and 0 < self.launched[tag] != forwards:
                out.append(f"{tag_name(tag)} ran in {self.launched[tag]} of {forwards} forwards")
        return out
