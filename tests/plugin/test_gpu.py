"""Device leasing with fake GPU counts: each DeviceLeases stands for one worker process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pytest_kvcanary import gpu
from pytest_kvcanary.gpu import DeviceLeaseError, DeviceLeases


def _workers(lock_dir: Path, n: int, gpus: int, per_gpu: int = 1, setting: str = "auto") -> list[DeviceLeases]:
    return [DeviceLeases(setting, lock_dir, per_gpu, gpu_count=lambda: gpus) for _ in range(n)]


def test_workers_spread_over_gpus_before_sharing(tmp_path: Path) -> None:
    workers = _workers(tmp_path, 4, gpus=2, per_gpu=2)
    assert [w.primary() for w in workers] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu0.0.lock", "gpu0.1.lock", "gpu1.0.lock", "gpu1.1.lock"]
    assert workers[0].primary() == "cuda:0"  # leased once, kept


def test_no_free_slot_is_an_error_naming_the_limits(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=1)
    first.primary()
    with pytest.raises(DeviceLeaseError, match=r"all 1 GPU slots \(1 GPUs x 1 workers per GPU\) .* are leased"):
        second.primary()


def test_release_frees_the_slot(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=1)
    first.primary()
    first.release()
    assert second.primary() == "cuda:0"


def test_pair_leases_a_second_gpu_when_free(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=2)
    assert first.pair() == ("cuda:0", "cuda:1")
    with pytest.raises(DeviceLeaseError):
        second.primary()  # both GPUs are held by the first worker


def test_pair_shares_one_gpu_when_no_other_is_free(tmp_path: Path) -> None:
    first, second = _workers(tmp_path, 2, gpus=2)
    assert first.primary() == "cuda:0"
    assert second.primary() == "cuda:1"
    assert first.pair() == ("cuda:0", "cuda:0")
    assert second.pair() == ("cuda:1", "cuda:1")


def test_cpu_and_auto_without_gpus(tmp_path: Path) -> None:
    assert DeviceLeases("cpu", tmp_path, 1, gpu_count=lambda: pytest.fail("cpu must not count GPUs")).pair() == ("cpu", "cpu")
    assert _workers(tmp_path, 1, gpus=0)[0].primary() == "cpu"
    with pytest.raises(DeviceLeaseError, match="device 'cuda' was asked for, but no GPU is visible"):
        _workers(tmp_path, 1, gpus=0, setting="cuda")[0].primary()
    assert not any(tmp_path.iterdir())


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


def test_default_lock_dir_is_shared_by_the_workers_of_a_run() -> None:
    a = gpu.default_lock_dir({"PYTEST_XDIST_TESTRUNUID": "abc"})
    assert a == gpu.default_lock_dir({"PYTEST_XDIST_TESTRUNUID": "abc"})
    assert a.name == "pytest-kvcanary-abc"
    assert gpu.default_lock_dir({}) != a


def test_cuda_without_gpus_keeps_failing(tmp_path: Path) -> None:
    leases = _workers(tmp_path, 1, gpus=0, setting="cuda")[0]
    for _ in range(2):
        with pytest.raises(DeviceLeaseError):
            leases.primary()
