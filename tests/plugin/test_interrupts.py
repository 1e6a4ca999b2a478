"""A run stopped by SIGTERM (a CI timeout) or by two quick Ctrl-Cs keeps the report and the
summary of the tests that finished; a worker's crash and an unwritable report path are reported
in one line each."""

from __future__ import annotations

import json
import signal

import pytest

from interrupted_run import FINISHED_THEN_BLOCK, stop_once_blocked

@pytest.mark.parametrize("stop, reason", [
    ([("controller", signal.SIGTERM)], "SIGTERM"),
    ([("group", signal.SIGINT), ("group", signal.SIGINT)], "keyboard interrupt"),
], ids=["sigterm-to-the-controller", "two-ctrl-c"])
def test_the_finished_tests_are_kept(kvtester: pytest.Pytester, stop: list[tuple[str, int]], reason: str) -> None:
    kvtester.makepyfile(test_one=FINISHED_THEN_BLOCK.format(n=3), test_two=FINISHED_THEN_BLOCK.format(n=3))
    _, out = stop_once_blocked(kvtester.path, 6, 2, stop, ["-n", "2", "--dist", "loadfile"])
    report = json.loads((kvtester.path / "kv.json").read_text())
    assert report["run"]["interrupted"] == reason
    assert sorted(t["nodeid"] for t in report["tests"] if t["outcome"] == "passed") == sorted(
        f"test_{f}.py::test_finishes[{i}]" for f in ("one", "two") for i in range(3))
    line = next(line for line in out.splitlines() if line.startswith("run interrupted"))
    assert line.startswith(f"run interrupted ({reason}): results of the 6 tests that finished; running when it "
                           "stopped: "), line
    assert sorted(line.split("stopped: ")[1].split(", ")) == ["test_one.py::test_blocks", "test_two.py::test_blocks"]
    assert f"report: {kvtester.path / 'kv.json'}" in out


def test_the_test_a_dead_worker_was_running_is_reported_as_crashed(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_dies="""
        import os, signal

        def test_ok(kv_engine):
            pass

        def test_dies(kv_engine):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = kvtester.runpytest_subprocess("-n", "1", "-p", "no:cacheprovider", "--kv-canary",
                                           "--kv-canary-report=kv.json")
    tests = {t["nodeid"]: t["outcome"] for t in json.loads((kvtester.path / "kv.json").read_text())["tests"]}
    assert tests == {"test_dies.py::test_ok": "passed", "test_dies.py::test_dies": "crashed"}
    result.stdout.fnmatch_lines(["crashed: test_dies.py::test_dies (its worker died while running it)"])


def test_a_report_path_that_becomes_unwritable_costs_one_line(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import shutil

        def test_breaks_the_report_path(kv_engine):
            shutil.rmtree("reports")
            open("reports", "w").close()  # the report's directory is now a file
    """)
    kvtester.mkdir("reports")
    result = kvtester.runpytest_subprocess("-p", "no:cacheprovider", "--kv-canary",
                                           "--kv-canary-report=reports/kv.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["1 guarded test, 0 violations (0 owned by tests that injected or checked them, "
                                 "0 unexpected), 1 engine handle",
                                 "report: could not write *reports/kv.json (*)"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


# A kernel whose loop body ends in an `if`: the loop's jump back has no line number (Python 3.11+),
# and the interpreted kernel gives the GIL away only there, so the interrupt is taken at it and
# leaves a traceback entry without a line.
KERNEL_INTERRUPTED = """
import os, signal, sys, threading

import torch
import triton
import triton.language as tl

@triton.jit
def spin(x_ptr, FOREVER: tl.constexpr):
    for i in range(FOREVER):
        if FOREVER:
            pass

def interrupt_at_the_jump_back(main):
    while True:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code.co_name == "spin" and frame.f_lineno is None:
            os.kill(os.getpid(), signal.SIGINT)
            return

def test_interrupted_inside_a_kernel():
    threading.Thread(target=interrupt_at_the_jump_back, args=(threading.get_ident(),), daemon=True).start()
    spin[(1,)](torch.zeros(1), 1 << 40)
"""


def test_an_interrupt_inside_an_interpreted_kernel_keeps_the_summary(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_kernel=KERNEL_INTERRUPTED)
    result = kvtester.runpytest_subprocess("-p", "no:cacheprovider", "--kv-canary", timeout=300)
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, out
    result.stdout.fnmatch_lines(["run interrupted (keyboard interrupt): results of the 0 tests that finished; running "
                                 "when it stopped: test_kernel.py::test_interrupted_inside_a_kernel"])
    assert "TypeError" not in out and "Traceback" not in out


@pytest.mark.parametrize("worker", [False, True])
def test_a_second_interrupt_waits_and_a_third_stops(worker: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """The controller's handlers and an xdist worker's: the first interrupt stops, the second is
    ignored (the controller says so; a worker, mid-stop, stays silent: it once raised inside
    pytest's capture teardown and printed a traceback), the third stops at once. A worker leaves
    SIGTERM alone."""
    from pytest_kvcanary.plugin_support.interrupts import IGNORED_NOTE, Interrupts

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    interrupts = Interrupts(worker=worker)
    interrupts.install()
    try:
        assert (signal.getsignal(signal.SIGTERM) is previous[signal.SIGTERM]) == worker
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        assert (IGNORED_NOTE in capsys.readouterr().err) != worker
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        interrupts.restore()
    assert {sig: signal.getsignal(sig) for sig in previous} == previous
