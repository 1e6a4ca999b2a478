"""A run stopped by signals once some tests have finished and the others are running: the suite it
runs and the driver that stops it, shared by the interrupt tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# n tests finish, then test_blocks runs until the run is stopped; it leaves a file when it starts,
# so the driver signals only once every process is inside it.
FINISHED_THEN_BLOCK = """
import os, threading

import pytest

@pytest.mark.parametrize("i", range({n}))
def test_finishes(kv_engine, i):
    kv_engine.generate(["a prompt"], max_new_tokens=1)

def test_blocks(kv_engine):
    open(f"blocking-{{os.getpid()}}", "w").close()
    threading.Event().wait()
"""


def _wait_for_blockers(path: Path, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(path.glob("blocking-*"))) < count:
        assert time.monotonic() < deadline, f"{count} tests never started blocking"
        time.sleep(0.05)


def stop_once_blocked(path: Path, passed: int, blockers: int, stop: list[tuple[str, int]],
                      extra_args: list[str]) -> tuple[int, str]:
    """Run the suite in `path`; once `passed` tests are reported (the controller's -v lines) and
    `blockers` processes are in test_blocks, send the signals `stop` names (("controller", sig):
    to the controller only; ("group", sig): to every process, as a terminal's Ctrl-C does), in
    order (under xdist, once the controller has announced each blocker's start too). The run's exit
    code and output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--kv-canary",
            "--kv-canary-report=kv.json", *extra_args]
    proc = subprocess.Popen(args, cwd=path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    chunks: list[bytes] = []
    try:
        assert proc.stdout is not None
        xdist = "-n" in extra_args
        while chunk := os.read(proc.stdout.fileno(), 65536):  # as written: a start line has no newline yet
            chunks.append(chunk)
            seen = b"".join(chunks).decode(errors="replace")
            # Under xdist the controller announces each test's start ("-v": its node id, then a space):
            # signal once it has announced every blocker, not only once they run (it hears late).
            announced = len(re.findall(r"^\S+::test_blocks ", seen, re.MULTILINE))
            if seen.count("PASSED") == passed and (not xdist or announced >= blockers):
                _wait_for_blockers(path, blockers)
                for target, sig in stop:
                    (os.kill if target == "controller" else os.killpg)(proc.pid, sig)
                break
        chunks.append(proc.stdout.read())
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "Traceback" not in out and "During handling" not in out, out
    return proc.returncode, out
