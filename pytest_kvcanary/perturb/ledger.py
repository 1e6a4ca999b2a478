"""The fault ledger: every injection, and whether the canary saw it.

Status: "detected" (a violation of the expected kind names the injected slot, or the slot it was
moved to), "latent" (the slot is still live and nobody has read it yet), "escaped" (the slot was
freed or overwritten before any read; `cause` says how).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..canary.violation import Violation

# Which reasons count as detecting each mode.
DETECTING_REASONS = {
    "req_to_token": ("verify_position", "verify_chain_hash", "verify_token"),
    "real_kv_used": ("verify_real_kv_hash",),
    "real_kv_unused_cache": ("verify_real_kv_hash",),
    "real_kv_post_forward": ("verify_real_kv_hash",),
}


@dataclass
class Injection:
    """One injected fault. slot is in the target group's pool; row is the request row (-1 when
    only the radix cache held the slot); byte is the flipped byte offset within the slot (-1 for
    req_to_token, whose damage is the mapping itself); step is the engine's forward index."""

    mode: str
    side: str
    group: str
    slot: int
    position: int
    row: int
    byte: int
    step: int
    half: str | None = None
    status: str = "latent"
    cause: str = ""
    detected_by: Violation | None = None
    # Where a transfer moved the slot: (side, slot) pairs a detection may name instead.
    moved_to: list[tuple[str, int]] = field(default_factory=list)

    def places(self) -> list[tuple[str, int]]:
        return [(self.side, self.slot), *self.moved_to]

    def matches(self, v: Violation) -> bool:
        if v.group.lower() != self.group or not set(v.reasons) & set(DETECTING_REASONS[self.mode]):
            return False
        if self.half is not None and v.half != self.half:
            return False
        if (v.side, v.slot) in self.places():
            return v.side != self.side or v.step >= self.step
        # A wrong mapping entry is reported at the row and position it corrupted.
        return self.mode == "req_to_token" and (v.side, v.row, v.position) == (self.side, self.row, self.position)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["detected_by"] = self.detected_by.to_json() if self.detected_by else None
        return d

    def describe(self) -> str:
        where = f"{self.side} {self.group} slot={self.slot} pos={self.position} row={self.row}"
        extra = f" ({self.cause})" if self.cause else ""
        return f"{self.mode} @ step {self.step} [{where} byte={self.byte}] -> {self.status}{extra}"


class Ledger:
    """Injections of one run, matched against the violations the canary reported."""

    def __init__(self) -> None:
        self.injections: list[Injection] = []

    def record(self, injection: Injection) -> None:
        self.injections.append(injection)

    def match(self, violations: list[Violation]) -> None:
        """Mark every still-open injection that a violation names as detected."""
        for inj in self.injections:
            if inj.status == "detected":
                continue
            hit = next((v for v in violations if inj.matches(v)), None)
            if hit is not None:
                inj.status, inj.cause, inj.detected_by = "detected", "", hit

    def escape(self, side: str, slots: set[int], cause: str) -> None:
        """Undetected injections on these slots lost their damage: freed or overwritten unread."""
        for inj in self.injections:
            if inj.status == "latent" and any(s == side and sl in slots for s, sl in inj.places()):
                inj.status, inj.cause = "escaped", cause

    def clear(self) -> None:
        self.injections.clear()
