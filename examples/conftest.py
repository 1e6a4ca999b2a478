"""The example suite drives a tiny reference model: on a CPU, one thread per process is fastest
(and keeps xdist workers from fighting over cores). Set before torch is imported."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
