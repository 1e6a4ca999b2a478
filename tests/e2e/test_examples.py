"""The README's main job: `pytest --kv-canary examples/` on the reference engine, under xdist."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_example_suite_is_green_under_two_workers(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--kv-canary", "examples/", "-n", "2", "-p", "no:cacheprovider",
         f"--kv-canary-report={report}", "-q"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "kv-canary" in proc.stdout and " failed" not in proc.stdout
    data = json.loads(report.read_text())
    tests = data["tests"]
    assert len(tests) >= 12 and all(t["outcome"] == "passed" for t in tests)
    workers = {t["worker"] for t in tests}
    assert workers == {"gw0", "gw1"}, workers
    # every engine that ran reports a healthy canary
    for engine in data["engines"]:
        for side, stats in engine["sides"].items():
            assert stats["health"] == "ok", (engine["worker"], side, stats)
