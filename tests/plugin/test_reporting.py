"""Failure sections, the replay command, JUnit properties, the terminal summary and the JSON report."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET

import pytest

SUITE = """
import pytest

@pytest.mark.kv_attention("mha", "swa")
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill")
def test_detected(kv_pd, kv_canary):
    kv_pd.send_parallel_requests(4, distinct_prompts=True)
    kv_canary.assert_violation("verify_real_kv_hash", side="decode")
    kv_canary.assert_no_violation(side="prefill")

@pytest.mark.kv_canary(sweep_interval=2)
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill")
def test_escaped(kv_pd, kv_canary):
    kv_pd.send_parallel_requests(4)
    kv_canary.assert_violation("verify_real_kv_hash", side="decode")

def test_clean(kv_engine, kv_canary):
    kv_engine.generate(["a", "b"], max_new_tokens=2)
    kv_canary.assert_no_violation()
"""


def test_failure_section_has_seed_replay_and_tables(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    result = kvtester.runpytest("--kv-canary", "--kv-canary-seed=3", "--kv-canary-device=cpu")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*- kv-canary -*",
        "seed: 3",
        "replay: pytest test_suite.py::test_escaped --kv-canary=log --kv-canary-seed=3 --kv-canary-real-data=partial "
        "--kv-canary-sweep-interval=2 --kv-canary-device=cpu --kv-canary-engine=reference",
        "violations: none",
        "ledger (1 injection):",
        "*mode*side*group*slot*position*row*byte*step*status*cause",
        "*real_kv_post_forward*prefill*full*escaped*slot freed by radix dedup before any read",
    ])


def test_replay_command_reruns_the_failed_test(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    sub = kvtester.mkdir("sub")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        first = kvtester.runpytest(str(kvtester.path / "test_suite.py"), "--kv-canary", "--kv-canary-seed=3")
    replay = next(line for line in first.outlines if line.startswith("replay: "))
    program, *args = shlex.split(replay.removeprefix("replay: "))
    assert program == "pytest" and args[0] == "../test_suite.py::test_escaped"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        again = kvtester.runpytest(*args)
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines(["replay: pytest ../test_suite.py::test_escaped --kv-canary=log --kv-canary-seed=3 *"])


def test_parametrized_ids_are_quoted_in_the_replay(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_attention("mha", "swa")
        def test_fails(kv_engine):
            assert False
    """)
    result = kvtester.runpytest("--kv-canary")
    result.stdout.fnmatch_lines(["replay: pytest 'test_parametrized_ids_are_quoted_in_the_replay.py::test_fails[[]mha[]]' *"])


def test_junit_properties(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    kvtester.runpytest("--kv-canary", "--kv-canary-seed=3", "--junitxml=junit.xml")
    cases = {case.get("name"): case for case in ET.parse(kvtester.path / "junit.xml").iter("testcase")}
    props = {name: {p.get("name"): p.get("value") for p in case.iter("property")} for name, case in cases.items()}
    assert props["test_detected[mha]"] == {"kv_canary_violations": "1", "kv_canary_seed": "3"}
    assert props["test_escaped"] == {"kv_canary_violations": "0", "kv_canary_seed": "3"}


def test_terminal_summary_has_a_line_per_engine_side(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    result = kvtester.runpytest("--kv-canary")
    result.stdout.fnmatch_lines_random([
        "reference/pd/mha on cpu [[]main, 1 test[]] prefill: forwards=9 protected_tokens=36 sweeps=0 violations=0 health=ok",
        "reference/pd/mha on cpu [[]main, 1 test[]] decode: forwards=9 protected_tokens=36 sweeps=0 violations=1 health=ok",
        "reference/pd/swa on cpu [[]main, 1 test[]] prefill: *",
        "reference/pd/swa on cpu [[]main, 1 test[]] decode: *",
        "reference/pd/mha on cpu [[]main, 1 test[]] decode: forwards=9 *",  # test_escaped: its own sweep_interval
        "reference/single/mha on cpu [[]main, 1 test[]] single: forwards=3 *",
        "4 guarded tests, 2 violations, 4 engine handles",
    ])


def test_no_summary_when_nothing_was_guarded(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    result = kvtester.runpytest()
    result.assert_outcomes(skipped=4)
    assert "= kv-canary =" not in result.stdout.str()


def test_json_report(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    kvtester.runpytest("--kv-canary", "--kv-canary-seed=3", "--kv-canary-report=kv.json").stdout.fnmatch_lines(
        [f"report: {kvtester.path / 'kv.json'}"])
    report = json.loads((kvtester.path / "kv.json").read_text())
    assert report["config"]["seed"] == 3 and report["config"]["canary"]["mode"] == "log"
    tests = {t["nodeid"]: t for t in report["tests"]}
    assert sorted(tests) == ["test_suite.py::test_clean", "test_suite.py::test_detected[mha]",
                             "test_suite.py::test_detected[swa]", "test_suite.py::test_escaped"]
    detected = tests["test_suite.py::test_detected[mha]"]
    assert detected["outcome"] == "passed" and detected["device"] == "cpu" and detected["kind"] == "pd"
    assert detected["perturbs"] == [{"mode": "real_kv_post_forward", "prob": 1.0, "side": "prefill",
                                     "target_group": None, "warmup_steps": 0}]
    assert [v["reasons"] for v in detected["violations"]] == [["verify_real_kv_hash"]]
    assert detected["violations"][0]["side"] == "decode"
    escaped = tests["test_suite.py::test_escaped"]
    assert escaped["outcome"] == "failed" and escaped["canary"]["sweep_interval"] == 2
    assert [(i["status"], i["cause"]) for i in escaped["injections"]] == [
        ("escaped", "slot freed by radix dedup before any read")]
    engines = report["engines"]
    assert len(engines) == 4 and {e["device"] for e in engines} == {"cpu"}
    assert {tuple(e["sides"]) for e in engines} == {("prefill", "decode"), ("single",)}
    assert all(e["worker"] == "main" and e["retired"] is None for e in engines)
