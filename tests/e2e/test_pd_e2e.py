"""Through the plugin: a kv_pd test on the real prefill/decode pair, and the radix dedup race
explained in the failure instead of a bare "no violation found"."""

from __future__ import annotations

import pytest

PD_TESTS = """
    import pytest

    pytestmark = [pytest.mark.kv_canary(sweep_interval=0),
                  pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", target_group="full")]

    def test_distinct_prompts_surface_on_decode(kv_pd, kv_canary):
        kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=2)
        kv_canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD",
                                   require_distinct_prompts=True)
        kv_canary.assert_no_violation(side="prefill")

    def test_identical_prompts_are_refused(kv_pd, kv_canary):
        kv_pd.send_parallel_requests(4, max_new_tokens=2)
        kv_canary.assert_violation("verify_real_kv_hash", side="decode", require_distinct_prompts=True)

    def test_identical_prompts_escape_is_explained(kv_pd, kv_canary):
        kv_pd.send_parallel_requests(4, max_new_tokens=2)
        kv_canary.assert_violation("verify_real_kv_hash", side="decode")
"""


def test_pd_pair_through_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(PD_TESTS)
    result = pytester.runpytest("--kv-canary", "--kv-canary-seed=0", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*test_identical_prompts_are_refused*",
        "*1 prompt(s) were sent more than once since the reset*distinct_prompts=True*",
        "*test_identical_prompts_escape_is_explained*",
        "*escaped: real_kv_post_forward on prefill full slot * at step 0: radix dedup freed the duplicate's slot*",
        "*hint: the radix cache dedups identical prompts*",
        "reference/pd/mha on * [[]worker main, 3 tests[]] prefill: *violations=0 health=ok",
        "reference/pd/mha on * [[]worker main, 3 tests[]] decode: *health=ok",
        # HEAD of the first decode forward
        "3 guarded tests, 1 violation (1 owned by tests that injected or checked them, "
        "0 unexpected), 1 engine handle (2 lines: a prefill/decode handle has two sides)",
    ])
