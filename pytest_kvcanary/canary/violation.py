"""A decoded violation: one row of the device log, as tests and reports see it (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    """side: engine that saw it ("single", "prefill", "decode"). step: forward index of that
    engine. phase: HEAD / TAIL / SWEEP; half: K / V; group: FULL / SWA. reasons: labels such as
    "verify_chain_hash", primary first. slot: slot in the group's pool; position: expected
    position; row: request row (-1 for sweep). stored / expected: the primary reason's values."""

    side: str
    step: int
    phase: str
    half: str
    group: str
    reasons: tuple[str, ...]
    slot: int
    position: int
    row: int
    stored: int
    expected: int

    @property
    def reason(self) -> str:
        return self.reasons[0]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Violation":
        return cls(**{**d, "reasons": tuple(d["reasons"])})

    def describe(self) -> str:
        return (
            f"[{self.side} step {self.step} {self.phase}/{self.half}/{self.group}] "
            f"{','.join(self.reasons)} slot={self.slot} pos={self.position} row={self.row} "
            f"stored={self.stored:#x} expected={self.expected:#x}"
        )
