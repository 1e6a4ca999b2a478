"""Device leasing: which GPU each test process (each xdist worker) drives.

A process leases slot k of GPU i by holding the file lock `gpu{i}.{k}.lock` (k < workers_per_gpu)
in a lock directory shared by the run, and keeps it until `release()` or process exit. Slots are
filled GPU by GPU before a second slot of any GPU is taken, so workers spread over the GPUs.
GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L` without initialising CUDA; torch
is asked only as a last resort, and only by the process that leases (never an xdist controller).
Devices are returned as "cuda:i" (an index into the visible devices); the environment is left as
it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from filelock import FileLock, Timeout

DEVICE_SETTINGS = ("auto", "cpu", "cuda")


class DeviceLeaseError(RuntimeError):
    """No device can be leased for this process."""


def visible_gpu_count(env: Mapping[str, str] = os.environ) -> int | None:
    """GPUs from CUDA_VISIBLE_DEVICES (entries up to the first "-1") or from `nvidia-smi -L`;
    None when neither is available."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return len(entries[: entries.index("-1")] if "-1" in entries else entries)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines())


def count_gpus() -> int:
    """`visible_gpu_count()`, else torch's count (which may initialise the driver)."""
    count = visible_gpu_count()
    if count is not None:
        return count
    import torch

    return torch.cuda.device_count()


def default_lock_dir(env: Mapping[str, str] = os.environ) -> Path:
    """A directory under the system temp dir named after this run: xdist's run id, which all
    workers of a run share, else this process's id."""
    run = env.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"pytest-kvcanary-{run}"


class DeviceLeases:
    """The devices one process drives. `setting`: auto / cpu / cuda; `gpu_count` is called once,
    on the first lease. A pair takes a second GPU's slot, so every process should lease its
    primary before any process asks for a pair, or a late process may find no slot left."""

    def __init__(self, setting: str, lock_dir: Path, workers_per_gpu: int,
                 gpu_count: Callable[[], int] = count_gpus) -> None:
        if setting not in DEVICE_SETTINGS:
            raise ValueError(f"device must be one of {', '.join(DEVICE_SETTINGS)}; got {setting!r}")
        self._setting = setting
        self._lock_dir = lock_dir
        self._workers_per_gpu = workers_per_gpu
        self._gpu_count = gpu_count
        self._count: int | None = None
        self._held: dict[int, FileLock] = {}  # GPU index -> the lock of the slot held on it
        self._pair: tuple[str, str] | None = None

    def _gpus(self) -> int:
        if self._count is None:
            self._count = 0 if self._setting == "cpu" else self._gpu_count()
        if self._count == 0 and self._setting == "cuda":
            raise DeviceLeaseError("device 'cuda' was asked for, but no GPU is visible")
        return self._count

    def _lease(self, exclude: int | None) -> int | None:
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        for k in range(self._workers_per_gpu):
            for i in range(self._gpus()):
                if i == exclude:
                    continue
                lock = FileLock(self._lock_dir / f"gpu{i}.{k}.lock", thread_local=False)
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue
                self._held[i] = lock
                return i
        return None

    def primary(self) -> str:
        """This process's device: "cpu", or "cuda:i" for the GPU it leased (leased on first call)."""
        if self._gpus() == 0:
            return "cpu"
        if not self._held:
            if self._lease(exclude=None) is None:
                raise DeviceLeaseError(
                    f"all {self._gpus() * self._workers_per_gpu} GPU slots ({self._gpus()} GPUs x "
                    f"{self._workers_per_gpu} workers per GPU) under {self._lock_dir} are leased; "
                    "run fewer xdist workers or raise --kv-canary-workers-per-gpu"
                )
        return f"cuda:{next(iter(self._held))}"

    def pair(self) -> tuple[str, str]:
        """(prefill, decode) devices: the primary and a second GPU leased on the first call, or
        the primary twice when no other GPU has a free slot then."""
        if self._pair is None:
            first = self.primary()
            second = None if first == "cpu" else self._lease(exclude=int(first.split(":")[1]))
            self._pair = (first, first if second is None else f"cuda:{second}")
        return self._pair

    def release(self) -> None:
        for lock in self._held.values():
            lock.release()
        self._held.clear()
        self._pair = None
