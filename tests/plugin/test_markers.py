"""The kv_perturb, kv_attention and kv_canary markers, and skipping when the canary is off."""

from __future__ import annotations

import pytest

from pytest_kvcanary.config import ATTENTION_KINDS, PERTURB_MODES, TARGET_GROUPS
from pytest_kvcanary.plugin import OFF_REASON


def test_markers_are_registered(kvtester: pytest.Pytester) -> None:
    result = kvtester.runpytest("--markers")
    result.stdout.fnmatch_lines([
        "@pytest.mark.kv_perturb(mode, *, prob=1.0, side=None, target_group=None, warmup_steps=0, rank=None): *",
        "@pytest.mark.kv_attention(*kinds): *",
        "@pytest.mark.kv_canary(**overrides): *",
        "@pytest.mark.kv_parallel(tp=1, pp=1): *",
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
     f"kv_perturb('flip_everything'): kv_perturb mode must be one of {', '.join(PERTURB_MODES)}; got 'flip_everything'"),
    ('kv_perturb("req_to_token", probability=1)',
     "kv_perturb('req_to_token', probability=1): unknown keyword 'probability'; "
     "allowed: prob, side, target_group, warmup_steps, rank"),
    ('kv_perturb("req_to_token", prob=2)', "kv_perturb('req_to_token', prob=2): prob must be a number in [[]0, 1[]]; got 2"),
    ('kv_perturb("req_to_token", target_group="local")',
     f"kv_perturb('req_to_token', target_group='local'): target_group must be one of {', '.join(TARGET_GROUPS)}; "
     "got 'local'"),
    ("kv_perturb(prob=1.0)", "kv_perturb(prob=1.0): needs a mode; allowed modes: req_to_token, *"),
    ('kv_perturb("req_to_token", "real_kv_used")', "kv_perturb('req_to_token', 'real_kv_used'): takes one mode; *"),
    ('kv_perturb("req_to_token", side="prefill")',
     "kv_perturb('req_to_token', side='prefill'): side='prefill' needs the kv_pd fixture; kv_engine has one side"),
    ('kv_attention("gqa")', f"kv_attention('gqa'): kind must be one of {', '.join(ATTENTION_KINDS)}; got 'gqa'"),
    ("kv_attention()", f"kv_attention(): takes one or more kinds; allowed kinds: {', '.join(ATTENTION_KINDS)}"),
    ('kv_attention("mha", "mha")', "kv_attention('mha', 'mha'): names 'mha' twice; name each kind once (each runs "
                                   "the test once)"),
    ("kv_canary(ring_size=8)",
     "kv_canary(ring_size=8): unknown canary setting 'ring_size'; allowed: check_tokens, check_write_inputs, "
     "drain_interval, kernels, mode, real_data, recheck, ring_capacity, sweep_interval"),
    ('kv_canary(real_data="some")',
     "kv_canary(real_data='some'): real_data must be one of none, partial, all; got 'some'"),
    ('kv_canary("raise")', "kv_canary('raise'): takes keyword arguments only *"),
    ('kv_perturb("req_to_token", rank=-1)', "kv_perturb('req_to_token', rank=-1): rank must be an integer >= 0; got -1"),
    ('kv_perturb("req_to_token", rank=1)',
     "kv_perturb('req_to_token', rank=1): rank=1 is not a rank of the test's engine, which has 1 (ranks 0 to 0; "
     "kv_parallel(tp=..., pp=...) makes more)"),
    ("kv_parallel(2)", "kv_parallel(2): takes keyword arguments only: tp, pp"),
    ("kv_parallel(dp=2)", "kv_parallel(dp=2): unknown keyword 'dp'; allowed: tp, pp"),
    ("kv_parallel(tp=0)", "kv_parallel(tp=0): tp must be an integer >= 1; got 0"),
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


def test_two_kv_attention_markers_error_the_test(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        pytestmark = pytest.mark.kv_attention("mha", "swa")

        @pytest.mark.kv_attention("mla")
        def test_two(kv_engine): pass

        @pytest.mark.kv_attention("swa")
        @pytest.mark.kv_attention("mha")
        def test_stacked(kv_engine): pass

        def test_module_only(kv_engine, kv_attention_kind): pass
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_two*",
        "kv_attention('mha', 'swa') and kv_attention('mla') apply to this test; kv_attention markers do not "
        "combine: give the test one marker naming every kind it runs",
    ])
    result.stdout.fnmatch_lines(["*ERROR at setup of test_stacked*",
                                 "kv_attention('mha', 'swa') and kv_attention('swa') and kv_attention('mha') apply *"])


def test_kv_markers_on_a_test_without_kv_fixtures_warn_naming_it(kvtester: pytest.Pytester) -> None:
    """A fault asked for and never injected is a test that proves nothing: it says so. Markers of
    a module or class (which also cover its plain tests) do not warn."""
    kvtester.makepyfile("""
        import pytest

        pytestmark = pytest.mark.kv_canary(sweep_interval=2)

        @pytest.mark.kv_perturb("real_kv_used")
        def test_forgot_the_engine(): pass

        @pytest.mark.kv_attention("swa")
        def test_kind_only(kv_attention_kind): pass

        @pytest.mark.kv_attention("swa")
        @pytest.mark.kv_canary(recheck=False)
        def test_plain(): pass

        @pytest.mark.kv_perturb("real_kv_used")
        def test_guarded(kv_engine): pass
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=4, warnings=3)
    result.stdout.fnmatch_lines_random([
        "*KvMarkerWarning: kv_perturb('real_kv_used') on test_kv_markers_on_a_test_without_kv_fixtures_warn_naming_it"
        ".py::test_forgot_the_engine does nothing: the test uses none of the fixtures it acts through (kv_engine, "
        "kv_pd, kv_canary)",
        "*KvMarkerWarning: kv_attention('swa') on *::test_plain does nothing: * (kv_engine, kv_pd, kv_canary, "
        "kv_attention_kind)",
        "*KvMarkerWarning: kv_canary(recheck=False) on *::test_plain does nothing: *",
    ])
    assert "test_kind_only does nothing" not in result.stdout.str()
    assert "test_guarded does nothing" not in result.stdout.str()


def test_an_unused_cache_fault_with_the_sweep_off_is_a_marker_error(kvtester: pytest.Pytester) -> None:
    """Only the sweep reads what real_kv_unused_cache damages: with the sweep off every fault
    would stay latent, so the test errors naming both, whether a marker or the option turned it off."""
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(sweep_interval=0)
        @pytest.mark.kv_perturb("real_kv_unused_cache")
        def test_marker_turns_it_off(kv_engine): pass

        @pytest.mark.kv_perturb("real_kv_unused_cache")
        def test_sweeps(kv_engine): pass
    """)
    message = ("kv_perturb('real_kv_unused_cache'): it damages slots only the prefix cache holds, which only the "
               "sweep reads, and sweep_interval=0 turns the sweep off: set sweep_interval >= 1")
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_marker_turns_it_off*", message])
    result = kvtester.runpytest("--kv-canary", "--kv-canary-sweep-interval=0")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_sweeps*", message])


@pytest.mark.parametrize("how", [["-W", "error"], ["-W", "error::pytest_kvcanary.plugin_support.markers.KvMarkerWarning"]])
def test_a_marker_warning_under_w_error_is_one_collection_error(kvtester: pytest.Pytester, how: list[str]) -> None:
    """As pytest's own unknown-marker warning: the module fails to collect, with the warning's
    message and no INTERNALERROR; the other modules run."""
    kvtester.makepyfile(test_warns="""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used")
        def test_forgot_the_engine(): pass
    """, test_fine="def test_fine(): pass")
    result = kvtester.runpytest("--kv-canary", *how)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # the collection error stops the run before any test
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ERROR collecting test_warns.py*",
                                 "*KvMarkerWarning: kv_perturb('real_kv_used') on test_warns.py::test_forgot_the_engine "
                                 "does nothing*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    kvtester.runpytest("--kv-canary", *how, "--continue-on-collection-errors").assert_outcomes(passed=1, errors=1)


def test_kv_parallel_on_a_test_without_kv_fixtures_warns(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_parallel(tp=2)
        def test_forgot_the_engine(): pass
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*KvMarkerWarning: kv_parallel(tp=2) on *::test_forgot_the_engine does nothing: the "
                                 "test uses none of the fixtures it acts through (kv_engine, kv_pd, kv_canary)"])
