"""Under xdist, workers lease distinct GPUs and the controller merges their results."""

from __future__ import annotations

import json

import pytest

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


def test_workers_results_are_merged(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    kvtester.makepyfile(test_suite=SUITE)
    result = kvtester.runpytest_subprocess(
        "-n", "2", "--kv-canary", "--kv-canary-report=kv.json", f"--kv-canary-lock-dir={kvtester.path / 'locks'}")
    result.assert_outcomes(passed=8, failed=1)
    out = result.stdout.str()
    assert out.count("= kv-canary =") == 1
    result.stdout.fnmatch_lines(["replay: pytest test_suite.py::test_fails --kv-canary=log *"])
    result.stdout.fnmatch_lines_random(["*[[]gw0, * single: forwards=*", "*[[]gw1, * single: forwards=*",
                                        "9 guarded tests, 2 violations, * engine handles"])

    report = json.loads((kvtester.path / "kv.json").read_text())
    assert len(report["tests"]) == 9
    devices = {t["worker"]: t["device"] for t in report["tests"] if t["kind"] == "single"}
    assert sorted(devices) == ["gw0", "gw1"]
    assert sorted(devices.values()) == ["cuda:0", "cuda:1"]
    # Each worker holds one of the two GPUs, so a PD pair shares its worker's GPU.
    assert all(t["device"] == devices[t["worker"]] for t in report["tests"])
    assert {e["worker"] for e in report["engines"]} == {"gw0", "gw1"}
