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

    mode "log": one KvCanaryViolationWarning per row; "raise": KvCanaryViolationError with every
    new row. `jsonl_path`: each violation is also appended there as one JSON line (how an engine
    in another process reports to the harness).
    """

    def __init__(self, ring: ViolationRing, side: str, mode: str, jsonl_path: Path | None = None) -> None:
        self.ring = ring
        self.side = side
        self.mode = mode
        self.jsonl_path = jsonl_path
        self.violations: list[Violation] = []
        self._seen = 0  # ring rows already pumped (claimed count, including dropped ones)

    @property
    def total(self) -> int:
        """Violations the kernels reported, including rows dropped past the ring capacity."""
        return self._seen

    @property
    def dropped(self) -> int:
        return max(0, self._seen - self.ring.capacity)

    def pump(self) -> list[Violation]:
        total = self.ring.total()
        if total == self._seen:
            return []
        rows = self.ring.read(self._seen, total).tolist()
        new = [decode_row(r, self.side) for r in rows]
        dropped_now = (total - self._seen) - len(new)
        self._seen = total
        self.violations.extend(new)
        if self.jsonl_path is not None:
            with self.jsonl_path.open("a") as f:
                for v in new:
                    f.write(json.dumps(v.to_json()) + "\n")
        if self.mode == "raise":
            raise KvCanaryViolationError(new, dropped_now)
        for v in new:
            warnings.warn(KvCanaryViolationWarning(v.describe()), stacklevel=2)
        if dropped_now:
            warnings.warn(KvCanaryViolationWarning(f"{dropped_now} violation(s) dropped past the ring capacity"))
        return new

    def clear(self) -> None:
        self.ring.clear()
        self.violations.clear()
        self._seen = 0


def read_jsonl(path: Path) -> list[Violation]:
    if not path.exists():
        return []
    return [Violation.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


