"""The reference engine's timing options (--kv-canary-reference-scheduling,
--kv-canary-reference-jitter-seed and their ini twins): checked at start-up, handed to the engines
and pairs the plugin builds, shown in the header and carried by the replay command."""

from __future__ import annotations

import pytest
import torch  # noqa: F401  # loaded before the inline runs, which build engines

# What the reference engine's plugin builds under the run's options: a single engine and a pair.
SHOW_TIMING = """
from pytest_kvcanary.adapters import EngineSpec, reference_hooks

def test_show(pytestconfig):
    spec = EngineSpec("reference", "mha", "cpu", 0, config=pytestconfig)
    single = reference_hooks.pytest_kvcanary_make_engine(spec)
    pair = reference_hooks.pytest_kvcanary_make_pd_pair(spec)
    for name, engine in (("single", single), ("prefill", pair.prefill), ("decode", pair.decode)):
        print("TIMING", name, engine.config.async_scheduling, engine.config.jitter_seed)
"""


@pytest.mark.parametrize(
    "ini, args, expected",
    [
        ("", (), ("False None", "False None", "False None")),
        ("kv_canary_reference_scheduling = async\nkv_canary_reference_jitter_seed = 4", (),
         ("True 4", "False 4", "True 4")),  # a pair's prefill side only prefills: synchronously
        ("kv_canary_reference_scheduling = async",
         ("--kv-canary-reference-scheduling=sync", "--kv-canary-reference-jitter-seed=0"),
         ("False 0", "False 0", "False 0")),  # the command line over the ini file
    ],
    ids=["default", "ini", "cli-over-ini"],
)
def test_the_options_reach_the_engines_and_pairs(kvtester: pytest.Pytester, ini: str, args: tuple[str, ...],
                                                 expected: tuple[str, str, str]) -> None:
    kvtester.makepyfile(SHOW_TIMING)
    kvtester.makeini(f"[pytest]\n{ini}\n")
    result = kvtester.runpytest("-s", *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*TIMING {side} {shown}" for side, shown in zip(("single", "prefill", "decode"),
                                                                                 expected)])


def test_the_header_and_the_replay_command_name_the_timing(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite="def test_fails(kv_engine): assert False")
    result = kvtester.runpytest("--kv-canary", "--kv-canary-device=cpu", "--kv-canary-reference-scheduling=async",
                                "--kv-canary-reference-jitter-seed=7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "kv-canary: mode=log * engine=reference reference_scheduling=async reference_jitter_seed=7",
        "replay: pytest test_suite.py::test_fails * --kv-canary-reference-scheduling=async "
        "--kv-canary-reference-jitter-seed=7"])
