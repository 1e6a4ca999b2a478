"""The stock soak's liveness gates (one engine, and a prefill/decode pair): a soak whose workloads
never reused a cached prefix proved nothing about the prefix cache, and one of a hybrid model that
never restored a recurrent-state checkpoint nothing about the checkpoints; each fails saying so."""

from __future__ import annotations

import pytest

# torch loads once, here (an in-process pytester run forgets the modules it imported).
import pytest_kvcanary.soak.suite  # noqa: F401
from pytest_kvcanary.reference_engine.engine import Engine  # noqa: F401

SUITE = ("--pyargs", "pytest_kvcanary.soak.suite", "-k", "test_workload_soak and hybrid")

# The radix cache keeps KV but no request reuses a prefix: no checkpoint is ever restored.
NO_PREFIX_REUSE = """
import pytest
from pytest_kvcanary.reference_engine.radix_cache import MatchResult, RadixCache

@pytest.fixture(autouse=True)
def no_prefix_reuse(monkeypatch):
    match = RadixCache.match_prefix
    def nothing(cache, key, context=0):
        return match(cache, [], context)
    monkeypatch.setattr(RadixCache, "match_prefix", nothing)
"""


def test_a_hybrid_soak_that_restored_no_checkpoint_fails(realtester: pytest.Pytester):
    realtester.makeconftest(realtester.path.joinpath("conftest.py").read_text() + NO_PREFIX_REUSE)
    result = realtester.runpytest("--kv-canary", *SUITE, "--kv-canary-soak-rounds=2")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*_ test_workload_soak?hybrid? _*", "E *the soak restored no recurrent-state checkpoint*",
                                 "*_ test_workload_soak_prefill_decode?hybrid? _*",
                                 "E *the soak restored no recurrent-state checkpoint*"])


def test_a_hybrid_soak_that_restores_passes(realtester: pytest.Pytester):
    result = realtester.runpytest("--kv-canary", *SUITE, "--kv-canary-soak-rounds=2")
    result.assert_outcomes(passed=2)


MHA = ("--pyargs", "pytest_kvcanary.soak.suite", "-k", "test_workload_soak and mha")


def test_a_soak_whose_cache_path_is_switched_off_fails_naming_it(realtester: pytest.Pytester):
    """The radix cache made to match nothing: the engine counts no prefix hit (`liveness`), and both
    mha soaks fail, giving the counts (mutation: the gate removed, both pass)."""
    realtester.makeconftest(realtester.path.joinpath("conftest.py").read_text() + NO_PREFIX_REUSE)
    result = realtester.runpytest("--kv-canary", *MHA, "--kv-canary-soak-rounds=2")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*_ test_workload_soak?mha? _*",
                                 "E *the soak reused no cached prefix (pauses 0, prefix hits 0, retractions *)*",
                                 "*_ test_workload_soak_prefill_decode?mha? _*",
                                 "E *the soak reused no cached prefix (pauses 0, prefix hits 0, *)*"])


def test_a_soak_that_reuses_prefixes_passes(realtester: pytest.Pytester):
    result = realtester.runpytest("--kv-canary", *MHA, "--kv-canary-soak-rounds=2")
    result.assert_outcomes(passed=2)
