"""Device-side writes to a ViolationRing: launch counters and violation rows.

The ring travels into a kernel as one tuple, ``launch.ring_args(ring)``:
``(rows, count, step, kernel_runs, slot_runs, capacity)``. Graph-safe: everything is an atomic or
a masked store into fixed buffers; nothing returns to the host. Atomics are relaxed: the host
reads the buffers only after the launch completes.
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
def first_program():
    """True in program (0, 0) of a launch (1-D or 2-D)."""
    return (tl.program_id(0) == 0) & (tl.program_id(1) == 0)


@triton.jit
def count_launch(ring, tag):
    """One launch of ``tag``: the first program adds 1 to kernel_runs[tag]."""
    if first_program():
        tl.atomic_add(ring[3] + tag, 1, sem="relaxed")


@triton.jit
def count_slots(ring, tag, n):
    """Adds ``n`` entries to slot_runs[tag]."""
    tl.atomic_add(ring[4] + tag, n, sem="relaxed")


@triton.jit
def note_failure(bad, bit, stored_value, expected_value, reasons, stored, expected):
    """Adds ``bit`` to the lanes in ``bad`` and makes their stored/expected pair this check's.
    Note checks in reverse PRIMARY_REASON_ORDER so the primary reason's pair is the one kept."""
    reasons |= tl.where(bad, bit, 0).to(tl.int64)
    stored = tl.where(bad, stored_value, stored)
    expected = tl.where(bad, expected_value, expected)
    return reasons, stored, expected


@triton.jit
def append_violations(ring, tag, fail, reasons, slots, positions, rows, stored, expected):
    """Each lane in ``fail`` claims the next count and writes its row at ``count % capacity``
    (wrapping over the oldest rows). Values are int64 tensors shaped like ``fail`` (or scalars)."""
    ring_rows, ring_count, ring_step, _, _, capacity = ring
    claimed = tl.atomic_add(ring_count + tl.zeros(fail.shape, tl.int32), 1, mask=fail, sem="relaxed")
    row_ptr = ring_rows + (claimed % capacity) * ROW_WIDTH
    zeros = tl.zeros(fail.shape, tl.int64)
    tl.store(row_ptr + COL_REASONS, reasons, mask=fail)
    tl.store(row_ptr + COL_TAG, zeros + tag, mask=fail)
    tl.store(row_ptr + COL_STEP, zeros + tl.load(ring_step), mask=fail)
    tl.store(row_ptr + COL_SLOT, zeros + slots, mask=fail)
    tl.store(row_ptr + COL_POSITION, zeros + positions, mask=fail)
    tl.store(row_ptr + COL_ROW, zeros + rows, mask=fail)
    tl.store(row_ptr + COL_STORED, stored, mask=fail)
    tl.store(row_ptr + COL_EXPECTED, expected, mask=fail)
