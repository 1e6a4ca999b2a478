"""The stock workload soak as a user runs it, against the reference engine by name with no test
code of theirs: `pytest --kv-canary --pyargs pytest_kvcanary.soak.suite`. The terminal summary and
the JSON report say what it found (rounds, forwards, verdicts); a round it cannot trust fails the
test with a replay that reruns the smallest workload still failing, through an option."""

from __future__ import annotations

import json

import pytest

# torch loads once, here: an in-process pytester run forgets the modules it imported, and torch
# cannot be imported a second time in one process.
import pytest_kvcanary.soak.suite  # noqa: F401
from pytest_kvcanary.reference_engine.engine import Engine  # noqa: F401

SUITE = ("--pyargs", "pytest_kvcanary.soak.suite")
ONE_MHA_SOAK = ("-k", "test_workload_soak and mha and not prefill")

# The table of tokens the canary checks against is wrong at position 0 of prompts that start with an
# odd token, during each test (the model's K/V is untouched): every round with such a prompt is a
# suspected false alarm.
WRONG_TOKEN_TABLE = """
import pytest
from pytest_kvcanary.reference_engine.engine import Engine

@pytest.fixture(autouse=True)
def wrong_token_table(monkeypatch):
    note_rows = Engine._note_rows
    def noting(engine, batch):
        note_rows(engine, batch)
        for req in batch.reqs:
            if req.prompt_ids[0] % 2:
                engine.token_table[req.row, 0] = req.prompt_ids[0] ^ 2
    monkeypatch.setattr(Engine, "_note_rows", noting)
"""


def test_a_clean_soak_reports_its_rounds_forwards_and_verdicts(realtester: pytest.Pytester):
    result = realtester.runpytest("--kv-canary", *SUITE, *ONE_MHA_SOAK, "--kv-canary-soak-rounds=2",
                                  "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r"workload soak: 1 soak, 2 rounds, \d+ forwards: 2 clean$"])
    soak = json.loads((realtester.path / "kv.json").read_text())["soak"]
    assert soak["soaks"] == 1 and soak["rounds"] == 2 and soak["forwards"] > 0 and soak["failures"] == []
    assert soak["verdicts"] == {"clean": 2, "engine defect": 0, "damage detected": 0, "damage missed": 0,
                                "suspected false alarm": 0}
    test = json.loads((realtester.path / "kv.json").read_text())["tests"][0]
    assert test["expected"] and test["soaks"][0]["rounds"] == 2


def test_a_suspected_false_alarm_fails_with_a_replay_the_option_reruns(realtester: pytest.Pytester):
    realtester.makeconftest(realtester.path.joinpath("conftest.py").read_text() + WRONG_TOKEN_TABLE)
    result = realtester.runpytest("--kv-canary", *SUITE, *ONE_MHA_SOAK, "--kv-canary-soak-rounds=1",
                                  "--kv-canary-report=kv.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the soak found 1 round(s) it cannot trust*suspected false alarm*",
                                 "*to rerun the smallest failing workload, add --kv-canary-soak-replay=*",
                                 "workload soak: 1 soak, 1 rounds, * forwards: 1 suspected false alarm",
                                 "  *test_workload_soak?mha? round 0: suspected false alarm (* requests); replay: *"])
    failure = json.loads((realtester.path / "kv.json").read_text())["soak"]["failures"][0]
    assert failure["verdict"] == "suspected false alarm" and failure["reproduced"]
    replay = failure["replay"]
    assert f"--kv-canary-soak-replay='{replay}'" in result.stdout.str()
    again = realtester.runpytest("--kv-canary", *SUITE, *ONE_MHA_SOAK, f"--kv-canary-soak-replay={replay}")
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines([f"workload soak: 1 soak, {replay.count('/')} rounds, * forwards: *suspected false alarm*"])


@pytest.mark.parametrize(("option", "message"), [
    ("--kv-canary-soak-replay=7/2:x", "--kv-canary-soak-replay must be a workload as a soak failure prints it "
                                      "(a request reads 'stem.stem_len+tail.tail_len*max_new@wave[~context][!abort]"
                                      "[^pause_after.pause_length]'; got 'x'); got '7/2:x'"),
    ("--kv-canary-soak-rounds=0", "--kv-canary-soak-rounds must be an integer >= 1; got '0'"),
])
def test_a_bad_soak_option_is_a_usage_error(realtester: pytest.Pytester, option: str, message: str):
    result = realtester.runpytest("--kv-canary", *SUITE, option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {message}" in result.stderr.lines


@pytest.mark.parametrize(("replay", "why"), [
    ("0/5,2:99.16+953999.10*2@2", "round 0, request 0: stem must be -1 (none) or one of the workload's 6 stems, 0 to "
                                  "5; got 99"),
    ("0/0:-1.0+1.5*2@9", "round 0, request 0: wave must be one of the round's 2 wave(s), 0 to 1 (one more than its "
                         "gaps); got 9"),
    ("0/:-1.3+1.5*2@0", "round 0, request 0: stem_len must be 0 without a stem (stem -1); got 3"),
    ("0/:1.3+1.5*0@0", "round 0, request 0: max_new must be >= 1; got 0"),
])
def test_a_replay_no_workload_has_is_a_usage_error_naming_the_field(realtester: pytest.Pytester, replay: str,
                                                                      why: str):
    """Checked at start-up against the workload's own shapes: not an IndexError in a round, nor a
    stem that silently stands for another."""
    result = realtester.runpytest("--kv-canary", *SUITE, f"--kv-canary-soak-replay={replay}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line.strip()] == [
        f"ERROR: --kv-canary-soak-replay must be a workload as a soak failure prints it ({why}); got '{replay}'"]


@pytest.mark.parametrize("replay", ["0/0:-1.0+1.5000*2@0", "0/0:-1.0+1.5*100000@0"])
def test_a_replay_longer_than_the_engine_takes_fails_before_any_round_naming_the_fields(
        realtester: pytest.Pytester, replay: str):
    result = realtester.runpytest("--kv-canary", *SUITE, *ONE_MHA_SOAK, f"--kv-canary-soak-replay={replay}")
    result.assert_outcomes(failed=1)
    tail, new = replay.split("+1.")[1].split("@")[0].split("*")
    result.stdout.fnmatch_lines([f"*--kv-canary-soak-replay: replay '{replay}' does not fit this engine: round 0, "
                                 f"request 0: stem_len + tail_len + max_new (0 + {tail} + {new}) exceeds the engine's "
                                 "longest request (256 tokens)"])
    assert "Traceback" not in result.stdout.str() and "During handling" not in result.stdout.str()
    assert "forwards=0 " in result.stdout.str(), "no round ran"
