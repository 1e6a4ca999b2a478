"""The plugin's reporting logic over the fake harness: failure sections, the replay command, JUnit
properties, quiet runs, unexpected violations, per-engine sums and the JSON report. What the
real engine's reports say is checked in test_real_engine.py."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET

import pytest

OWNED = "owned by tests that injected or checked them"

SUITE = """
import pytest

@pytest.mark.kv_attention("mha", "swa")
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", target_group="full")
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


def test_failure_section_has_seed_and_replay_and_each_table_once(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite=SUITE)
    result = kvtester.runpytest("--kv-canary", "--kv-canary-seed=3", "--kv-canary-device=cpu")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*- kv-canary -*",
        "seed: 3",
        "replay: pytest test_suite.py::test_escaped --kv-canary=log --kv-canary-seed=3 --kv-canary-real-data=partial "
        "--kv-canary-sweep-interval=2 --kv-canary-device=cpu --kv-canary-engine=reference",
    ])
    out = result.stdout.str()
    # The assertion's message shows the tables; the section does not repeat them.
    assert out.count("ledger (1 injection):") == 1 and out.count("violations: none") == 1


def test_a_failure_the_canary_did_not_explain_gets_the_tables(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used")
        def test_fails(kv_engine, kv_canary):
            kv_engine.send_parallel_requests(2, distinct_prompts=True)
            assert kv_canary.violations() == []
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["seed: 0", "replay: *", "violations (1):", "*side*step*phase*", "*",
                                 "ledger (1 injection):"])


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


def test_expected_violations_are_quiet_and_unexpected_ones_are_one_block(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used")
        def test_injects(kv_engine):
            kv_engine.send_parallel_requests(2, distinct_prompts=True)

        def test_asserts(kv_engine, kv_canary):
            kv_engine.stray()
            assert len(kv_canary.violations()) == 1

        def test_stray_one(kv_engine):
            kv_engine.stray()

        def test_stray_two(kv_engine, kv_canary):
            kv_engine.stray()
    """)
    result = kvtester.runpytest("--kv-canary", "-rP", "-W", "error")
    result.assert_outcomes(passed=4)
    out = result.stdout.str()
    assert "warnings summary" not in out and "Warning" not in out
    result.stdout.fnmatch_lines([
        "*= kv-canary =*",
        f"4 guarded tests, 4 violations (2 {OWNED}, 2 unexpected), 1 engine handle",
        "unexpected violations: 2 violations in 2 tests that neither injected faults nor checked them with kv_canary",
        "test_expected_violations_are_quiet_and_unexpected_ones_are_one_block.py::test_stray_one (seed 0, single/mha "
        "on cpu):",
        "violations (1):",
        "*",
        "  single  2 * verify_chain_hash *",
        "*::test_stray_two (seed 0, single/mha on cpu):",
    ])
    assert "test_injects (seed" not in out and "test_asserts (seed" not in out
    # -rP shows each passing test's sections: the stray ones carry their table.
    result.stdout.fnmatch_lines(["*- kv-canary -*", "unexpected violations (1):"])


def test_engine_lines_sum_the_tests_each_engine_served(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("n", [1, 2, 3])
        @pytest.mark.kv_perturb("real_kv_used")
        def test_single(kv_engine, n):
            kv_engine.send_parallel_requests(n, distinct_prompts=True, max_new_tokens=n)

        @pytest.mark.kv_perturb("real_kv_post_forward", side="prefill")
        def test_pd(kv_pd):
            kv_pd.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=4)
            kv_pd.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=4)
    """)
    result = kvtester.runpytest("--kv-canary", "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=4)
    # forwards per generate = 1 + max_new_tokens: 2 + 3 + 4 on the single engine
    result.stdout.fnmatch_lines_random([
        "reference/single/mha on cpu [[]worker main, 3 tests[]] single: forwards=9 protected_tokens=36 sweeps=0 "
        "violations=3 health=ok",
        "reference/pd/mha on cpu [[]worker main, 1 test[]] decode: forwards=10 * violations=2 health=ok",
        f"4 guarded tests, 5 violations (5 {OWNED}, 0 unexpected), 2 engine handles (3 lines: a "
        "prefill/decode handle has two sides)",
    ])
    report = json.loads((kvtester.path / "kv.json").read_text())
    for engine in report["engines"]:
        served = [t for t in report["tests"] if (t["worker"], t["handle"]) == (engine["worker"], engine["handle"])]
        assert engine["tests"] == len(served)
        for side, total in engine["sides"].items():
            for counter in ("forwards", "protected_tokens", "sweeps", "violations", "rows", "dropped"):
                assert total[counter] == sum(t["stats"][side][counter] for t in served), (side, counter)
            assert total["violations"] == sum(v["side"] == side for t in served for v in t["violations"])


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
    assert report["run"] == {"interrupted": None, "crashed_workers": []}
    tests = {t["nodeid"]: t for t in report["tests"]}
    assert sorted(tests) == ["test_suite.py::test_clean", "test_suite.py::test_detected[mha]",
                             "test_suite.py::test_detected[swa]", "test_suite.py::test_escaped"]
    detected = tests["test_suite.py::test_detected[mha]"]
    assert detected["outcome"] == "passed" and detected["device"] == "cpu" and detected["kind"] == "pd"
    assert detected["expected"] is True and tests["test_suite.py::test_clean"]["expected"] is True
    assert detected["perturbs"] == [{"mode": "real_kv_post_forward", "prob": 1.0, "side": "prefill",
                                     "target_group": "full", "warmup_steps": 0, "rank": None}]
    assert [(v["reasons"], v["side"], v["request"]) for v in detected["violations"]] == [
        (["verify_real_kv_hash"], "decode", None)]
    assert set(detected["stats"]) == {"prefill", "decode"}
    escaped = tests["test_suite.py::test_escaped"]
    assert escaped["outcome"] == "failed" and escaped["canary"]["sweep_interval"] == 2
    assert [(i["status"], i["cause"]) for i in escaped["injections"]] == [
        ("escaped", "slot freed by radix dedup before any read")]
    engines = report["engines"]
    assert len(engines) == 4 and {e["device"] for e in engines} == {"cpu"}
    assert {tuple(e["sides"]) for e in engines} == {("prefill", "decode"), ("single",)}
    assert all(e["worker"] == "main" and e["retired"] is None for e in engines)


def test_engine_lines_name_the_canary_settings_that_tell_them_apart(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        def test_default(kv_engine):
            kv_engine.send_parallel_requests(1)

        @pytest.mark.kv_canary(sweep_interval=2)
        def test_often(kv_engine):
            kv_engine.send_parallel_requests(1)
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random([
        "reference/single/mha on cpu [[]worker main, 1 test, sweep_interval=4[]] single: *",
        "reference/single/mha on cpu [[]worker main, 1 test, sweep_interval=2[]] single: *",
    ])


def test_the_summary_and_the_json_report_name_each_workers_devices(tmp_path) -> None:
    """Which devices each worker's tests ran on: its GPU, and a parallel engine's ranks'."""
    from pytest_kvcanary.report import EngineRef, ReportEntry, RunResults

    results = RunResults()
    for worker, device, tp in (("gw0", "cuda:0", 1), ("gw0", "cuda:0,cuda:1", 2), ("gw1", "cuda:1", 1),
                               ("gw0", "cuda:0", 1)):
        ref = EngineRef(worker, 0 if tp == 1 else 1, "reference", "single", "mha", device, {}, tp=tp)
        results.add_test(ReportEntry.guarded("t", "passed", ref, seed=0, perturbs=[], violations=[], requests=[],
                                             injections=[], stats={}, expected=False, read_error=None))
    assert "devices: gw0 -> cuda:0, cuda:0,cuda:1; gw1 -> cuda:1" in results.summary_lines()
    results.write_json(tmp_path / "r.json", {})
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workers"] == {"gw0": ["cuda:0", "cuda:0,cuda:1"], "gw1": ["cuda:1"]}
    assert [(e["device"], e["tp"], e["pp"]) for e in report["engines"]] == [
        ("cuda:0", 1, 1), ("cuda:0,cuda:1", 2, 1), ("cuda:1", 1, 1)]


def test_the_line_count_note_names_parallel_ranks() -> None:
    """A parallel handle has a line per rank (its stats are keyed "<side> rank <r>"): the note on
    lines per handle says so, not only that a prefill/decode handle has two sides."""
    from pytest_kvcanary.report import EngineRef, ReportEntry, RunResults

    results = RunResults()
    ref = EngineRef("main", 0, "reference", "single", "mha", "cpu", {}, tp=2)
    stats = {f"single rank {r}": {"forwards": 1} for r in range(2)}
    results.add_test(ReportEntry.guarded("t", "passed", ref, seed=0, perturbs=[], violations=[], requests=[],
                                         injections=[], stats=stats, expected=False, read_error=None))
    assert results.summary_lines()[2] == ("1 guarded test, 0 violations (0 owned by tests that injected or checked "
                                          "them, 0 unexpected), 1 engine handle (2 lines: a parallel handle has one "
                                          "per rank)")


def test_the_summary_says_which_tests_it_does_not_count(kvtester: pytest.Pytester) -> None:
    """Tests that ran without kv_engine or kv_pd (examples that build their own engine among them)
    are not guarded tests: a line says how many, so the count does not read as the run's."""
    kvtester.makepyfile("""
        def test_guarded(kv_engine): pass
        def test_builds_its_own_engine(): pass
        def test_plain(): pass
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["1 guarded test, 0 violations (*), 1 engine handle",
                                 "2 other tests ran without kv_engine or kv_pd: not guarded, not counted above (a test "
                                 "that builds its own engine is one)"])
