"""The device-side violation log: a wrap-around ring of rows plus launch counters."""

from __future__ import annotations

import torch

from .records import COL_STEP, COL_TAG, NUM_TAGS, ROW_WIDTH


class ViolationRing:
    """Device buffers the kernels write and the host drains asynchronously.

    count [1] int64: a monotonic claim counter, never reset by a drain; claim i lands in
    ``rows[i % capacity]``, so a claim past capacity overwrites the oldest row (a host that has
    drained up to claim d has lost the claims in [d, count - capacity)). rows [capacity, ROW_WIDTH]
    int64. step [1] int64: the forward index stamped into rows. kernel_runs / slot_runs [NUM_TAGS]
    int64: launches and entries checked or stamped per launch tag.
    """

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be >= 1; got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.rows = torch.zeros(capacity, ROW_WIDTH, dtype=torch.int64, device=self.device)
        self.count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.step = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.kernel_runs = torch.zeros(NUM_TAGS, dtype=torch.int64, device=self.device)
        self.slot_runs = torch.zeros(NUM_TAGS, dtype=torch.int64, device=self.device)

    def advance_step(self) -> None:
        """Next forward: in place on the device, so it can live inside a captured graph."""
        self.step.add_(1)

    def append(self, rows: torch.Tensor, tag: int) -> None:
        """Claim ring rows for ``rows`` ([n, ROW_WIDTH] int64, any device; their tag and step
        columns are filled here) the way the kernels claim them: device ops only, no
        synchronisation. Of more than ``capacity`` rows the last ``capacity`` are kept."""
        n = rows.shape[0]
        if n == 0:
            return
        kept = rows[-self.capacity:].to(self.device, torch.int64, copy=True)
        kept[:, COL_TAG] = tag
        kept[:, COL_STEP] = self.step
        at = (self.count + (n - kept.shape[0]) + torch.arange(kept.shape[0], device=self.device)) % self.capacity
        self.rows.index_copy_(0, at, kept)
        self.count.add_(n)

    def clear(self) -> None:
        for t in (self.rows, self.count, self.step, self.kernel_runs, self.slot_runs):
            t.zero_()
