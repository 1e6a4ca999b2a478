"""Device leasing: which GPU each test process (each xdist worker) drives.

A process leases slot k of GPU i by holding the file lock `gpu{i}.{k}.lock` in a lock directory
shared by the run, and keeps it until `release()` or its exit (the lock dies with the process).
Slots are filled level by level (slot 0 of every GPU, then slot 1, ...), so workers spread over
the GPUs and share them only when there are more workers than GPUs. workers_per_gpu None (auto)
sets no cap: a run never fails for oversubscription. With a cap, a process that finds every slot
taken says so and waits for one to free up.

A prefill/decode pair leases a second GPU only from spares: when the run has more GPUs than
workers, a GPU nobody's primary needs; otherwise both sides share the primary.

A parallel engine of n ranks runs on n distinct GPUs (NCCL refuses two ranks on one GPU): the
primary and n - 1 others, each leased at the lowest free level of its GPU, so the ranks take the
least shared GPUs and share them with other workers' primaries as workers past the GPU count do.
These leases never wait, whatever the cap (a cap bounds the primaries), so two workers that both
need each other's GPU never deadlock. With fewer than n GPUs the engine cannot run on GPUs.

GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L` without initialising CUDA; torch
is asked only as a last resort. Devices are returned as "cuda:i" (an index into the visible
devices); the environment is left as it is.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping

from filelock import FileLock, Timeout

AUTO = "auto"
DEVICE_SETTINGS = (AUTO, "cpu", "cuda")


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


def cuda_build_problem() -> str | None:
    """Why this torch cannot drive a GPU at all (a build without CUDA or ROCm), or None. Imports
    torch; asked only when GPUs are visible."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return None


TRUTHY = ("1", "true", "yes", "on", "y")  # what Triton reads as on in TRITON_INTERPRET


def interpreter_on(env: Mapping[str, str] = os.environ) -> bool:
    """Whether TRITON_INTERPRET switches Triton's interpreter on."""
    return env.get("TRITON_INTERPRET", "").strip().lower() in TRUTHY


def interpreter_problem(setting: str, env: Mapping[str, str] = os.environ,
                        gpu_count: Callable[[], int] = count_gpus) -> str | None:
    """Why the user's TRITON_INTERPRET cannot serve a canary under this --kv-canary-device
    setting, or None: switched off (Triton would compile for a GPU) where the engines run on the
    CPU."""
    value = env.get("TRITON_INTERPRET")
    if value is None or interpreter_on(env) or not runs_on_cpu(setting, gpu_count):
        return None
    where = "--kv-canary-device=cpu" if setting == "cpu" else "no GPU is visible"
    return (f"TRITON_INTERPRET={value!r} makes Triton compile the canary's kernels for a GPU, and the engines run on "
            f"the CPU here ({where}): unset TRITON_INTERPRET (the plugin then sets it to 1) or set it to 1")


def runs_on_cpu(setting: str, gpu_count: Callable[[], int] = count_gpus) -> bool:
    """Whether engines under this --kv-canary-device setting run on the CPU (so the kernels
    must run under Triton's interpreter)."""
    return setting == "cpu" or (setting == AUTO and gpu_count() == 0)


def new_lock_dir() -> Path:
    """A fresh lock directory path under the system temp dir for one run (created on first lease;
    the run's owner removes it with `remove_lock_dir` when the run ends)."""
    return Path(tempfile.gettempdir()) / f"pytest-kvcanary-{uuid.uuid4().hex[:16]}"


def remove_lock_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _tell(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class DeviceLeases:
    """The devices one process drives. setting: auto / cpu / cuda; workers_per_gpu: a cap, or
    None (auto: no cap); workers: processes of the run (xdist workers, else 1). gpu_count is
    called once, on the first lease; on_wait hears the message a capped, full lease waits with;
    poll_s: how long it waits on one slot before trying the next."""

    def __init__(self, setting: str, lock_dir: Path, workers_per_gpu: int | None, *, workers: int = 1,
                 gpu_count: Callable[[], int] = count_gpus, on_wait: Callable[[str], None] = _tell,
                 poll_s: float = 0.5) -> None:
        if setting not in DEVICE_SETTINGS:
            raise ValueError(f"device must be one of {', '.join(DEVICE_SETTINGS)}; got {setting!r}")
        self._setting = setting
        self._lock_dir = lock_dir
        self._cap = workers_per_gpu
        self._workers = workers
        self._gpu_count = gpu_count
        self._on_wait = on_wait
        self._poll_s = poll_s
        self._count: int | None = None
        self._held: dict[int, FileLock] = {}  # GPU index -> the lock of the slot held on it; primary first
        self._pair: tuple[str, str] | None = None
        self._ranks: dict[int, tuple[str, ...]] = {}

    def _gpus(self) -> int:
        if self._count is None:
            self._count = 0 if self._setting == "cpu" else self._gpu_count()
        if self._count == 0 and self._setting == "cuda":
            raise DeviceLeaseError("device 'cuda' was asked for, but no GPU is visible")
        return self._count

    def _lock(self, gpu: int, slot: int) -> FileLock:
        return FileLock(self._lock_dir / f"gpu{gpu}.{slot}.lock", thread_local=False)

    def _take(self, levels: Iterable[int], exclude: Collection[int] = ()) -> int | None:
        """The first free slot, level by level; its GPU, or None when every slot is taken."""
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        for k in levels:
            for i in range(self._gpus()):
                if i in exclude:
                    continue
                lock = self._lock(i, k)
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue
                self._held[i] = lock
                return i
        return None

    def _levels(self) -> Iterable[int]:
        # Without a cap some level always has a free slot (each live process holds finitely many).
        return itertools.count() if self._cap is None else range(self._cap)

    def _wait(self) -> int:
        """Wait for any slot under the cap, after saying so."""
        assert self._cap is not None
        self._on_wait(
            f"kv-canary: all {self._gpus() * self._cap} GPU slots ({self._gpus()} GPUs x {self._cap} workers per "
            f"GPU, --kv-canary-workers-per-gpu) under {self._lock_dir} are leased; waiting for one to free up "
            f"(raise the cap, or set it to {AUTO} to share)")
        slots = [(i, k) for k in range(self._cap) for i in range(self._gpus())]
        while True:
            for i, k in slots:
                lock = self._lock(i, k)
                try:
                    lock.acquire(timeout=self._poll_s / len(slots))
                except Timeout:
                    continue
                self._held[i] = lock
                return i

    def try_primary(self) -> str | None:
        """The primary device when one can be had without waiting, else None."""
        if self._gpus() == 0:
            return "cpu"
        if not self._held and self._take(self._levels()) is None:
            return None
        return f"cuda:{next(iter(self._held))}"

    def primary(self) -> str:
        """This process's device: "cpu", or "cuda:i" for the GPU it leased (leased on first call,
        waiting for a slot when a cap is set and every slot is taken)."""
        device = self.try_primary()
        if device is None:
            device = f"cuda:{self._wait()}"
        return device

    def pair(self) -> tuple[str, str]:
        """(prefill, decode) devices: the primary and, when the run has more GPUs than workers, a
        spare GPU (slot 0 of another GPU, leased on the first call); else the primary twice."""
        if self._pair is None:
            first = self.primary()
            second = None
            if first != "cpu" and self._gpus() > self._workers:
                second = self._take([0], exclude={int(first.split(":")[1])})
            self._pair = (first, first if second is None else f"cuda:{second}")
        return self._pair

    def ranks(self, n: int) -> tuple[str, ...] | None:
        """The devices of a parallel engine's n ranks, rank 0's first: "cpu" n times on a CPU run;
        else the primary and n - 1 other GPUs (those this process holds already first, then the
        least shared, leased on the first call without waiting); None when fewer than n GPUs are
        visible."""
        first = self.primary()
        if first == "cpu":
            return ("cpu",) * n
        if self._gpus() < n:
            return None
        if n not in self._ranks:
            while len(self._held) < n:
                self._take(itertools.count(), exclude=set(self._held))
            self._ranks[n] = tuple(f"cuda:{i}" for i in list(self._held)[:n])
        return self._ranks[n]

    def release(self) -> None:
        for lock in self._held.values():
            lock.release()
        self._held.clear()
        self._pair = None
        self._ranks.clear()
