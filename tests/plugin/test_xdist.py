"""Under xdist: workers lease GPUs (sharing them when there are more workers than GPUs), results
reach the controller with each test's report, and survive a killed worker and Ctrl-C."""

from __future__ import annotations

import json
import signal

import pytest

from interrupted_run import FINISHED_THEN_BLOCK, stop_once_blocked

SUITE = """
import pytest

@pytest.mark.parametrize("i", range(6))
def test_single(kv_engine, kv_device, i):
    assert kv_engine.device == kv_device
    kv_engine.generate([f"prompt {i}"], max_new_tokens=1)

@pytest.mark.parametrize("i", range(2))
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill")
def test_pd(kv_pd, kv_canary, i):
    kv_pd.send_parallel_requests(2, distinct_prompts=True)
    kv_canary.assert_violation("verify_real_kv_hash", side="decode")

def test_fails(kv_engine):
    assert False
"""


def _report(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "kv.json").read_text())


def test_workers_results_are_merged(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    kvtester.makepyfile(test_suite=SUITE)
    result = kvtester.runpytest_subprocess(
        "-n", "2", "--kv-canary", "--kv-canary-report=kv.json", f"--kv-canary-lock-dir={kvtester.path / 'locks'}")
    result.assert_outcomes(passed=8, failed=1)
    out = result.stdout.str()
    assert out.count("= kv-canary =") == 1
    result.stdout.fnmatch_lines(["replay: pytest test_suite.py::test_fails --kv-canary=log *"])
    result.stdout.fnmatch_lines_random(["*[[]worker gw0, * single: forwards=*", "*[[]worker gw1, * single: forwards=*",
                                        "9 guarded tests, 2 violations (*), * engine handles*"])

    report = _report(kvtester)
    assert len(report["tests"]) == 9
    devices = {t["worker"]: t["device"] for t in report["tests"] if t["kind"] == "single"}
    assert sorted(devices) == ["gw0", "gw1"]
    assert sorted(devices.values()) == ["cuda:0", "cuda:1"]
    # Each worker holds one of the two GPUs and there is no spare, so a PD pair shares its worker's GPU.
    assert all(t["device"] == devices[t["worker"]] for t in report["tests"])
    assert {e["worker"] for e in report["engines"]} == {"gw0", "gw1"}


def test_two_workers_share_one_gpu(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default workers_per_gpu (auto): a one-GPU machine runs `-n 2` green, both on cuda:0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    kvtester.makepyfile(test_suite=SUITE.replace("def test_fails", "def _unused"))
    result = kvtester.runpytest_subprocess("-n", "2", "--kv-canary", "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=8)
    assert "are leased" not in result.stdout.str() + result.stderr.str()
    tests = _report(kvtester)["tests"]
    assert {t["worker"] for t in tests} == {"gw0", "gw1"} and {t["device"] for t in tests} == {"cuda:0"}


def test_a_full_cap_makes_a_worker_wait_and_say_so(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU, two workers, at most one worker per GPU: the second waits (visibly) until the
    first is done, and the run is green."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    kvtester.makepyfile(test_suite=SUITE.replace("def test_fails", "def _unused"))
    result = kvtester.runpytest_subprocess("-n", "2", "--kv-canary", "--kv-canary-workers-per-gpu=1",
                                           "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=8)
    assert "GPU slots (1 GPUs x 1 workers per GPU, --kv-canary-workers-per-gpu) under " in result.stderr.str()
    assert "waiting for one to free up" in result.stderr.str()
    assert {t["device"] for t in _report(kvtester)["tests"]} == {"cuda:0"}


def test_the_run_removes_its_lock_dir(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    tmp = kvtester.mkdir("tmp")
    monkeypatch.setenv("TMPDIR", str(tmp))
    kvtester.makepyfile("def test_device(kv_device, tmp_path_factory): assert kv_device == 'cuda:0'")
    for xdist in ([], ["-n", "2"]):
        kvtester.runpytest_subprocess("--kv-canary", "-p", "no:cacheprovider", *xdist).assert_outcomes(passed=1)
        assert not list(tmp.glob("pytest-kvcanary-*"))


# Files of a run with one worker per file (--dist loadfile): a worker finishes some tests, then
# its last test kills it or blocks until Ctrl-C.
FINISHED_THEN = """
import os, signal, threading

import pytest

@pytest.mark.parametrize("i", range({n}))
def test_finishes(kv_engine, i):
    kv_engine.generate(["a prompt"], max_new_tokens=1)

def test_last(kv_engine):
    {last}
"""
KILL = "if not os.path.exists('died'): open('died', 'w').close(); os.kill(os.getpid(), signal.SIGKILL)"


def test_a_killed_workers_finished_tests_are_kept(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_dies=FINISHED_THEN.format(n=3, last=KILL),
                        test_lives=FINISHED_THEN.format(n=2, last="pass"))
    result = kvtester.runpytest_subprocess("-n", "2", "--dist", "loadfile", "--kv-canary",
                                           "--kv-canary-report=kv.json")
    # The crash fails test_last; the replacement worker runs it again (and survives: it kills once).
    result.assert_outcomes(passed=7, failed=1)
    report = _report(kvtester)
    passed = sorted(t["nodeid"] for t in report["tests"] if t["outcome"] == "passed")
    assert passed == sorted([f"test_dies.py::test_finishes[{i}]" for i in range(3)] + ["test_dies.py::test_last"]
                            + [f"test_lives.py::test_finishes[{i}]" for i in range(2)] + ["test_lives.py::test_last"])
    died = report["run"]["crashed_workers"]
    assert len(died) == 1 and died[0]["worker"] in ("gw0", "gw1")
    result.stdout.fnmatch_lines([f"worker {died[0]['worker']} died (*); the tests it finished are included"])


@pytest.mark.parametrize("xdist", [["-n", "2", "--dist", "loadfile"], []], ids=["xdist", "one-process"])
def test_ctrl_c_keeps_the_finished_tests_and_prints_no_traceback(kvtester: pytest.Pytester, xdist: list[str]) -> None:
    kvtester.makepyfile(test_one=FINISHED_THEN_BLOCK.format(n=3), test_two=FINISHED_THEN_BLOCK.format(n=2))
    want = 5 if xdist else 3  # one process blocks in test_one's last test
    # A terminal's Ctrl-C signals the whole foreground process group: the controller and workers.
    _, out = stop_once_blocked(kvtester.path, want, 2 if xdist else 1, [("group", signal.SIGINT)], xdist)
    report = json.loads((kvtester.path / "kv.json").read_text())
    assert report["run"]["interrupted"] == "keyboard interrupt"
    assert sum(t["outcome"] == "passed" for t in report["tests"]) == want
    assert f"run interrupted (keyboard interrupt): results of the {want} tests that finished" in out
