"""Device-side writes to a ViolationRing: launch counters and violation rows.

Graph-safe: everything is an atomic or a masked store into fixed buffers; nothing returns to the
host. Atomics are relaxed: the host reads the buffers only after the launch completes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import records as R

ROW_WIDTH = tl.constexpr(R.ROW_WIDTH)
COL_REASONS = tl.constexpr(R.COL_REASONS)
COL_TAG = tl.constexpr(R.COL_TAG)
COL_STEP = tl.constexpr(R.COL_STEP)
COL_SLOT = tl.constexpr(R.COL_SLOT)
COL_POSITION = tl.constexpr(R.COL_POSITION)
COL_ROW = tl.constexpr(R.COL_ROW)
COL_STORED = tl.constexpr(R.COL_STORED)
COL_EXPECTED = tl.constexpr(R.COL_EXPECTED)


@triton.jit
def count_launch(kernel_runs, tag):
    """One launch of ``tag``: program 0 adds 1 to kernel_runs[tag]."""
    if tl.program_id(0) == 0:
        tl.atomic_add(kernel_runs + tag, 1, sem="relaxed")


@triton.jit
def count_slots(slot_runs, tag, live):
    """Adds this program's live entries (slot != 0) to slot_runs[tag]."""
    tl.atomic_add(slot_runs + tag, tl.sum(live.to(tl.int64), axis=0), sem="relaxed")


@triton.jit
def note_failure(bad, bit, stored_value, expected_value, reasons, stored, expected):
    """Adds ``bit`` to the lanes in ``bad`` and makes their stored/expected pair this check's.
    Note checks in reverse PRIMARY_REASON_ORDER so the primary reason's pair is the one kept."""
    reasons |= tl.where(bad, bit, 0).to(tl.int64)
    stored = tl.where(bad, stored_value, stored)
    expected = tl.where(bad, expected_value, expected)
    return reasons, stored, expected


@triton.jit
def append_violations(ring_rows, ring_count, ring_step, capacity, fail, reasons, tag,
                      slots, positions, rows, stored, expected):
    """Each lane in ``fail`` claims a ring row; rows claimed past capacity are dropped while
    ring_count keeps counting. Values are int64 tensors shaped like ``fail``."""
    claimed = tl.atomic_add(ring_count + tl.zeros(fail.shape, tl.int32), 1, mask=fail, sem="relaxed")
    keep = fail & (claimed < capacity)
    row_ptr = ring_rows + claimed.to(tl.int64) * ROW_WIDTH
    step = tl.load(ring_step)
    tl.store(row_ptr + COL_REASONS, reasons, mask=keep)
    tl.store(row_ptr + COL_TAG, tl.zeros(fail.shape, tl.int64) + tag, mask=keep)
    tl.store(row_ptr + COL_STEP, tl.zeros(fail.shape, tl.int64) + step, mask=keep)
    tl.store(row_ptr + COL_SLOT, slots, mask=keep)
    tl.store(row_ptr + COL_POSITION, positions, mask=keep)
    tl.store(row_ptr + COL_ROW, rows, mask=keep)
    tl.store(row_ptr + COL_STORED, stored, mask=keep)
    tl.store(row_ptr + COL_EXPECTED, expected, mask=keep)
