"""Repository test configuration: without a GPU, Triton kernels run under its interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, so it is decided here, before
pytest imports the tests.
"""

import os
import shutil


def _gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return shutil.which("nvidia-smi") is not None


if not _gpu_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The test models are tiny: one thread per process beats several fighting over two cores,
    # especially with one process per core under xdist.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["pytester"]
