"""How fast the host runs a fixed piece of Python and numpy right after waiting W ms for the GPU
(the wait a decode step's synchronisation imposes), against running it back to back.

    python benchmarks/host_after_wait.py        # CUDA only

The work is a few set and numpy operations of the sizes a batch-32 sweep handles (340 blocks, a
23552-slot pool, 256 token entries) and a short Python loop, three times over; each wait is a GPU
sleep kernel followed by torch.cuda.synchronize(). Prints the median and 90th percentile of 60
samples per wait.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

BLOCKS = {i: None for i in range(340)}
HASHED = set(range(0, 680, 2))
SLOTS = np.arange(23552)
SLOTS_AGAIN = SLOTS.copy()
ENTRIES = list(range(256))


def work() -> float:
    """Microseconds the fixed work takes now."""
    start = time.perf_counter()
    for _ in range(3):
        _ = BLOCKS.keys() <= HASHED, HASHED - BLOCKS.keys(), np.count_nonzero(SLOTS == SLOTS_AGAIN)
        np.array(ENTRIES)
        sum(i * i for i in range(200))
    return 1e6 * (time.perf_counter() - start)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("host_after_wait.py needs a CUDA device")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / begin.elapsed_time(end)
    for _ in range(20):
        work()
    print(f"{torch.cuda.get_device_name()}: back to back {statistics.median(work() for _ in range(200)):.1f} us")
    for wait_ms in (0, 1, 5, 18, 45):
        samples = []
        for _ in range(60):
            torch.cuda._sleep(int(cycles_per_ms * wait_ms))
            torch.cuda.synchronize()
            samples.append(work())
        samples.sort()
        print(f"after a {wait_ms:2d} ms wait: median {statistics.median(samples):.1f} us, "
              f"p90 {samples[int(0.9 * len(samples))]:.1f} us")


if __name__ == "__main__":
    main()
