"""The fault ledger: every injection, and whether the canary saw it.

Status: "detected" (a violation of a reason that mode must produce names the injected slot, or a
slot a transfer moved it to, while the damage was there), "latent" (not detected, and the damage
may still be read), "escaped" (every copy of the damage was freed or overwritten before any read;
`cause` says how).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, NamedTuple

from kvcanary_kernels.records import GroupKind

from ..canary.violation import Violation
from ..config import SCALE_MODES

# Which reasons count as detecting each mode.
DETECTING_REASONS = {
    "req_to_token": ("verify_position", "verify_chain_hash", "verify_token"),
    "real_kv_used": ("verify_real_kv_hash",),
    "real_kv_unused_cache": ("verify_real_kv_hash",),
    "real_kv_post_forward": ("verify_real_kv_hash",),
    # Read where a load-back from the host tier brought the damaged page.
    "real_kv_host": ("verify_real_kv_hash",),
    # TAIL of the forward fed the other token, then any read of the record it stamped.
    "next_token_swap": ("write_token", "verify_token"),
    # The state a forward starts from summarizes another prefix than its row's.
    "state_wrong_restore": ("verify_position", "verify_chain_hash"),
    # The forward was handed a damaged scale: HEAD of that forward, at its layer and head.
    "scale_corrupt": ("verify_scale",),
    "scale_reset": ("verify_scale",),
    # A sparse layer read a selected index pointing at a slot its row does not hold there: SELECT of
    # that layer, at the stale slot and the selected position.
    "index_stale": ("verify_index",),
}
# Modes whose damage lives for the forward it was injected in, at (slot, position): put back after it.
FORWARD_MODES = SCALE_MODES + ("index_stale",)


class Place(NamedTuple):
    """Where damaged data lives: an engine side (or "<side>:host", its host tier), the slot in the
    target group's pool (a host slot there), and the FULL-pool slot that owns it (they are equal for
    the FULL group and on the host); since: the side's forward from which on it is there (0: from
    the injection on)."""

    side: str
    slot: int
    full_slot: int
    since: int = 0


@dataclass
class Injection:
    """One injected fault. slot: in the target group's pool; row: request row (-1 when only the
    radix cache held the slot); step: the engine's forward index. For a byte flip, half (K or V)
    and layer (an index into the group's layers) say which of the slot's rows was hit, and byte is
    the flipped byte's offset within that row (its bytes in feature order, KV head h from h x
    head bytes on); req_to_token, whose damage is the mapping itself, and next_token_swap, whose
    damage is what the forward wrote at the position it was fed another token at, have none
    (None, -1, -1). A scale fault (SCALE_MODES) sits in the SCALES group: slot and layer are the
    layer, position the KV head (0 per tensor), byte the damaged byte in the layer's row of scales
    (-1 for a reset). rank / stage: the rank of a parallel engine it was injected on (None elsewhere)."""

    mode: str
    side: str
    group: str
    slot: int
    full_slot: int
    position: int
    row: int
    byte: int
    step: int
    half: str | None = None
    layer: int = -1
    status: str = "latent"
    cause: str = ""
    detected_by: Violation | None = None
    moved_to: list[Place] = field(default_factory=list)  # where a PD transfer copied the damage
    gone: dict[Place, int] = field(default_factory=dict)  # place -> its side's step when freed or overwritten
    rank: int | None = None
    stage: int | None = None

    @property
    def places(self) -> list[Place]:
        return [Place(self.side, self.slot, self.full_slot), *self.moved_to]

    @property
    def latency(self) -> int | None:
        """Forwards from injection to detection, on the injection side's clock (a host tier's
        side, "<side>:host", keeps its engine's); None when detected on another engine (PD)."""
        if self.detected_by is None:
            return None
        return self.detected_by.step - self.step if self.detected_by.side == self.side.partition(":")[0] else None

    def matches(self, v: Violation) -> bool:
        if v.group.lower() != self.group or not set(v.reasons) & set(DETECTING_REASONS[self.mode]):
            return False
        if self.half is not None and v.half != self.half:
            return False
        if self.mode == "req_to_token":
            # The wrong entry lives for the forward it was injected in (it is put back after): HEAD
            # reports it at its row and position, or as a chain break at the next position.
            if (v.side, v.step, v.row) != (self.side, self.step, self.row):
                return False
            return v.position == self.position or (v.position == self.position + 1
                                                   and "verify_chain_hash" in v.reasons)
        if self.mode in FORWARD_MODES:  # the damage lives for the forward it was injected in
            return (v.side, v.step, v.slot, v.position) == (self.side, self.step, self.slot, self.position)
        if "write_token" in v.reasons:  # next_token_swap: TAIL of the forward fed the other token
            return (v.side, v.step, v.row, v.position) == (self.side, self.step, self.row, self.position)
        if v.side == self.side and v.step < self.step:
            return False
        # A violation after a place was freed or overwritten is about whatever lives there now. A
        # sweep runs after its forward and carries the next forward's step, as does a free made
        # while scheduling that forward: the sweep came first.
        return any((v.side, v.slot) == (p.side, p.slot) and v.step >= p.since
                   and (v.step < self.gone.get(p, v.step + 1) or (v.phase == "SWEEP" and v.step == self.gone[p]))
                   for p in self.places)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["detected_by"] = self.detected_by.to_json() if self.detected_by else None
        d["gone"] = [{**p._asdict(), "step": step} for p, step in self.gone.items()]
        d["latency"] = self.latency
        return d

    def describe(self) -> str:
        rank = "" if self.rank is None else f" rank {self.rank}"
        where = f"{self.side}{rank} {self.group} slot={self.slot} pos={self.position} row={self.row}"
        extra = f" ({self.cause})" if self.cause else ""
        flip = f" half={self.half} layer={self.layer} byte={self.byte}" if self.half is not None else ""
        return f"{self.mode} @ step {self.step} [{where}{flip}] -> {self.status}{extra}"


class Ledger:
    """Injections of one run (all sides of a PD pair share one), matched against violations."""

    def __init__(self) -> None:
        self.injections: list[Injection] = []

    def record(self, injection: Injection) -> None:
        self.injections.append(injection)

    def _slot_damage(self, group: GroupKind) -> Iterator[Injection]:
        """The injections whose damage sits in slots of this pool group (all but req_to_token, whose
        damage is the mapping itself, and index_stale, whose damage is a selection)."""
        return (inj for inj in self.injections
                if inj.group == group.label and inj.mode not in ("req_to_token", "index_stale"))

    def damaged(self, side: str, group: GroupKind) -> set[int]:
        """Slots of a side's pool group that hold damage (flipped bytes, a swapped token's KV) not yet
        freed or overwritten."""
        return {p.slot for inj in self._slot_damage(group) for p in inj.places if p.side == side and p not in inj.gone}

    def match(self, violations: list[Violation]) -> None:
        """Mark every injection a violation names as detected (first matching violation wins),
        an escaped one too when the violation came before its slots were freed."""
        for inj in self.injections:
            if inj.status == "detected":
                continue
            hit = next((v for v in violations if inj.matches(v)), None)
            if hit is not None:
                inj.status, inj.cause, inj.detected_by = "detected", "", hit

    def follows_frees(self, side: str, group: GroupKind) -> bool:
        """Whether a free of a side's pool group slots can change an injection's account (`escape`
        would look at it): a free elsewhere needs no look at its slots."""
        return any(inj.status != "escaped" and any(p.side == side and p not in inj.gone for p in inj.places)
                   for inj in self._slot_damage(group))

    def escape(self, side: str, group: GroupKind, slots: set[int], cause: str, step: int) -> None:
        """These slots of a side's pool group lost their data at that side's forward `step`
        (freed or overwritten). Injections whose every copy is gone escaped, unless `match`
        later finds a violation from before. A next_token_swap's slot written by the forward it was
        injected in holds its damage: that write is no loss."""
        for inj in self._slot_damage(group):
            if inj.status == "escaped" or (inj.mode == "next_token_swap" and (inj.side, inj.step) == (side, step)):
                continue
            for p in inj.places:
                if p.side == side and p.slot in slots:
                    inj.gone.setdefault(p, step)
            if inj.status == "latent" and len(inj.gone) == len(inj.places):
                inj.status, inj.cause = "escaped", cause

    def moved(self, side: str, group: GroupKind, full_slot: int, to: Place) -> None:
        """A transfer (or a write-back to a host tier, or a load-back from it) copied the data of
        (side, full_slot) in that pool group to `to`."""
        for inj in self.injections:
            if inj.group == group.label and any(p.side == side and p.full_slot == full_slot
                                          for p in inj.places if p not in inj.gone):
                inj.moved_to.append(to)

    def clear(self) -> None:
        self.injections.clear()
