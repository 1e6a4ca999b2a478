"""Device leasing with fake GPU counts: each DeviceLeases stands for one worker process."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pytest_kvcanary import gpu
from pytest_kvcanary.gpu import DeviceLeaseError, DeviceLeases


def _workers(lock_dir: Path, n: int, gpus: int, per_gpu: int | None = None, setting: str = "auto",
             **kw: object) -> list[DeviceLeases]:
    return [DeviceLeases(setting, lock_dir, per_gpu, workers=n, gpu_count=lambda: gpus, **kw) for _ in range(n)]


def test_workers_spread_over_gpus_before_sharing(tmp_path: Path) -> None:
    workers = _workers(tmp_path, 4, gpus=2)
    assert [w.primary() for w in workers] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu0.0.lock", "gpu0.1.lock", "gpu1.0.lock", "gpu1.1.lock"]
    assert workers[0].primary() == "cuda:0"  # leased once, kept


def test_more_workers_than_gpus_share_without_a_cap(tmp_path: Path) -> None:
    """One GPU, two xdist workers: both get it (the default, workers_per_gpu auto)."""
    assert [w.primary() for w in _workers(tmp_path, 2, gpus=1)] == ["cuda:0", "cuda:0"]


def test_a_full_cap_waits_with_a_message_until_a_slot_frees(tmp_path: Path) -> None:
    said = threading.Event()
    messages: list[str] = []

    def on_wait(message: str) -> None:
        messages.append(message)
        said.set()

    first, second = _workers(tmp_path, 2, gpus=1, per_gpu=1, on_wait=on_wait, poll_s=0.01)
    assert first.primary() == "cuda:0"
    assert second.try_primary() is None  # does not wait
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(second.primary()))
    waiter.start()
    assert said.wait(timeout=60)
    assert not got
    first.release()
    waiter.join(timeout=60)
    assert got == ["cuda:0"]
    assert messages == [f"kv-canary: all 1 GPU slots (1 GPUs x 1 workers per GPU, --kv-canary-workers-per-gpu) "
                        f"under {tmp_path} are leased; waiting for one to free up (raise the cap, or set it to "
                        "auto to share)"]


def test_release_frees_the_slot(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=1, per_gpu=1)
    first.primary()
    first.release()
    assert second.try_primary() == "cuda:0"


def test_the_lease_dies_with_its_process(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from pytest_kvcanary.gpu import DeviceLeases; "
            "leases = DeviceLeases('auto', Path(sys.argv[1]), 1, gpu_count=lambda: 1); "
            "print(leases.primary(), flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "cuda:0"
        survivor = _workers(tmp_path, 1, gpus=1, per_gpu=1)[0]
        assert survivor.try_primary() is None
    finally:
        child.kill()
        child.wait()
    assert survivor.try_primary() == "cuda:0"


def test_pair_takes_a_spare_gpu(tmp_path: Path) -> None:
    only = _workers(tmp_path, 1, gpus=2)[0]
    assert only.pair() == ("cuda:0", "cuda:1")
    assert only.pair() == ("cuda:0", "cuda:1")  # kept


def test_pair_never_takes_a_gpu_a_worker_needs(tmp_path: Path) -> None:
    """As many GPUs as workers: no spare, so pairs share their worker's GPU, also while a crashed
    worker's GPU is free (its replacement needs it)."""
    first, second = _workers(tmp_path, 2, gpus=2)
    assert (first.primary(), second.primary()) == ("cuda:0", "cuda:1")
    second.release()  # the worker died
    assert first.pair() == ("cuda:0", "cuda:0")
    replacement = _workers(tmp_path, 2, gpus=2, per_gpu=1)[1]
    assert replacement.try_primary() == "cuda:1"


def test_spares_go_to_the_first_pairs(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=3)
    assert (first.primary(), second.primary()) == ("cuda:0", "cuda:1")
    assert first.pair() == ("cuda:0", "cuda:2")
    assert second.pair() == ("cuda:1", "cuda:1")


def test_parallel_ranks_take_distinct_gpus_without_waiting(tmp_path: Path) -> None:
    """Two workers, two GPUs, one worker per GPU: each worker's tp=2 engine gets both GPUs, its own
    first, without waiting for the other's (held by the other as its primary), so two such tests
    at once never deadlock; three ranks cannot run on two GPUs."""
    def waited(message: str) -> None:
        pytest.fail(f"a rank's lease waited: {message}")

    first, second = _workers(tmp_path, 2, gpus=2, per_gpu=1, on_wait=waited)
    assert (first.primary(), second.primary()) == ("cuda:0", "cuda:1")
    assert first.ranks(2) == ("cuda:0", "cuda:1")
    assert second.ranks(2) == ("cuda:1", "cuda:0")
    assert first.ranks(2) == ("cuda:0", "cuda:1")  # kept
    assert first.ranks(3) is None


def test_parallel_ranks_take_the_least_shared_gpus_and_a_held_spare_first(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=4)
    assert (first.primary(), second.primary()) == ("cuda:0", "cuda:1")
    assert first.ranks(2) == ("cuda:0", "cuda:2")  # GPU 2 is nobody's, GPU 1 is second's primary
    assert second.pair() == ("cuda:1", "cuda:3")
    assert second.ranks(3) == ("cuda:1", "cuda:3", "cuda:0")  # its spare, then the least shared


def test_parallel_ranks_share_the_cpu(tmp_path: Path) -> None:
    assert _workers(tmp_path, 1, gpus=0)[0].ranks(4) == ("cpu",) * 4


def test_cpu_and_auto_without_gpus(tmp_path: Path) -> None:
    cpu = DeviceLeases("cpu", tmp_path, None, gpu_count=lambda: pytest.fail("cpu must not count GPUs"))
    assert cpu.pair() == ("cpu", "cpu")
    assert _workers(tmp_path, 1, gpus=0)[0].primary() == "cpu"
    with pytest.raises(DeviceLeaseError, match="device 'cuda' was asked for, but no GPU is visible"):
        _workers(tmp_path, 1, gpus=0, setting="cuda")[0].primary()
    assert not any(tmp_path.iterdir())


def test_cuda_without_gpus_keeps_failing(tmp_path: Path) -> None:
    leases = _workers(tmp_path, 1, gpus=0, setting="cuda")[0]
    for _ in range(2):
        with pytest.raises(DeviceLeaseError):
            leases.primary()


@pytest.mark.parametrize("setting, gpus, on_cpu", [("cpu", 1, True), ("auto", 0, True), ("auto", 1, False),
                                                   ("cuda", 0, False)])
def test_runs_on_cpu(setting: str, gpus: int, on_cpu: bool) -> None:
    assert gpu.runs_on_cpu(setting, gpu_count=lambda: gpus) is on_cpu


@pytest.mark.parametrize("visible, count", [("", 0), ("0", 1), ("2,3", 2), ("GPU-a1, GPU-b2", 2), ("0,-1,1", 1), ("-1", 0)])
def test_visible_gpu_count_from_cuda_visible_devices(visible: str, count: int) -> None:
    assert gpu.visible_gpu_count({"CUDA_VISIBLE_DEVICES": visible}) == count


def test_visible_gpu_count_from_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = "GPU 0: NVIDIA H100 (UUID: GPU-1)\nGPU 1: NVIDIA H100 (UUID: GPU-2)\n"
    monkeypatch.setattr(gpu.shutil, "which", lambda name: "/bin/nvidia-smi")
    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing))
    assert gpu.visible_gpu_count({}) == 2
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    assert gpu.visible_gpu_count({}) is None


def test_each_run_gets_its_own_lock_dir_which_it_removes(tmp_path: Path) -> None:
    a, b = gpu.new_lock_dir(), gpu.new_lock_dir()
    assert a != b and a.name.startswith("pytest-kvcanary-") and not a.exists()
    leases = DeviceLeases("auto", tmp_path / "locks", None, gpu_count=lambda: 1)
    leases.primary()
    leases.release()
    gpu.remove_lock_dir(tmp_path / "locks")
    assert not (tmp_path / "locks").exists()
