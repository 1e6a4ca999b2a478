"""The kv_perturb, kv_attention and kv_canary markers, and skipping when the canary is off."""

from __future__ import annotations

import pytest

from pytest_kvcanary.config import ATTENTION_KINDS
from pytest_kvcanary.plugin import OFF_REASON


def test_markers_are_registered(kvtester: pytest.Pytester) -> None:
    result = kvtester.runpytest("--markers")
    result.stdout.fnmatch_lines([
        "@pytest.mark.kv_perturb(mode, *, prob=1.0, side=None, target_group=None, warmup_steps=0): *",
        "@pytest.mark.kv_attention(*kinds): *",
        "@pytest.mark.kv_canary(**overrides): *",
    ])


def test_kv_fixtures_skip_when_the_canary_is_off(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        def test_engine(kv_engine): pass
        def test_pd(kv_pd): pass
        def test_canary(kv_canary): pass
        def test_plain(): pass
    """)
    result = kvtester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines([f"SKIPPED *: {OFF_REASON}"] * 3)


def test_marker_can_turn_the_canary_off_for_one_test(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(mode="off")
        def test_off(kv_engine): pass
    """)
    result = kvtester.runpytest("--kv-canary", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*kv-canary is off for this test: its kv_canary marker sets mode='off'"])


def test_marker_cannot_turn_on_a_run_that_is_off(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(mode="raise")
        def test_on(kv_engine): pass
    """)
    kvtester.runpytest().assert_outcomes(skipped=1)


def test_perturb_markers_become_specs(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest
        from pytest_kvcanary.config import PerturbSpec

        pytestmark = pytest.mark.kv_perturb("req_to_token")

        @pytest.mark.kv_perturb("real_kv_used", prob=0.5, warmup_steps=2, target_group="full")
        @pytest.mark.kv_perturb(mode="real_kv_post_forward", side="prefill")
        def test_pd(kv_pd):
            assert set(kv_pd.perturbs) == {
                PerturbSpec("req_to_token"),
                PerturbSpec("real_kv_used", prob=0.5, warmup_steps=2, target_group="full"),
                PerturbSpec("real_kv_post_forward", side="prefill"),
            }
            assert kv_pd.resets[-1] == (0, kv_pd.perturbs)

        def test_module_marker_only(kv_engine):
            assert kv_engine.perturbs == (PerturbSpec("req_to_token"),)
    """)
    kvtester.runpytest("--kv-canary").assert_outcomes(passed=2)


BAD_MARKERS = [
    ('kv_perturb("flip_everything")',
     "kv_perturb('flip_everything'): kv_perturb mode must be one of req_to_token, real_kv_used, "
     "real_kv_unused_cache, real_kv_post_forward, next_token_swap, real_kv_host; got 'flip_everything'"),
    ('kv_perturb("req_to_token", probability=1)',
     "kv_perturb('req_to_token', probability=1): unknown keyword 'probability'; "
     "allowed: prob, side, target_group, warmup_steps"),
    ('kv_perturb("req_to_token", prob=2)', "kv_perturb('req_to_token', prob=2): prob must be a number in [[]0, 1[]]; got 2"),
    ('kv_perturb("req_to_token", target_group="local")',
     "kv_perturb('req_to_token', target_group='local'): target_group must be one of full, swa, draft; got 'local'"),
    ("kv_perturb(prob=1.0)", "kv_perturb(prob=1.0): needs a mode; allowed modes: req_to_token, *"),
    ('kv_perturb("req_to_token", "real_kv_used")', "kv_perturb('req_to_token', 'real_kv_used'): takes one mode; *"),
    ('kv_perturb("req_to_token", side="prefill")',
     "kv_perturb('req_to_token', side='prefill'): side='prefill' needs the kv_pd fixture; kv_engine has one side"),
    ('kv_attention("gqa")', f"kv_attention('gqa'): kind must be one of {', '.join(ATTENTION_KINDS)}; got 'gqa'"),
    ("kv_attention()", f"kv_attention(): takes one or more kinds; allowed kinds: {', '.join(ATTENTION_KINDS)}"),
    ("kv_canary(ring_size=8)",
     "kv_canary(ring_size=8): unknown canary setting 'ring_size'; allowed: check_tokens, check_write_inputs, "
     "drain_interval, kernels, mode, real_data, recheck, ring_capacity, sweep_interval"),
    ('kv_canary(real_data="some")',
     "kv_canary(real_data='some'): real_data must be one of none, partial, all; got 'some'"),
    ('kv_canary("raise")', "kv_canary('raise'): takes keyword arguments only *"),
]


@pytest.mark.parametrize("marker, message", BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_marker_errors_only_that_test(kvtester: pytest.Pytester, marker: str, message: str) -> None:
    kvtester.makepyfile(f"""
        import pytest

        @pytest.mark.{marker}
        def test_bad(kv_engine): pass

        def test_good(kv_engine): pass
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad*", message])


def test_attention_kinds_parametrize_with_readable_ids(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_attention("mha", "swa")
        def test_both(kv_engine, kv_attention_kind):
            assert kv_engine.attention == kv_attention_kind

        @pytest.mark.kv_attention("swa")
        def test_one(kv_pd):
            assert kv_pd.attention == "swa"

        @pytest.mark.kv_attention("mha", "swa")
        def test_canary_only(kv_canary, kv_attention_kind): pass

        def test_default(kv_engine):
            assert kv_engine.attention == "mha"
    """)
    result = kvtester.runpytest("--kv-canary", "-v")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines_random([
        "*::test_both[[]mha[]] PASSED*", "*::test_both[[]swa[]] PASSED*", "*::test_one PASSED*",
        "*::test_canary_only[[]mha[]] PASSED*", "*::test_canary_only[[]swa[]] PASSED*", "*::test_default PASSED*",
    ])


def test_one_test_cannot_use_both_handles(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_both(kv_engine, kv_pd): pass")
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["a test drives one engine handle: use kv_engine or kv_pd, not both"])


def test_marker_mode_wins_over_the_command_line(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(mode="log")
        def test_log(kv_engine):
            assert kv_engine.canary.mode == "log"

        def test_run_mode(kv_engine):
            assert kv_engine.canary.mode == "raise"
    """)
    kvtester.runpytest("--kv-canary=raise").assert_outcomes(passed=2)
