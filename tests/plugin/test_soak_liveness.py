"""The liveness gate of a hybrid model's soaks (one engine, and a prefill/decode pair): a soak
whose workloads never restored a recurrent-state checkpoint proved nothing about the checkpoints,
and fails saying so."""

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
