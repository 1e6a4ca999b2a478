"""Command-line options, their ini twins, precedence and usage errors."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch  # noqa: F401  # loaded before any inline run: a parallel run's start-up check imports it

from pytest_kvcanary.settings import split_bare_flag

# A test that prints what the engine was started with, for the outer test to read.
SHOW_ENGINE = """
def test_show(kv_engine):
    c = kv_engine.canary
    print(f"ENGINE mode={c.mode} real_data={c.real_data} sweep_interval={c.sweep_interval} "
          f"seed={kv_engine.seed} device={kv_engine.device} engine={kv_engine.engine_name} model={kv_engine.engine}")
"""


def _engine_line(pytester: pytest.Pytester, *args: str) -> str:
    result = pytester.runpytest("-s", *args)
    result.assert_outcomes(passed=1)
    line = next(line for line in result.outlines if "ENGINE " in line)
    return line[line.index("ENGINE "):]


def test_header_when_off(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    kvtester.runpytest().stdout.fnmatch_lines(["kv-canary: off (enable with --kv-canary)"])


def test_header_shows_the_effective_configuration(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    result = kvtester.runpytest("--kv-canary", "--kv-canary-device=cpu")
    result.stdout.fnmatch_lines(
        ["kv-canary: mode=log real_data=partial sweep_interval=4 seed=0 device=cpu engine=reference"])


def test_defaults(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(SHOW_ENGINE)
    line = _engine_line(kvtester, "--kv-canary")
    assert line == ("ENGINE mode=log real_data=partial sweep_interval=4 seed=0 device=cpu engine=reference "
                    "model=reference:mha:cpu:0:None")


OPTIONS = [
    # (flag, ini key, value, what the engine line then says)
    ("--kv-canary", "kv_canary", "raise", "mode=raise"),
    ("--kv-canary-real-data", "kv_canary_real_data", "all", "real_data=all"),
    ("--kv-canary-sweep-interval", "kv_canary_sweep_interval", "7", "sweep_interval=7"),
    ("--kv-canary-seed", "kv_canary_seed", "1234", "seed=1234"),
    ("--kv-canary-device", "kv_canary_device", "cpu", "device=cpu"),
    ("--kv-canary-engine", "kv_canary_engine", "mine", "engine=mine"),
]


@pytest.mark.parametrize("flag, ini, value, shown", OPTIONS, ids=[o[1] for o in OPTIONS])
def test_each_option_and_its_ini_twin(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, flag: str, ini: str,
                                      value: str, shown: str) -> None:
    """Each value differs from the default's effect, so a dropped option fails here (mutation:
    Settings gets device="auto" whatever --kv-canary-device says; a GPU is visible, so auto would
    show cuda:0)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    kvtester.makepyfile(SHOW_ENGINE)
    on = () if ini == "kv_canary" else ("--kv-canary",)
    assert shown in _engine_line(kvtester, *on, f"{flag}={value}").split()
    kvtester.makeini(f"[pytest]\n{ini} = {value}\n")
    assert shown in _engine_line(kvtester, *on).split()


def test_model_directory_reaches_the_engine_hook(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(SHOW_ENGINE)
    ckpt = kvtester.mkdir("ckpt")  # an engine a hook builds judges its model itself
    line = _engine_line(kvtester, "--kv-canary", "--kv-canary-engine=mine", "--kv-canary-model=ckpt")
    assert line.endswith(f"model=mine:mha:cpu:0:{ckpt}")
    kvtester.makeini("[pytest]\nkv_canary_model = ckpt\nkv_canary_engine = mine\n")
    assert _engine_line(kvtester, "--kv-canary").endswith(f"model=mine:mha:cpu:0:{ckpt}")


def test_command_line_wins_over_ini(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(SHOW_ENGINE)
    kvtester.makeini("[pytest]\nkv_canary = raise\nkv_canary_seed = 5\n")
    line = _engine_line(kvtester, "--kv-canary=log", "--kv-canary-seed=9")
    assert {"mode=log", "seed=9"} <= set(line.split())


def test_ini_turns_the_canary_on(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(SHOW_ENGINE)
    kvtester.makeini("[pytest]\nkv_canary = log\n")
    assert "mode=log" in _engine_line(kvtester).split()


def test_command_line_off_wins_over_ini(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(SHOW_ENGINE)
    kvtester.makeini("[pytest]\nkv_canary = log\n")
    kvtester.runpytest("--kv-canary=off").assert_outcomes(skipped=1)


PRECEDENCE_TEST = """
import importlib.util
import json

import pytest

@pytest.mark.kv_canary(real_data="none", ring_capacity=8)
def test_marker(kv_engine):
    print("ENGINE", kv_engine.canary.real_data, kv_engine.canary.ring_capacity)
"""


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), "ENGINE none 8"),  # marker over ini
        (("--kv-canary-real-data=partial",), "ENGINE partial 8"),  # command line over marker
    ],
    ids=["marker-over-ini", "cli-over-marker"],
)
def test_precedence_cli_marker_ini(kvtester: pytest.Pytester, args: tuple[str, ...], expected: str) -> None:
    kvtester.makepyfile(PRECEDENCE_TEST)
    kvtester.makeini("[pytest]\nkv_canary = log\nkv_canary_real_data = all\n")
    assert _engine_line(kvtester, *args) == expected


@pytest.mark.parametrize(
    "args, ini, message",
    [
        (["--kv-canary=loud"], "", "ERROR: --kv-canary must be one of off, log, raise; got 'loud'"),
        (["--kv-canary-real-data=most"], "", "ERROR: --kv-canary-real-data must be one of none, partial, all; got 'most'"),
        (["--kv-canary-sweep-interval=-1"], "", "ERROR: --kv-canary-sweep-interval must be an integer >= 0; got '-1'"),
        (["--kv-canary-seed=x"], "", "ERROR: --kv-canary-seed must be an integer from 0 to 4294967295; got 'x'"),
        (["--kv-canary-seed=99999999999999999999999"], "",
         "ERROR: --kv-canary-seed must be an integer from 0 to 4294967295; got '99999999999999999999999'"),
        ([], "kv_canary_seed = 4294967296",
         "ERROR: ini option kv_canary_seed must be an integer from 0 to 4294967295; got '4294967296'"),
        (["--kv-canary-model="], "",
         "ERROR: --kv-canary-model must not be empty (leave the option out to keep its default); got ''"),
        (["--kv-canary-report="], "",
         "ERROR: --kv-canary-report must not be empty (leave the option out to keep its default); got ''"),
        (["--kv-canary-lock-dir= "], "",
         "ERROR: --kv-canary-lock-dir must not be empty (leave the option out to keep its default); got ' '"),
        (["--kv-canary-vllm-attention-isa="], "",
         "ERROR: --kv-canary-vllm-attention-isa must not be empty (leave the option out to keep its default); got ''"),
        (["--kv-canary-device=tpu"], "", "ERROR: --kv-canary-device must be one of auto, cpu, cuda; got 'tpu'"),
        (["--kv-canary-engine= "], "", "ERROR: --kv-canary-engine must be a non-empty name; got ' '"),
        (["--kv-canary-workers-per-gpu=0"], "",
         "ERROR: --kv-canary-workers-per-gpu must be auto or an integer >= 1; got '0'"),
        ([], "kv_canary = yes", "ERROR: ini option kv_canary must be one of off, log, raise; got 'yes'"),
        ([], "kv_canary_sweep_interval = often",
         "ERROR: ini option kv_canary_sweep_interval must be an integer >= 0; got 'often'"),
        (["--kv-canary-vllm-attention-isa=avx2"], "",
         "ERROR: --kv-canary-vllm-attention-isa must be one of readable, vllm, amx, vec, vec16; got 'avx2'"),
        ([], "kv_canary_vllm_attention_isa = AMX",
         "ERROR: ini option kv_canary_vllm_attention_isa must be one of readable, vllm, amx, vec, vec16; got 'AMX'"),
        (["--kv-canary-tp=0"], "", "ERROR: --kv-canary-tp must be an integer >= 1; got '0'"),
        ([], "kv_canary_pp = two", "ERROR: ini option kv_canary_pp must be an integer >= 1; got 'two'"),
        (["--kv-canary", "--kv-canary-tp=2", "--kv-canary-engine=elsewhere"], "",
         "ERROR: --kv-canary-tp needs an engine that runs parallel here: reference (tp x pp), transformers (tp); "
         "engine 'elsewhere' runs in one process only; got '2'"),
        (["--kv-canary-reference-scheduling=overlap"], "",
         "ERROR: --kv-canary-reference-scheduling must be one of sync, async; got 'overlap'"),
        ([], "kv_canary_reference_jitter_seed = -1",
         "ERROR: ini option kv_canary_reference_jitter_seed must be an integer >= 0; got '-1'"),
    ],
)
def test_bad_values_are_usage_errors(kvtester: pytest.Pytester, args: list[str], ini: str, message: str) -> None:
    kvtester.makepyfile("def test_a(): pass")
    kvtester.makeini(f"[pytest]\n{ini}\n")
    result = kvtester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# What the vLLM adapter's plugin hands make_vllm_engine (and so VllmSettings) when the run asks
# for a vllm engine (make_vllm_engine replaced: vLLM need not be installed), and the environment
# the test sees.
SHOW_ISA = """
import os

import pytest_kvcanary.adapters.vllm as adapter
from pytest_kvcanary.adapters import EngineSpec, vllm_hooks

def test_show(pytestconfig, monkeypatch):
    monkeypatch.setattr(adapter, "make_vllm_engine", lambda *args, **settings: settings)
    settings = vllm_hooks.pytest_kvcanary_make_engine(EngineSpec("vllm", "mha", "cpu", 0, config=pytestconfig))
    print("ISA", settings["attention_isa"], "ENV", os.environ.get("KVCANARY_VLLM_ATTENTION_ISA"))
"""


@pytest.mark.parametrize(
    "environment, ini, args, expected",
    [
        (None, None, (), "readable"),  # the adapter's default
        ("vec16", None, (), "vec16"),  # the environment variable keeps working
        ("vec16", "vec", (), "vec"),  # ini over the environment
        ("vec16", "vec", ("--kv-canary-vllm-attention-isa=vllm",), "vllm"),  # command line over ini
    ],
    ids=["default", "environment", "ini-over-environment", "cli-over-ini"],
)
def test_vllm_attention_isa_reaches_the_adapter(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                environment: str | None, ini: str | None, args: tuple[str, ...],
                                                expected: str) -> None:
    """The vLLM adapter's plugin resolves its option and hands it to VllmSettings directly: the
    environment is the user's, never written by the run."""
    variable = "KVCANARY_VLLM_ATTENTION_ISA"
    if environment is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, environment)
    kvtester.makepyfile(SHOW_ISA)
    if ini is not None:
        kvtester.makeini(f"[pytest]\nkv_canary_vllm_attention_isa = {ini}\n")
    result = kvtester.runpytest("-s", *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"* ISA {expected} ENV {environment}"])
    assert os.environ.get(variable) == environment


def test_header_shows_a_vllm_attention_isa(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    result = kvtester.runpytest("--kv-canary", "--kv-canary-device=cpu", "--kv-canary-vllm-attention-isa=vec")
    result.stdout.fnmatch_lines(["kv-canary: mode=log * engine=reference vllm_attention_isa=vec"])


def test_replay_carries_a_vllm_attention_isa(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_suite="def test_fails(kv_engine): assert False")
    result = kvtester.runpytest("--kv-canary", "--kv-canary-vllm-attention-isa=vec16")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["replay: pytest test_suite.py::test_fails * --kv-canary-vllm-attention-isa=vec16"])


def test_bare_flag_before_a_path_runs_that_path(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile(test_one=SHOW_ENGINE, test_two="def test_other(): pass")
    result = kvtester.runpytest("-s", "--kv-canary", "test_one.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*ENGINE mode=log *"])


def test_split_bare_flag() -> None:
    assert split_bare_flag(["--kv-canary", "tests/"]) == ["--kv-canary=log", "tests/"]
    assert split_bare_flag(["--kv-canary", "raise", "tests/"]) == ["--kv-canary", "raise", "tests/"]
    assert split_bare_flag(["--kv-canary", "-n", "2"]) == ["--kv-canary", "-n", "2"]
    assert split_bare_flag(["tests/", "--kv-canary"]) == ["tests/", "--kv-canary"]


def test_report_path_is_relative_to_the_invocation_dir(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    sub = kvtester.mkdir("sub")
    kvtester.chdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        kvtester.runpytest(str(kvtester.path), "--kv-canary-report=out.json").assert_outcomes(passed=1)
    assert (sub / "out.json").is_file()


def test_ini_report_path_is_relative_to_the_ini_file(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    kvtester.makeini("[pytest]\nkv_canary_report = reports/kv.json\n")
    kvtester.runpytest().assert_outcomes(passed=1)
    assert (kvtester.path / "reports" / "kv.json").is_file()


UNUSABLE_PATHS = [
    # (options, what stderr says)
    (["--kv-canary-report=afile/kv.json"],
     "ERROR: --kv-canary-report must be a writable file path (*afile is not a directory); got 'afile/kv.json'"),
    (["--kv-canary-report=adir"],
     "ERROR: --kv-canary-report must be a writable file path (is a directory); got 'adir'"),
    (["--kv-canary", "--kv-canary-lock-dir=afile/locks"],
     "ERROR: --kv-canary-lock-dir must be a writable directory (*afile is not a directory); got 'afile/locks'"),
    (["--kv-canary-model=nowhere"],
     "ERROR: --kv-canary-model must be an existing checkpoint directory (no such directory); got 'nowhere'"),
    (["--kv-canary-model=afile"],
     "ERROR: --kv-canary-model must be an existing checkpoint directory (not a directory); got 'afile'"),
]


@pytest.mark.parametrize("args, message", UNUSABLE_PATHS, ids=[a[-1] for a, _ in UNUSABLE_PATHS])
def test_unusable_paths_are_usage_errors_before_any_test_runs(kvtester: pytest.Pytester, args: list[str],
                                                              message: str) -> None:
    kvtester.makepyfile("def test_a(): print('RAN')")
    kvtester.path.joinpath("afile").write_text("")
    kvtester.mkdir("adir")
    result = kvtester.runpytest_subprocess("-s", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "RAN" not in result.stdout.str() and "Traceback" not in result.stderr.str()


def test_unusable_ini_path_names_the_ini_key(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    kvtester.path.joinpath("afile").write_text("")
    kvtester.makeini("[pytest]\nkv_canary_report = afile/kv.json\n")
    result = kvtester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option kv_canary_report must be a writable file path (*)*"])


def test_lock_dir_is_not_checked_when_the_canary_is_off(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    kvtester.path.joinpath("afile").write_text("")
    kvtester.runpytest("--kv-canary-lock-dir=afile/locks").assert_outcomes(passed=1)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_an_engine_whose_package_is_missing_says_how_to_install_it(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(kv_engine): pass")
    result = kvtester.runpytest("--kv-canary", "--kv-canary-engine=vllm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(['ERROR: --kv-canary-engine needs the vllm package, which is not installed: in a '
                                 'clone of pytest-kvcanary, python3 -m venv .venv-vllm && * && pip uninstall -y '
                                 "torchvision torchaudio torchcodec; got 'vllm'"])


def test_lease_options_and_their_ini_twins(kvtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    kvtester.makepyfile("def test_a(kv_device): assert kv_device == 'cuda:0'")
    kvtester.makeini("[pytest]\nkv_canary = log\nkv_canary_workers_per_gpu = 2\nkv_canary_lock_dir = ini-locks\n"
                     "kv_canary_report = kv.json\n")
    kvtester.runpytest().assert_outcomes(passed=1)
    config = json.loads((kvtester.path / "kv.json").read_text())["config"]
    assert (config["workers_per_gpu"], config["lock_dir"]) == (2, str(kvtester.path / "ini-locks"))
    # A lock directory the user names is theirs to share: it outlives the run.
    assert (kvtester.path / "ini-locks" / "gpu0.0.lock").exists()

    kvtester.runpytest("--kv-canary-workers-per-gpu=3", "--kv-canary-lock-dir=cli-locks").assert_outcomes(passed=1)
    config = json.loads((kvtester.path / "kv.json").read_text())["config"]
    assert (config["workers_per_gpu"], config["lock_dir"]) == (3, str(kvtester.path / "cli-locks"))

    kvtester.makeini("[pytest]\nkv_canary = log\nkv_canary_report = kv.json\n")
    kvtester.runpytest().assert_outcomes(passed=1)
    config = json.loads((kvtester.path / "kv.json").read_text())["config"]
    assert (config["workers_per_gpu"], config["lock_dir"]) == ("auto", None)


def test_the_largest_seed_runs_a_fault_injection_test(realtester: pytest.Pytester) -> None:
    """The seed's range is what every consumer of it takes (the model's weights, the prompts, the
    faults): the largest one runs, and the replay line carries it."""
    realtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used")
        def test_flip(kv_engine, kv_canary):
            kv_engine.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=2)
            kv_canary.assert_perturbations_detected()
            assert False, "show the replay line"
    """)
    result = realtester.runpytest("--kv-canary", "--kv-canary-seed=4294967295")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*show the replay line*", "replay: pytest *--kv-canary-seed=4294967295 *"])


PARALLEL_TEST = """
import pytest

@pytest.mark.kv_parallel(pp=2)
def test_marked(kv_engine):
    print("ENGINE", *kv_engine.parallel, kv_engine.device)

def test_unmarked(kv_engine):
    print("ENGINE", *kv_engine.parallel, kv_engine.device)
"""


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), ["ENGINE 2 2 cpu", "ENGINE 2 1 cpu"]),  # the marker's pp over the ini's, the ini's tp
        (("--kv-canary-tp=1", "--kv-canary-pp=4"), ["ENGINE 1 4 cpu", "ENGINE 1 4 cpu"]),  # command line over both
    ],
    ids=["marker-over-ini", "cli-over-marker"],
)
def test_parallel_precedence_cli_marker_ini(kvtester: pytest.Pytester, args: tuple[str, ...],
                                            expected: list[str]) -> None:
    kvtester.makepyfile(PARALLEL_TEST)
    kvtester.makeini("[pytest]\nkv_canary = log\nkv_canary_tp = 2\n")
    result = kvtester.runpytest("-s", "-p", "no:randomly", *args)
    result.assert_outcomes(passed=2)
    assert [line[line.index("ENGINE "):] for line in result.outlines if "ENGINE " in line] == expected


def test_parallel_tests_skip_on_an_engine_without_one(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_parallel(tp=2)
        def test_parallel(kv_engine): pass

        def test_single(kv_engine): pass
    """)
    result = kvtester.runpytest("--kv-canary", "--kv-canary-engine=elsewhere", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*kv_parallel(tp=...) needs an engine that runs parallel here: reference (tp x pp), "
                                 "transformers (tp); engine 'elsewhere' runs in one process only*"])


@pytest.mark.parametrize(("args", "ini"), [(["--kv-canary-pp=2"], ""), ([], "kv_canary_pp = 2")])
def test_pipeline_stages_on_transformers_are_usage_errors(kvtester: pytest.Pytester, args: list[str],
                                                          ini: str) -> None:
    if importlib.util.find_spec("transformers") is None:  # not imported here: an inline run may have unloaded numpy
        pytest.skip("transformers is not installed")
    kvtester.makepyfile("def test_a(): pass")
    kvtester.makeini(f"[pytest]\n{ini}\n")
    result = kvtester.runpytest_subprocess("--kv-canary", "--kv-canary-engine=transformers", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    source = "--kv-canary-pp" if args else "ini option kv_canary_pp"
    result.stderr.fnmatch_lines([f"ERROR: {source} must be 1 with engine 'transformers': it runs parallel over tp "
                                 "only; got '2'"])


def test_a_report_path_that_is_a_fifo_is_refused_and_left_as_it_is(kvtester: pytest.Pytester) -> None:
    """The report is renamed into place: over a FIFO (or a device: never tested on a real one) it
    would replace the node with a regular file. It is a usage error naming the path instead."""
    kvtester.makepyfile("def test_a(): print('RAN')")
    fifo = kvtester.path / "fifo"
    os.mkfifo(fifo)
    result = kvtester.runpytest_subprocess("-s", "--kv-canary-report=fifo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line.strip()] == [
        f"ERROR: --kv-canary-report must be a writable file path ({fifo} is a FIFO; a report is written to a "
        "regular file or a new path only); got 'fifo'"]
    assert "RAN" not in result.stdout.str() and stat.S_ISFIFO(fifo.lstat().st_mode)


def test_a_symlinked_report_path_is_followed_to_its_target(kvtester: pytest.Pytester) -> None:
    """The link stays a link; its target (a regular file, or a new path) gets the report. A link
    to a FIFO is refused like the FIFO."""
    kvtester.makepyfile("def test_a(): pass")
    (kvtester.path / "reports").mkdir()
    link = kvtester.path / "kv.json"
    link.symlink_to(kvtester.path / "reports" / "kv.json")  # dangling: the run creates the target
    kvtester.runpytest("--kv-canary-report=kv.json").assert_outcomes(passed=1)
    assert link.is_symlink() and "tests" in json.loads((kvtester.path / "reports" / "kv.json").read_text())
    kvtester.runpytest("--kv-canary-report=kv.json").assert_outcomes(passed=1)  # over the old report
    assert link.is_symlink() and (kvtester.path / "reports" / "kv.json").is_file()

    os.mkfifo(kvtester.path / "fifo")
    (kvtester.path / "to-fifo").symlink_to(kvtester.path / "fifo")
    result = kvtester.runpytest_subprocess("--kv-canary-report=to-fifo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --kv-canary-report must be a writable file path ({kvtester.path}/to-fifo -> "
                                 f"{kvtester.path}/fifo is a FIFO; *); got 'to-fifo'"])
    assert stat.S_ISFIFO((kvtester.path / "fifo").lstat().st_mode)


def test_a_report_path_that_became_a_fifo_during_the_run_is_not_replaced(tmp_path: Path) -> None:
    """The write checks again: what became a FIFO since start-up is refused, not replaced."""
    from pytest_kvcanary.report import RunResults

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    for name in ("fifo", "link"):
        with pytest.raises(OSError, match=f"^{tmp_path}/fifo is a FIFO; a report is written to a regular file"):
            RunResults().write_json(tmp_path / name, {})
    assert stat.S_ISFIFO((tmp_path / "fifo").lstat().st_mode) and (tmp_path / "link").is_symlink()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_report_directory_is_named_not_a_probe_file(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    locked = kvtester.mkdir("locked")
    locked.chmod(0o500)
    try:
        result = kvtester.runpytest_subprocess("--kv-canary", "--kv-canary-report=locked/kv.json",
                                               "--kv-canary-lock-dir=locked/locks")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert [line for line in result.errlines if line.strip()] == [
            f"ERROR: --kv-canary-report must be a writable file path (Permission denied: {locked}); "
            "got 'locked/kv.json'"]
        result = kvtester.runpytest_subprocess("--kv-canary", "--kv-canary-lock-dir=locked")
        result.stderr.fnmatch_lines([f"ERROR: --kv-canary-lock-dir must be a writable directory (Permission denied: "
                                     f"{locked}); got 'locked'"])
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize(("args", "ini", "source", "value", "why"), [
    (["--kv-canary-tp=3"], "", "--kv-canary-tp", "3", "tp=3 must divide model.num_heads (4)"),
    (["--kv-canary-tp=8"], "", "--kv-canary-tp", "8", "tp=8 must divide model.num_heads (4)"),
    (["--kv-canary-pp=3"], "", "--kv-canary-pp", "3", "pp=3 must divide model.num_layers (4)"),
    ([], "kv_canary_tp = 3", "ini option kv_canary_tp", "3", "tp=3 must divide model.num_heads (4)"),
], ids=["tp3", "tp8", "pp3", "ini-tp3"])
def test_a_split_the_model_cannot_take_is_a_usage_error(kvtester: pytest.Pytester, args: list[str], ini: str,
                                                        source: str, value: str, why: str) -> None:
    """From the command line or the ini file, before any test: not a traceback in every test."""
    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    kvtester.makeini(f"[pytest]\n{ini}\n")
    result = kvtester.runpytest_subprocess("-s", "--kv-canary", "--kv-canary-device=cpu", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line.strip()] == [
        f"ERROR: {source} must split the reference engine's model (its default, mha): {why}: each "
        f"{'rank holds an equal share' if why.startswith('tp') else 'stage holds equal layers'}; got '{value}'"]
    assert "RAN" not in result.stdout.str() and "Traceback" not in result.stderr.str()


def test_a_marker_split_the_model_cannot_take_skips_naming_it(realtester: pytest.Pytester) -> None:
    """kv_parallel asks per test: a split the model (or its attention kind) cannot take skips the
    test, naming the split and the model's numbers, before any rank starts."""
    realtester.makepyfile("""
        import pytest

        @pytest.mark.kv_parallel(tp=3)
        def test_three_ranks(kv_engine): pass

        @pytest.mark.kv_attention("swa")
        @pytest.mark.kv_parallel(pp=4)
        def test_four_stages_on_swa(kv_engine): pass
    """)
    result = realtester.runpytest_subprocess("--kv-canary", "--kv-canary-device=cpu", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines_random([
        "SKIPPED * kv_parallel(tp=3, pp=1): engine 'reference' on mha cannot split its model so: tp=3 must divide "
        "model.num_heads (4): each rank holds an equal share",
        "SKIPPED * kv_parallel(tp=1, pp=4): engine 'reference' on swa cannot split its model so: pp=4 must leave each "
        "stage a multiple of model.full_every (2) layers on swa; got 1 layers per stage",
    ])
    assert "Traceback" not in result.stdout.str()


def test_the_attention_isa_variable_is_checked_like_its_option(kvtester: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    kvtester.makepyfile("def test_a(): print('RAN')")
    monkeypatch.setenv("KVCANARY_VLLM_ATTENTION_ISA", "bogus")
    result = kvtester.runpytest_subprocess("-s")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line.strip()] == [
        "ERROR: the environment variable KVCANARY_VLLM_ATTENTION_ISA (the default of --kv-canary-vllm-attention-isa) "
        "must be one of readable, vllm, amx, vec, vec16; got 'bogus'"]
    kvtester.runpytest_subprocess("--kv-canary-vllm-attention-isa=vec").assert_outcomes(passed=1)  # the option wins
    monkeypatch.setenv("KVCANARY_VLLM_ATTENTION_ISA", "vec16")
    kvtester.runpytest_subprocess().assert_outcomes(passed=1)
