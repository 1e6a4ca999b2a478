"""The host side of the violation log: drain the device ring without stalling the engine, decode
its rows, keep them (log mode) or raise (raise mode).

The ring is a wrap-around buffer with a monotonic claim counter, so draining never resets it: a
drain snapshots the counter and the rows, and the rows claimed since the previous drain are new.
On CUDA each forward ends by copying the counter into pinned host memory (``note_forward``, device
work the engine may capture with its forward), so a periodic poll reads it without touching the
device; only when it moved does the poll snapshot the rows (an asynchronous copy on a side
stream, ordered after the engine's stream), decoded at the next poll, by which time the copy has
long finished. Rows are lost only when more than the ring's capacity arrive between two
snapshots; they are counted in ``dropped``.
"""

from __future__ import annotations

import json
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, ContextManager, NamedTuple

import torch

from kvcanary_kernels import ViolationRing
from kvcanary_kernels import records as R

from .violation import Violation

_MASK64 = (1 << 64) - 1


class KvCanaryViolationError(RuntimeError):
    """Raised by the engine in raise mode at the drain that found new violations."""

    def __init__(self, violations: list[Violation], dropped: int = 0) -> None:
        self.violations = violations
        lines = [f"kv-canary: {len(violations)} new violation(s)"] + [v.describe() for v in violations]
        if dropped:
            lines.append(f"... and {dropped} more dropped past the ring capacity")
        super().__init__("\n".join(lines))


def decode_row(row: list[int], side: str) -> Violation:
    """A ring row as a Violation; a rank_divergence row's row column is the peer rank."""
    phase, half, group = R.split_tag(row[R.COL_TAG])
    bits = row[R.COL_REASONS]
    primary = [r.label for r in R.PRIMARY_REASON_ORDER if bits & r]
    divergence = bool(bits & R.Reason.RANK_DIVERGENCE)
    return Violation(
        side=side,
        step=row[R.COL_STEP],
        phase=phase.name,
        half=half.name,
        group=group.name,
        reasons=tuple(primary),
        slot=row[R.COL_SLOT],
        position=row[R.COL_POSITION],
        row=-1 if divergence else row[R.COL_ROW],
        stored=row[R.COL_STORED] & _MASK64,
        expected=row[R.COL_EXPECTED] & _MASK64,
        peer=row[R.COL_ROW] if divergence else None,
    )


class _Snapshot(NamedTuple):
    count: torch.Tensor  # [1] int64 on the host
    rows: torch.Tensor  # [capacity, ROW_WIDTH] int64 on the host
    done: torch.cuda.Event | None  # recorded on the copy stream after the copy (CUDA only)


class ViolationLog:
    """Decoded violations of one engine.

    A HEAD, RECHECK or SWEEP row that repeats an earlier one in everything but the step (the same
    damaged slot seen again by a later forward) is counted in `repeats`, not reported again (nor
    counted in `dropped`, which counts only rows lost past the ring's capacity); the latest of
    them are kept in `repeated` (the fault ledger's: a slot damaged again the same way, after an
    engine reused it for the same prompt, is a new sighting for a new injection). A TAIL row, about
    what its own forward wrote, is always new. mode "log": new violations are
    kept in `violations` (the plugin decides what to show); "raise": the drain that finds them
    raises KvCanaryViolationError. `jsonl_path`: each new violation is also appended there as one
    JSON line, which `read_jsonl` reads back (how an engine in another process reports).
    """

    def __init__(self, ring: ViolationRing, side: str, mode: str, jsonl_path: Path | None = None) -> None:
        self.ring = ring
        self.side = side
        self.mode = mode
        self.jsonl_path = jsonl_path
        self.violations: list[Violation] = []
        self.total = 0  # rows the kernels claimed, repeats and dropped ones included
        self.repeats = 0
        self.repeated: deque[Violation] = deque(maxlen=ring.capacity)  # the latest repeats, oldest first
        self.dropped = 0  # rows overwritten before a drain read them
        self._keys: set[tuple] = set()
        self._consumed = 0  # claims already decoded
        self._unreported_drops = 0  # dropped rows a raise-mode drain has not raised for yet
        self._pending: _Snapshot | None = None
        self._cuda = ring.rows.device.type == "cuda"
        if self._cuda:  # one snapshot in flight at a time: its buffers and events are reused
            self._stream = torch.cuda.Stream(device=ring.rows.device)
            self._host_rows = torch.empty(ring.rows.shape, dtype=torch.int64, pin_memory=True)
            self._host_count = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._seen = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # the counter after the last forward
            self._seen_on_host = self._seen.numpy()  # read without a torch call
            self._ready, self._done = torch.cuda.Event(), torch.cuda.Event()

    def note_forward(self) -> None:
        """At the end of each forward (device work, capturable): the counter, to pinned host
        memory (CUDA), where the next poll reads it."""
        if self._cuda:
            self._seen.copy_(self.ring.count, non_blocking=True)

    def _snapshot(self) -> _Snapshot:
        """Copy the ring's counter and rows to the host: asynchronously on CUDA, else now."""
        if not self._cuda:
            return _Snapshot(self.ring.count.clone(), self.ring.rows.clone(), None)
        self._ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            self._host_count.copy_(self.ring.count, non_blocking=True)
            self._host_rows.copy_(self.ring.rows, non_blocking=True)
            self._done.record(self._stream)
        return _Snapshot(self._host_count, self._host_rows, self._done)

    def poll(self, device_work: Callable[[], ContextManager[None]] = nullcontext) -> list[Violation]:
        """The periodic drain (between forwards, never inside a graph): decode the snapshot a
        previous poll started; start a new one (inside device_work()) when the counter the last
        forward left moved past what is decoded (CUDA; on a CPU every poll reads the ring now).
        Returns the new violations."""
        new = self._decode_pending()
        if not self._cuda:
            self._pending = self._snapshot()
            new += self._decode_pending()
        elif int(self._seen_on_host[0]) > self._consumed:  # a copy in flight writes all 8 bytes at once
            with device_work():
                self._pending = self._snapshot()
        return self._report(new)

    def drain(self) -> list[Violation]:
        """Everything the device logged so far, synchronously (for reads, the end of a test,
        shutdown). Returns the new violations."""
        new = self._decode_pending()
        self._pending = self._snapshot()
        new += self._decode_pending()
        return self._report(new)

    def _decode_pending(self) -> list[Violation]:
        snap, self._pending = self._pending, None
        if snap is None:
            return []
        if snap.done is not None:
            snap.done.synchronize()
        claimed = int(snap.count[0])
        fresh = claimed - self._consumed
        if fresh <= 0:
            return []
        capacity = self.ring.capacity
        kept = min(fresh, capacity)
        self.total += fresh
        self.dropped += fresh - kept
        order = [i % capacity for i in range(claimed - kept, claimed)]
        rows = snap.rows[order].tolist()
        self._consumed = claimed
        new = []
        for v in (decode_row(r, self.side) for r in rows):
            # A TAIL row is about what that very forward wrote, never damage seen again: its step
            # keeps two requests' identical writes (the same slots, one after another) apart.
            key = (v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.row, v.stored, v.expected,
                   v.step if v.phase == "TAIL" else None)
            if key in self._keys:
                self.repeats += 1
                self.repeated.append(v)
            else:
                self._keys.add(key)
                new.append(v)
        self._unreported_drops += fresh - kept
        return new

    def _report(self, new: list[Violation]) -> list[Violation]:
        self.violations.extend(new)
        if self.jsonl_path is not None and new:
            with self.jsonl_path.open("a") as f:
                for v in new:
                    f.write(json.dumps(v.to_json()) + "\n")
        dropped_now, self._unreported_drops = self._unreported_drops, 0
        if self.mode == "raise" and (new or dropped_now):
            raise KvCanaryViolationError(new, dropped_now)
        return new

    def clear(self) -> None:
        """Forget everything (the ring is cleared too)."""
        if self._pending is not None and self._pending.done is not None:
            self._pending.done.synchronize()
        self._pending = None
        self.ring.clear()
        if self._cuda:
            self._seen.zero_()
        self.violations.clear()
        self.repeated.clear()
        self._keys.clear()
        self.total = self.repeats = self.dropped = self._consumed = self._unreported_drops = 0


def read_jsonl(path: Path) -> list[Violation]:
    """The violations an engine's log appended to `path` (empty when the file does not exist)."""
    if not path.exists():
        return []
    return [Violation.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]
