"""The toy adapter of docs/adapters.md (examples/adapter/toy_engine.py) runs the fixtures through the seam:
clean runs are clean, each fault the injector can make on it is named at its first read, and
attention kinds and fault modes it lacks skip naming the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

TOY_ENGINE = Path(__file__).parents[2] / "examples" / "adapter" / "toy_engine.py"

TESTS = '''
import pytest


def test_clean_requests_leave_no_violation(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()
    assert kv_canary.written_slots() > 0


@pytest.mark.kv_perturb("real_kv_used", warmup_steps=2)
def test_a_flipped_byte_is_caught_where_it_is_read(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="full")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_perturb("req_to_token", warmup_steps=2)
def test_a_wrong_mapping_entry_is_caught_at_head(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_violation("verify_chain_hash", phase="HEAD")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_perturb("real_kv_post_forward", warmup_steps=1)
def test_damage_after_the_stamp_is_caught_by_the_next_read(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD")


@pytest.mark.kv_attention("swa")
def test_swa_is_not_a_toy_kind(kv_engine):
    raise AssertionError("the toy engine has no swa: this test must skip")


@pytest.mark.kv_perturb("next_token_swap")
def test_the_toy_cannot_be_fed_another_token(kv_engine):
    raise AssertionError("the toy engine has no feed_token: this test must skip")
'''


def test_the_toy_adapter_runs_the_fixtures(realtester: pytest.Pytester) -> None:
    realtester.makepyfile(toy_engine=TOY_ENGINE.read_text(), test_toy=TESTS)
    realtester.syspathinsert()
    result = realtester.runpytest_subprocess("-p", "toy_engine", "--kv-canary", "--kv-canary-engine=toy", "-rs")
    result.assert_outcomes(passed=4, skipped=2)
    result.stdout.fnmatch_lines(["*the toy engine has no swa attention*"])
    result.stdout.fnmatch_lines(["*kv_perturb('next_token_swap') needs an engine that can feed a forward another "
                                 "token (GuardedEngine.feed_token); the single engine (ToyEngine) has none*"])
