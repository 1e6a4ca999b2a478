"""Engine handles: start through the harness, reuse per configuration, replace when broken."""

from __future__ import annotations

import json

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
    result.stdout.fnmatch_lines(["reference/single/mha on cpu [[]worker main, 2 tests, sweep_interval=4[]] single: *"])


def test_hook_spec_is_registered_and_the_harness_gets_the_settings(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        def test_start(kv_engine, pytestconfig):
            assert kv_engine.engine == "mine:mha:cpu:7:None"
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
    result.stdout.fnmatch_lines(["*[[]worker main, 1 test[]] single: * (replaced: *)"])


def test_a_fault_test_runs_in_log_mode_under_raise_unless_its_marker_says_raise(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used")
        def test_faults(kv_engine):
            assert kv_engine.canary.mode == "log"

        @pytest.mark.kv_canary(mode="raise")
        @pytest.mark.kv_perturb("real_kv_used")
        def test_faults_raising(kv_engine):
            assert kv_engine.canary.mode == "raise"

        def test_plain(kv_engine):
            assert kv_engine.canary.mode == "raise"
    """)
    kvtester.runpytest("--kv-canary=raise").assert_outcomes(passed=3)


def test_raise_mode_replaces_the_handle(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(mode="raise")  # a fault test runs in log mode unless its marker says raise
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


@pytest.mark.parametrize("args, interpreted", [(["--kv-canary"], "1"), (["--kv-canary", "--kv-canary-device=cpu"], "1"),
                                               ([], None)], ids=["auto-without-gpu", "cpu", "off"])
def test_the_interpreter_is_chosen_before_any_conftest_imports_triton(
    kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], interpreted: str | None
) -> None:
    """An engine author's conftest imports the seam types, and may import triton, at module level:
    by then the plugin has chosen Triton's interpreter when the canary runs on the CPU (and only
    then)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kvtester.makeconftest(f"""
        import os
        from pytest_kvcanary.canary.seam import PoolGroup, ForwardView, SlotMapping
        from kvcanary_kernels.records import GroupKind

        assert os.environ.get("TRITON_INTERPRET") == {interpreted!r}, os.environ.get("TRITON_INTERPRET")
        import triton
    """)
    kvtester.makepyfile("def test_a(): pass")
    kvtester.runpytest_subprocess(*args).assert_outcomes(passed=1)


def test_a_user_choice_of_interpreter_is_kept(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    kvtester.makeconftest("import os\nassert os.environ['TRITON_INTERPRET'] == 'true'")
    kvtester.makepyfile("def test_a(): pass")
    kvtester.runpytest_subprocess("--kv-canary").assert_outcomes(passed=1)


@pytest.mark.parametrize("args, where", [(["--kv-canary"], "no GPU is visible"),
                                         (["--kv-canary", "--kv-canary-device=cpu"], "--kv-canary-device=cpu")],
                         ids=["auto", "cpu"])
def test_the_interpreter_switched_off_on_the_cpu_is_a_usage_error(
        kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], where: str) -> None:
    """Not "0 active drivers" in every test: one line saying what to change. Off with the canary
    off, or with a GPU, it is the user's business."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    result = kvtester.runpytest_subprocess("-s", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line.strip()] == [
        f"ERROR: TRITON_INTERPRET='0' makes Triton compile the canary's kernels for a GPU, and the engines run on the "
        f"CPU here ({where}): unset TRITON_INTERPRET (the plugin then sets it to 1) or set it to 1"]
    assert "RAN" not in result.stdout.str()
    kvtester.runpytest_subprocess().assert_outcomes(skipped=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    kvtester.runpytest_subprocess("--kv-canary").assert_outcomes(passed=1)


def test_visible_gpus_with_a_torch_built_without_cuda_are_a_usage_error(pytester: pytest.Pytester,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an AttributeError from torch._C in every test (nor a passing --kv-canary-device=cuda
    check): one line saying what to change. The CPU still runs."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch is built with CUDA")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makepyfile("def test_a(kv_device): print('RAN')")
    for device in ("auto", "cuda"):
        result = pytester.runpytest_subprocess("-s", "--kv-canary", f"--kv-canary-device={device}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert [line for line in result.errlines if line.strip()] == [
            f"ERROR: CUDA_VISIBLE_DEVICES='0' names 1 GPU(s), and this torch ({torch.__version__}) is built without "
            "CUDA: set CUDA_VISIBLE_DEVICES= (empty) or --kv-canary-device=cpu to run on the CPU, or install a CUDA "
            "build of torch"]
        assert "RAN" not in result.stdout.str()
    pytester.runpytest_subprocess("--kv-canary", "--kv-canary-device=cpu").assert_outcomes(passed=1)


def test_with_a_gpu_the_kernels_are_compiled(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kvtester.makeconftest("import os\nassert 'TRITON_INTERPRET' not in os.environ\n"
                          "from pytest_kvcanary import gpu\n"
                          "gpu.cuda_build_problem = lambda: None  # no GPU is touched: torch's build does not matter")
    kvtester.makepyfile("def test_a(): pass")
    kvtester.runpytest_subprocess("--kv-canary").assert_outcomes(passed=1)


@pytest.mark.parametrize("attention, marker, message", [
    ("mha", 'kv_perturb("real_kv_used", target_group="swa")',
     "kv_perturb('real_kv_used', target_group='swa'): target_group='swa' is not a pool group of engine "
     "'reference/mha'; its groups: full"),
    ("swa", 'kv_perturb("real_kv_used")',
     "kv_perturb('real_kv_used'): target_group is required: engine 'reference/swa' has pool groups full, swa; "
     "allowed: full, swa"),
])
def test_a_perturb_the_engine_cannot_take_is_a_marker_error(kvtester: pytest.Pytester, attention: str, marker: str,
                                                           message: str) -> None:
    kvtester.makepyfile(f"""
        import pytest

        @pytest.mark.kv_attention("{attention}")
        @pytest.mark.{marker}
        def test_bad(kv_engine): pass

        @pytest.mark.kv_attention("{attention}")
        def test_next(kv_engine):
            assert kv_engine.serial == 0  # the handle was not replaced
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad*", message])
    out = result.stdout.str()
    assert "Traceback" not in out and "replaced" not in out and out.count(message) == 1


def test_flipping_bytes_the_canary_does_not_fingerprint_is_a_marker_error(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(real_data="none")
        @pytest.mark.kv_perturb("real_kv_used")
        def test_bad(kv_engine): pass
    """)
    result = kvtester.runpytest("--kv-canary")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["kv_perturb('real_kv_used'): mode 'real_kv_used' flips real KV bytes, which the "
                                 "canary fingerprints only with real_data partial or all; got real_data='none'"])


def test_handle_numbers_name_the_engines_in_the_results(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        def test_break(kv_engine):
            kv_engine.crash()

        def test_next(kv_engine):
            pass
    """)
    result = kvtester.runpytest("--kv-canary", "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=2)
    report = json.loads((kvtester.path / "kv.json").read_text())
    assert [(t["nodeid"].split("::")[1], t["handle"]) for t in report["tests"]] == [("test_break", 0), ("test_next", 1)]
    assert [(e["handle"], e["tests"], e["retired"]) for e in report["engines"]] == [(0, 1, "unhealthy"), (1, 1, None)]


def test_the_fake_handle_satisfies_the_handle_protocol(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        from pytest_kvcanary.handles.protocol import Handle

        def test_single(kv_engine):
            assert isinstance(kv_engine.target, Handle)

        def test_pd(kv_pd):
            assert isinstance(kv_pd.target, Handle)
    """)
    kvtester.runpytest("--kv-canary").assert_outcomes(passed=2)
