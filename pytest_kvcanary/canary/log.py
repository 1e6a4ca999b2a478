"""The host side of the violation log: pump new device rows, decode them, warn or raise."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from kvcanary_kernels import ViolationRing
from kvcanary_kernels import records as R

from .violation import Violation

_MASK64 = (1 << 64) - 1


class KvCanaryViolationWarning(UserWarning):
    """Issued once per violation in log mode."""


class KvCanaryViolationError(RuntimeError):
    """Raised by the engine in raise mode; carries every new violation."""

    def __init__(self, violations: list[Violation], dropped: int = 0) -> None:
        self.violations = violations
        lines = [f"kv-canary: {len(violations)} new violation(s)"] + [v.describe() for v in violations]
        if dropped:
            lines.append(f"... and {dropped} more dropped past the ring capacity")
        super().__init__("\n".join(lines))


def decode_row(row: list[int], side: str) -> Violation:
    phase, half, group = R.split_tag(row[R.COL_TAG])
    bits = row[R.COL_REASONS]
    primary = [r.label for r in R.PRIMARY_REASON_ORDER if bits & r]
    return Violation(
        side=side,
        step=row[R.COL_STEP],
        phase=phase.name,
        half=half.name,
        group=group.name,
        reasons=tuple(primary),
        slot=row[R.COL_SLOT],
        position=row[R.COL_POSITION],
        row=row[R.COL_ROW],
        stored=row[R.COL_STORED] & _MASK64,
        expected=row[R.COL_EXPECTED] & _MASK64,
    )


class ViolationLog:
    """Decoded violations of one engine. `pump()` after each forward moves new device rows here.

    A row that repeats an earlier one in everything but the step (the same damaged slot seen again
    by a later forward) is counted in `repeats`, not reported again. mode "log": one
    KvCanaryViolationWarning per new violation; "raise": KvCanaryViolationError with all of them.
    `jsonl_path`: each new violation is also appended there as one JSON line (how an engine in
    another process reports to the harness, which reads them back with `read_jsonl`).
    """

    def __init__(self, ring: ViolationRing, side: str, mode: str, jsonl_path: Path | None = None) -> None:
        self.ring = ring
        self.side = side
        self.mode = mode
        self.jsonl_path = jsonl_path
        self.violations: list[Violation] = []
        self.total = 0  # rows the kernels claimed, repeats and dropped ones included
        self.repeats = 0
        self.dropped = 0  # rows lost because one pump window claimed more than the ring holds
        self._keys: set[tuple] = set()

    def pump(self) -> list[Violation]:
        """Move the ring's rows here and empty the ring (so its capacity bounds one forward's
        rows, not the whole run's)."""
        claimed = self.ring.total()
        if claimed == 0:
            return []
        rows = self.ring.read(0, claimed).tolist()
        self.ring.count.zero_()
        dropped_now = claimed - len(rows)
        self.total += claimed
        self.dropped += dropped_now
        new = []
        for v in (decode_row(r, self.side) for r in rows):
            key = (v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.row, v.stored, v.expected)
            if key in self._keys:
                self.repeats += 1
            else:
                self._keys.add(key)
                new.append(v)
        self.violations.extend(new)
        if self.jsonl_path is not None:
            with self.jsonl_path.open("a") as f:
                for v in new:
                    f.write(json.dumps(v.to_json()) + "\n")
        if self.mode == "raise" and (new or dropped_now):
            raise KvCanaryViolationError(new, dropped_now)
        for v in new:
            warnings.warn(KvCanaryViolationWarning(v.describe()), stacklevel=2)
        if dropped_now:
            warnings.warn(KvCanaryViolationWarning(f"{dropped_now} violation(s) dropped past the ring capacity"))
        return new

    def clear(self) -> None:
        self.ring.clear()
        self.violations.clear()
        self._keys.clear()
        self.total = self.repeats = self.dropped = 0


def read_jsonl(path: Path) -> list[Violation]:
    if not path.exists():
        return []
    return [Violation.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


