"""Frozen configuration objects: what the canary does and which faults are injected.

Pure Python (no torch): the plugin builds these from CLI > marker > ini before any engine exists.
Not to be confused with settings.py (the run's options, resolved once, from which the plugin
builds these) or reference_engine/config.py (the reference engine's model and engine configuration).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvcanary_kernels.checks import check_int
from kvcanary_kernels.inputs import RealDataMode
from kvcanary_kernels.records import GroupKind

CANARY_MODES = ("off", "log", "raise")
REAL_DATA_MODES = tuple(mode.value for mode in RealDataMode)
PERTURB_MODES = ("req_to_token", "real_kv_used", "real_kv_unused_cache", "real_kv_post_forward", "next_token_swap",
                 "real_kv_host", "state_wrong_restore", "scale_corrupt", "scale_reset", "index_stale")
FLIP_MODES = tuple(mode for mode in PERTURB_MODES if mode.startswith("real_kv"))  # they flip real KV bytes
SCALE_MODES = tuple(mode for mode in PERTURB_MODES if mode.startswith("scale_"))  # they damage quantized KV's scales
SIDES = ("prefill", "decode")
TARGET_GROUPS = tuple(kind.label for kind in GroupKind)
ATTENTION_KINDS = ("mha", "swa", "mla", "hybrid", "sparse")
# How kv_pd's pair moves KV: both engines in the test's process, or each in a process of its own.
PD_TRANSPORTS = ("local", "processes")
KERNELS = ("triton", "torch")


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class CanaryConfig:
    """mode: off / log (warn and record) / raise (the engine raises on a violation).
    real_data: none / partial (first 16 bytes of each slot) / all. sweep_interval: forwards
    between radix sweeps, 0 = never. ring_capacity: violation rows kept (the total keeps
    counting). check_tokens: verify stored tokens against the engine's. check_write_inputs: log
    write_* reasons when a forward's tokens/positions disagree with the engine's bookkeeping.
    recheck: after each forward, verify its read set again (records, and the bytes of the deepest
    layer per half that the fingerprint samples, against what the check before the forward read),
    so damage done inside the forward is reported before its samples are used. drain_interval:
    forwards between asynchronous drains of the device log (1 = every forward, synchronously: for
    debugging); the log is also drained whenever it is read. kernels: what the runtime launches,
    triton (the Triton kernels) or torch (their pure-torch references, bit-identical: tests that
    sweep many seeds on a CPU use them)."""

    mode: str = "log"
    real_data: str = "partial"
    sweep_interval: int = 4
    ring_capacity: int = 4096
    check_tokens: bool = True
    check_write_inputs: bool = True
    recheck: bool = True
    drain_interval: int = 8
    kernels: str = "triton"

    def __post_init__(self) -> None:
        _choice("mode", self.mode, CANARY_MODES)
        _choice("real_data", self.real_data, REAL_DATA_MODES)
        _choice("kernels", self.kernels, KERNELS)
        check_int("sweep_interval", self.sweep_interval, 0)
        check_int("ring_capacity", self.ring_capacity, 1)
        check_int("drain_interval", self.drain_interval, 1)
        for name in ("check_tokens", "check_write_inputs", "recheck"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def with_overrides(self, **overrides: Any) -> "CanaryConfig":
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown canary setting {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        return replace(self, **overrides)


@dataclass(frozen=True)
class PerturbSpec:
    """One fault to inject. prob: chance per eligible forward; side: prefill / decode (PD only,
    None = every engine); target_group: the pool group damaged (required when the engine has
    several, but for next_token_swap, whose fed token lands in every group); warmup_steps:
    forwards to run clean first; rank: on a parallel engine, the one rank that injects (None =
    every rank)."""

    mode: str
    prob: float = 1.0
    side: str | None = None
    target_group: str | None = None
    warmup_steps: int = 0
    rank: int | None = None

    def __post_init__(self) -> None:
        _choice("kv_perturb mode", self.mode, PERTURB_MODES)
        if isinstance(self.prob, bool) or not isinstance(self.prob, (int, float)) or not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"prob must be a number in [0, 1]; got {self.prob!r}")
        if self.side is not None:
            _choice("side", self.side, SIDES)
        if self.target_group is not None:
            _choice("target_group", self.target_group, TARGET_GROUPS)
        check_int("warmup_steps", self.warmup_steps, 0)
        if self.rank is not None:
            check_int("rank", self.rank, 0)
