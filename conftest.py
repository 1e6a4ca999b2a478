"""Repository test configuration: without a GPU, Triton kernels run under its interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, so it is decided here, before
pytest imports the tests.
"""

import os
import shutil

import pytest


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


@pytest.fixture(autouse=True)
def _pytest_output_as_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest leaves its short summary untruncated when CI or BUILD_NUMBER is set; the tests that
    run pytest (pytester) assert on its output as a developer's terminal shows it."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
