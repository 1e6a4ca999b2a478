"""A decoded violation: one row of the device log, as tests and reports see it (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_PARALLEL_FIELDS = ("rank", "stage", "peer")


@dataclass(frozen=True)
class Violation:
    """side: engine that saw it ("single", "prefill", "decode"). step: forward index of that
    engine. phase: HEAD / TAIL / SWEEP; half: K / V; group: FULL / SWA. reasons: labels such as
    "verify_chain_hash", primary first. slot: slot in the group's pool; position: expected
    position; row: request row (-1 for sweep). stored / expected: the primary reason's values.
    On a parallel engine: rank (global rank = stage * tp + tensor-parallel rank) and stage of the
    rank that logged it, and for rank_divergence the peer: the reference rank whose stamps or
    cache it differs from (None elsewhere)."""

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
    rank: int | None = None
    stage: int | None = None
    peer: int | None = None

    @property
    def reason(self) -> str:
        return self.reasons[0]

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON; rank, stage and peer only where set."""
        d = {k: v for k, v in asdict(self).items() if v is not None or k not in _PARALLEL_FIELDS}
        d["reasons"] = list(self.reasons)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Violation":
        return cls(**{**d, "reasons": tuple(d["reasons"])})

    def where(self) -> str:
        """The engine side, and the rank (and stage) on a parallel engine: "decode rank 1"."""
        rank = "" if self.rank is None else f" rank {self.rank}"
        return self.side + rank + ("" if not self.stage else f" (stage {self.stage})")

    def describe(self) -> str:
        peer = "" if self.peer is None else f" vs rank {self.peer}"
        return (
            f"[{self.where()} step {self.step} {self.phase}/{self.half}/{self.group}]{peer} "
            f"{','.join(self.reasons)} slot={self.slot} pos={self.position} row={self.row} "
            f"stored={self.stored:#x} expected={self.expected:#x}"
        )
