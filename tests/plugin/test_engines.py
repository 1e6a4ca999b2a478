"""Engine handles: start through the harness, reuse per configuration, replace when broken."""

from __future__ import annotations

import pytest


def test_handles_are_reused_per_configuration_and_closed_at_the_end(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        serials = []

        def test_a(kv_engine):
            serials.append(kv_engine.serial)

        def test_b(kv_engine):
            serials.append(kv_engine.serial)
            assert len(kv_engine.resets) == 2

        @pytest.mark.kv_attention("swa")
        def test_other_attention(kv_engine):
            serials.append(kv_engine.serial)

        @pytest.mark.kv_canary(sweep_interval=1)
        def test_other_config(kv_engine):
            serials.append(kv_engine.serial)

        def test_pd(kv_pd):
            serials.append(kv_pd.serial)

        def test_last(fake_harness):
            assert serials == [0, 0, 1, 2, 3]
            assert fake_harness.closed == []
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["reference/single/mha on cpu [[]main, 2 tests[]] single: *"])


def test_hook_spec_is_registered_and_the_harness_gets_the_settings(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        def test_start(kv_engine, pytestconfig):
            assert kv_engine.engine == "mine:mha:cpu:7"
            assert kv_engine.device == "cpu"
            assert kv_engine.seed == 7
            assert kv_engine.resets == [(7, ())]
    """)
    kvtester.runpytest("--kv-canary", "--kv-canary-seed=7", "--kv-canary-engine=mine").assert_outcomes(passed=1)


@pytest.mark.parametrize("breakage", ["kv_engine.fail()", "kv_engine.crash()"])
def test_a_broken_handle_is_replaced(kvtester: pytest.Pytester, breakage: str) -> None:
    kvtester.makepyfile(f"""
        def test_break(kv_engine):
            try:
                {breakage}
            except RuntimeError:
                pass

        def test_next(kv_engine, fake_harness):
            assert kv_engine.serial == 1
            assert fake_harness.closed == [0]
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*[[]main, 1 test[]] single: * (replaced: *)"])


def test_raise_mode_replaces_the_handle(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used")
        def test_raises(kv_engine):
            with pytest.raises(RuntimeError, match="kv-canary violation"):
                kv_engine.send_parallel_requests(2, distinct_prompts=True)

        def test_next(kv_engine):
            assert kv_engine.serial == 1
    """)
    kvtester.runpytest("--kv-canary=raise").assert_outcomes(passed=2)


def test_pd_gets_a_second_gpu_when_one_is_free(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    kvtester.makepyfile("""
        def test_single(kv_engine, kv_device):
            assert kv_device == kv_engine.device == "cuda:0"

        def test_pd(kv_pd):
            assert kv_pd.device == "cuda:0,cuda:1"
    """)
    lock_dir = kvtester.path / "locks"
    kvtester.runpytest("--kv-canary", f"--kv-canary-lock-dir={lock_dir}").assert_outcomes(passed=2)
    assert sorted(p.name for p in lock_dir.iterdir()) == ["gpu0.0.lock", "gpu1.0.lock"]


def test_cuda_without_a_gpu_errors_the_test(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_engine(kv_engine): pass")
    result = kvtester.runpytest("--kv-canary", "--kv-canary-device=cuda")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["device 'cuda' was asked for, but no GPU is visible"])


def test_default_harness_is_imported_lazily_with_the_interpreter_on_cpu(
    kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kvtester.makeconftest("""
        import sys
        import fake_harness

        fake_harness.start_engine = fake_harness.FakeHarness().start_engine
        sys.modules["pytest_kvcanary.harness"] = fake_harness
    """)
    kvtester.makepyfile("""
        import os

        def test_engine(kv_engine):
            assert os.environ["TRITON_INTERPRET"] == "1"
            assert kv_engine.device == "cpu"
    """)
    kvtester.runpytest_subprocess("--kv-canary").assert_outcomes(passed=1)
