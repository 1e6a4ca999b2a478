"""The README's main job under xdist: examples on the reference engine, single and
prefill/decode, clean and with faults injected, green, quiet (the faults the examples inject are
expected, so nothing is warned about), every worker on a device it could lease (more workers than
GPUs share them). Two files of the examples, not all of them: `.ci/run` runs the whole main job
as the README gives it, and the whole suite nested in this already parallel run cost a third of
the main suite's time on a 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pytest_kvcanary.gpu import count_gpus

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("examples/test_baseline.py", "examples/test_pd.py")  # 7 tests, 2 of them with faults


def _run_examples(tmp_path: Path, workers: int) -> dict:
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--kv-canary", *EXAMPLES, "-n", str(workers), "-p", "no:cacheprovider",
         f"--kv-canary-report={report}", "-q"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "= kv-canary =" in proc.stdout and " failed" not in proc.stdout
    assert "Warning" not in out and "warnings summary" not in out and "unexpected violations" not in out, out[-4000:]
    data = json.loads(report.read_text())
    tests = data["tests"]
    assert len(tests) == 7 and all(t["outcome"] == "passed" for t in tests)
    assert {t["worker"] for t in tests} == {f"gw{i}" for i in range(workers)}
    # every engine that ran reports a healthy canary
    for engine in data["engines"]:
        for side, stats in engine["sides"].items():
            assert stats["health"] == "ok", (engine["worker"], side, stats)
    return data


def _worker_devices(data: dict) -> dict[str, str]:
    """worker -> its primary lease: the device of its tests (a PD pair's prefill side)."""
    leases = {(t["worker"], t["device"].split(",")[0]) for t in data["tests"]}
    assert len(leases) == len({worker for worker, _ in leases}), leases
    return dict(leases)


def test_example_suite_is_green_under_two_workers(tmp_path: Path) -> None:
    devices = _worker_devices(_run_examples(tmp_path, 2))
    gpus = count_gpus()
    expected = {0: ["cpu", "cpu"], 1: ["cuda:0", "cuda:0"]}.get(gpus, ["cuda:0", "cuda:1"])
    assert sorted(devices.values()) == expected, devices


@pytest.mark.skipif(count_gpus() < 2, reason="needs two GPUs")
def test_four_workers_share_two_gpus(tmp_path: Path) -> None:
    devices = _worker_devices(_run_examples(tmp_path, 4))
    assert Counter(devices.values()) == {"cuda:0": 2, "cuda:1": 2}, devices
