"""The run's kv-canary options: declared once, resolved once into `Settings`, checked at start-up.

Each option has an ini twin. Precedence: command line > ini file > default; markers come later
(see plugin.py). Every bad value is a `pytest.UsageError` naming the option (or ini key), the
value and what is allowed, raised before any test runs, so a run never fails late on a path it
could have checked first.

It imports nothing above it: what the start-up checks ask of the engines by name comes in as an
`EngineChecks` (the plugin hands over handles/factories.py's answers). An engine's own options
are registered, resolved and checked by that engine's plugin (adapters/*_hooks.py); the settings
only record the values given, for the header, the replay command and the report.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import pytest

from . import gpu
from .config import ATTENTION_KINDS, CANARY_MODES, PD_TRANSPORTS, REAL_DATA_MODES, CanaryConfig
from .gpu import AUTO, DEVICE_SETTINGS, count_gpus, visible_gpu_count
from .report import report_target, special_file
from .soak.workload import Workload


class EngineChecks(NamedTuple):
    """What the start-up checks ask of the engines by name (handles/factories.py answers; the plugin
    hands it to `resolve`). builtin: the built-in engines' names. engine_problem(name): why a
    built-in engine cannot run here, or None. model_problem(name, model): why a checkpoint
    directory cannot serve it, or None. parallel_problem(name, tp, pp): (the field at fault, what
    it must be), or None. split_problem(name, attention, tp, pp, seed, model): why its model does
    not split so, or None. hook_engines(pluginmanager): whether a plugin or conftest other than
    the built-in engines' implements pytest_kvcanary_make_engine. options: the options the
    built-in engines' plugins register, ini key -> flag."""

    builtin: tuple[str, ...]
    engine_problem: Callable[[str], str | None]
    model_problem: Callable[[str, Path], str | None]
    parallel_problem: Callable[[str, int, int], tuple[str, str] | None]
    split_problem: Callable[[str, str, int, int, int, str | None], str | None]
    hook_engines: Callable[[Any], bool]
    options: Mapping[str, str]


def _one_of(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"one of {', '.join(allowed)}")
        return value

    return parse


def _integer(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = lo - 1
        if number < lo or (hi is not None and number > hi):
            raise ValueError(f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}")
        return number

    return parse


def _auto_or_int(value: str) -> int | None:
    """None for auto."""
    if value == AUTO:
        return None
    try:
        return _integer(1)(value)
    except ValueError:
        raise ValueError(f"{AUTO} or an integer >= 1") from None


def _unset_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """None for "" (unset)."""
    return lambda value: parse(value) if value else None


def _workload(value: str) -> str:
    try:
        Workload.from_text(value)
    except ValueError as e:
        raise ValueError(f"a workload as a soak failure prints it ({e})") from None
    return value


def _text(value: str) -> str:
    if not value.strip():
        raise ValueError("a non-empty name")
    return value.strip()


class _Option(NamedTuple):
    name: str  # the ini key, and the dest of the command-line flag
    flag: str
    metavar: str
    default: str  # as the ini file would spell it; "" = unset
    parse: Callable[[str], Any]
    help: str


_DEFAULT = CanaryConfig()
# The largest seed: numpy's seed takes 32 bits, and vLLM seeds numpy with the run's seed (torch and
# Python's random take more).
MAX_SEED = 2**32 - 1
OPTIONS = (
    _Option("kv_canary", "--kv-canary", "MODE", "off", _one_of(*CANARY_MODES),
            "turn the KV canary on: log (default when given without a value: record violations) or "
            "raise (the engine raises on a violation); off by default"),
    _Option("kv_canary_real_data", "--kv-canary-real-data", "MODE", _DEFAULT.real_data, _one_of(*REAL_DATA_MODES),
            "how much of each slot's real KV bytes the canary fingerprints: none, partial, all"),
    _Option("kv_canary_sweep_interval", "--kv-canary-sweep-interval", "N", str(_DEFAULT.sweep_interval),
            _integer(0), "forwards between radix-cache sweeps (0 = never)"),
    _Option("kv_canary_seed", "--kv-canary-seed", "N", "0", _integer(0, MAX_SEED),
            f"seed of engines and fault injection, 0 to {MAX_SEED}; a failed test prints it in its replay "
            "command"),
    _Option("kv_canary_device", "--kv-canary-device", "DEVICE", "auto", _one_of(*DEVICE_SETTINGS),
            "device of the engines: auto (a leased GPU if any, else cpu), cpu, cuda"),
    _Option("kv_canary_engine", "--kv-canary-engine", "NAME", "reference", _text,
            "engine to test: reference, transformers, vllm, or a name a pytest_kvcanary_make_engine "
            "hook knows"),
    _Option("kv_canary_model", "--kv-canary-model", "PATH", "", str,
            "a local Hugging Face checkpoint directory for the engines (default: the engine's own "
            "small model)"),
    _Option("kv_canary_report", "--kv-canary-report", "PATH", "", str, "write a JSON report to PATH"),
    _Option("kv_canary_workers_per_gpu", "--kv-canary-workers-per-gpu", "N", AUTO, _auto_or_int,
            "xdist workers that may share one GPU: auto (every worker gets a GPU, spread evenly) or a "
            "cap (a worker past it waits for a free slot)"),
    _Option("kv_canary_lock_dir", "--kv-canary-lock-dir", "PATH", "", str,
            "directory of the GPU lease locks; share it to share GPUs between runs (default: one per "
            "run, removed when it ends)"),
    _Option("kv_canary_soak_rounds", "--kv-canary-soak-rounds", "N", "16", _integer(1),
            "rounds of the stock workload soak (pytest_kvcanary.soak.suite) per test"),
    _Option("kv_canary_soak_replay", "--kv-canary-soak-replay", "WORKLOAD", "", _unset_or(_workload),
            "run the stock workload soak on this workload (the replay a soak failure printed) instead of "
            "a seeded one"),
    _Option("kv_canary_tp", "--kv-canary-tp", "N", "1", _integer(1),
            "tensor-parallel ranks of the engine each test runs on, reference or transformers (a "
            "kv_parallel marker sets it per test; this option, given on the command line, wins)"),
    _Option("kv_canary_pp", "--kv-canary-pp", "N", "1", _integer(1),
            "pipeline-parallel stages of the reference engine each test runs on (as --kv-canary-tp; 1 on "
            "transformers)"),
    _Option("kv_canary_pd_transport", "--kv-canary-pd-transport", "TRANSPORT", PD_TRANSPORTS[0],
            _one_of(*PD_TRANSPORTS), "how kv_pd's prefill/decode pair moves KV: local (both engines in the test's "
            "process) or processes (each engine in a process of its own, the KV over torch.distributed; a kv_pd "
            "marker sets it per test; this option, given on the command line, wins)"),
)
# Options that set a CanaryConfig field; all but the mode, given on the command line, win over markers.
_CANARY_FIELDS = {"kv_canary": "mode", "kv_canary_real_data": "real_data", "kv_canary_sweep_interval": "sweep_interval"}
# Options a kv_parallel (kv_pd) marker sets per test; given on the command line, they win over it.
_PARALLEL_FIELDS = {"kv_canary_tp": "tp", "kv_canary_pp": "pp", "kv_canary_pd_transport": "transport"}


@dataclass(frozen=True)
class Settings:
    """The run's options, resolved once: command line over ini file over defaults.

    pinned: CanaryConfig fields (other than mode) given on the command line, which kv_canary
    markers cannot change, and "tp" / "pp" when given there (kv_parallel markers cannot change
    them), and "transport" (kv_pd markers cannot change it). tp / pp: tensor-parallel ranks and
    pipeline stages of the engines (1: one process). pd_transport: how kv_pd's pair moves KV
    (PD_TRANSPORTS).
    model / report / lock_dir: absolute, or None when unset.
    workers_per_gpu: None for auto. soak_rounds / soak_replay: what the stock workload soak runs
    (a seeded workload of that many rounds, or the replay given). engine_options: the options the
    built-in engines' plugins register (EngineChecks.options), by ini key: the value given on the
    command line, else in the ini file, else None (the engine's plugin resolves and checks them;
    these are what the header, the replay command and the report show).
    """

    canary: CanaryConfig
    seed: int
    device: str
    engine: str
    model: Path | None
    report: Path | None
    workers_per_gpu: int | None
    lock_dir: Path | None
    pinned: frozenset[str]
    soak_rounds: int = 16
    soak_replay: str | None = None
    tp: int = 1
    pp: int = 1
    pd_transport: str = PD_TRANSPORTS[0]
    engine_options: Mapping[str, str | None] = field(default_factory=dict)

    def header(self) -> str:
        if not self.canary.enabled:
            return "kv-canary: off (enable with --kv-canary)"
        c = self.canary
        model = f" model={self.model}" if self.model else ""
        engine = "".join(f" {_shown(name)}={value}" for name, value in self.engine_options.items() if value)
        parallel = f" tp={self.tp} pp={self.pp}" if self.tp * self.pp > 1 else ""
        parallel += f" pd_transport={self.pd_transport}" if self.pd_transport != PD_TRANSPORTS[0] else ""
        return (f"kv-canary: mode={c.mode} real_data={c.real_data} sweep_interval={c.sweep_interval} "
                f"seed={self.seed} device={self.device} engine={self.engine}{parallel}{model}{engine}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update({_shown(name): value for name, value in d.pop("engine_options").items()})
        d.update({name: str(getattr(self, name)) if getattr(self, name) else None
                  for name in ("model", "report", "lock_dir")})
        d.update(pinned=sorted(self.pinned), workers_per_gpu=self.workers_per_gpu or AUTO)
        return d


def _shown(name: str) -> str:
    """An engine option's name in the header and the report: its ini key less the kv_canary_ prefix."""
    return name.removeprefix("kv_canary_")


# Where the plugin keeps the run's settings (config.stash), resolved once at start-up.
SETTINGS = pytest.StashKey[Settings]()


def run_settings(config: pytest.Config) -> Settings:
    """The run's kv-canary settings, resolved at start-up: what a module pytest loads reads (the
    stock soak suite), without importing the plugin."""
    return config.stash[SETTINGS]


def resolve(config: pytest.Config, engines: EngineChecks) -> Settings:
    """The settings in force; raises pytest.UsageError naming the option (or ini key), the value
    and the allowed values, also for a path that cannot serve (see `check_paths`) and an engine
    that cannot run (see `check_engine`, which asks `engines`)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    from_cli: set[str] = set()
    for opt in OPTIONS:
        raw = config.getoption(opt.name)
        sources[opt.name] = opt.flag
        if raw is None:
            raw, sources[opt.name] = config.getini(opt.name), f"ini option {opt.name}"
        else:
            from_cli.add(opt.name)
        try:
            values[opt.name] = opt.parse(raw)
        except ValueError as e:
            raise pytest.UsageError(f"{sources[opt.name]} must be {e}; got {raw!r}") from None
        if opt.name in from_cli and not raw.strip():  # empty means unset in the ini file, a slip here
            raise pytest.UsageError(f"{opt.flag} must not be empty (leave the option out to keep its default); "
                                    f"got {raw!r}")

    def path(name: str) -> Path | None:
        if not values[name]:
            return None
        ini_dir = config.inipath.parent if config.inipath else config.rootpath
        return (config.invocation_params.dir if name in from_cli else ini_dir) / values[name]

    settings = Settings(
        canary=CanaryConfig(**{f: values[name] for name, f in _CANARY_FIELDS.items()}),
        seed=values["kv_canary_seed"],
        device=values["kv_canary_device"],
        engine=values["kv_canary_engine"],
        model=path("kv_canary_model"),
        report=path("kv_canary_report"),
        workers_per_gpu=values["kv_canary_workers_per_gpu"],
        lock_dir=path("kv_canary_lock_dir"),
        pinned=frozenset(f for name, f in {**_CANARY_FIELDS, **_PARALLEL_FIELDS}.items()
                         if name in from_cli and f != "mode"),
        soak_rounds=values["kv_canary_soak_rounds"],
        soak_replay=values["kv_canary_soak_replay"] or None,
        tp=values["kv_canary_tp"],
        pp=values["kv_canary_pp"],
        pd_transport=values["kv_canary_pd_transport"],
        engine_options={name: _given(config, name) for name in engines.options},
    )
    raw = {name: values[name] for name in sources}
    check_paths(settings, sources, raw)
    check_engine(settings, sources, raw, engines, hook_engines=engines.hook_engines(config.pluginmanager))
    return settings


def _given(config: pytest.Config, name: str) -> str | None:
    """The value of an engine's option given on the command line, else in the ini file, else None
    (also when the engine's plugin, which registers it, is not loaded)."""
    value = config.getoption(name, None)
    if value is None:
        try:
            value = config.getini(name)
        except ValueError:
            return None
    return value or None


def _usage(source: str, raw: str, problem: str) -> pytest.UsageError:
    return pytest.UsageError(f"{source} {problem}; got {raw!r}")


def _writable_dir(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (created first when missing), or None. The
    reason names the directory, not the probe file made in it."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"{e.strerror or e}: {directory}"
    return None


def _writable_file(path: Path) -> str | None:
    """Why a report cannot be written to `path` (nothing is created but missing parent
    directories), or None. A symlink is followed: the report goes to its target. Only a regular
    file or a new path takes a report; a device, FIFO, socket or directory is refused (the
    report is renamed into place, which would replace the node)."""
    try:
        target = report_target(path)
    except OSError as e:
        return f"{e.strerror or e}: {path}"
    shown = f"{path} -> {target}" if target != path.absolute() else str(path)
    if target.is_dir():
        return "is a directory" if shown == str(path) else f"{shown} is a directory"
    if (kind := special_file(target)) is not None:
        return f"{shown} is {kind}; a report is written to a regular file or a new path only"
    return _writable_dir(target.parent)


def check_paths(settings: Settings, sources: dict[str, str], raw: dict[str, str]) -> None:
    """Every path option checked before the run starts: the report must be writable, the lock
    directory usable (when the canary is on), the model an existing directory."""
    if settings.report is not None and (why := _writable_file(settings.report)):
        raise _usage(sources["kv_canary_report"], raw["kv_canary_report"], f"must be a writable file path ({why})")
    if settings.model is not None and not settings.model.is_dir():
        raise _usage(sources["kv_canary_model"], raw["kv_canary_model"],
                     "must be an existing checkpoint directory (" +
                     ("not a directory" if settings.model.exists() else "no such directory") + ")")
    if not settings.canary.enabled:
        return
    if settings.lock_dir is not None and (why := _writable_dir(settings.lock_dir)):
        raise _usage(sources["kv_canary_lock_dir"], raw["kv_canary_lock_dir"],
                     f"must be a writable directory ({why})")


def check_engine(settings: Settings, sources: dict[str, str], raw: dict[str, str], engines: EngineChecks,
                 hook_engines: bool) -> None:
    """When the canary is on, what the engines will need, checked before the run starts: a
    known engine (built in, or some pytest_kvcanary_make_engine hook implementation registered
    by a plugin or a conftest loaded at start-up), its optional package installed, the model
    directory a checkpoint it can load, a GPU for --kv-canary-device=cuda."""
    if not settings.canary.enabled:
        return
    if settings.engine not in engines.builtin and not hook_engines:
        raise _usage(sources["kv_canary_engine"], raw["kv_canary_engine"],
                     f"must name an engine: {', '.join(engines.builtin)}, or one a pytest_kvcanary_make_engine "
                     "hook implementation returns (none is registered)")
    if problem := engines.engine_problem(settings.engine):
        raise _usage(sources["kv_canary_engine"], raw["kv_canary_engine"], problem)
    if settings.model is not None and (problem := engines.model_problem(settings.engine, settings.model)):
        raise _usage(sources["kv_canary_model"], raw["kv_canary_model"],
                     f"must be a checkpoint the {settings.engine} engine can load: the directory {problem}")
    if settings.device == "cuda" and count_gpus() == 0:
        raise _usage(sources["kv_canary_device"], raw["kv_canary_device"], "asks for a GPU, and none is visible")
    check_environment(settings)
    check_parallel(settings, sources, raw, engines)


def check_environment(settings: Settings) -> None:
    """What the environment must allow when the canary is on: visible GPUs only with a torch that
    drives them (else every test fails setting its device), and Triton's interpreter left on where
    the engines run on the CPU."""
    if settings.device != "cpu" and (gpus := visible_gpu_count()) and (why := gpu.cuda_build_problem()):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        source = f"CUDA_VISIBLE_DEVICES={visible!r} names" if visible is not None else "nvidia-smi lists"
        raise pytest.UsageError(f"{source} {gpus} GPU(s), and {why}: set CUDA_VISIBLE_DEVICES= (empty) or "
                                "--kv-canary-device=cpu to run on the CPU, or install a CUDA build of torch")
    if why := gpu.interpreter_problem(settings.device):
        raise pytest.UsageError(why)


def check_parallel(settings: Settings, sources: dict[str, str], raw: dict[str, str], engines: EngineChecks) -> None:
    """A parallel engine the run asks for (--kv-canary-tp / --kv-canary-pp or their ini keys) is one
    the run's engine has (engines.parallel_problem), and on GPUs there is one per rank (NCCL
    refuses two ranks on one GPU), and the engine's model splits so for the default attention kind
    (engines.split_problem; a kind that does not split skips its tests)."""
    ranks = settings.tp * settings.pp
    if ranks == 1:
        return
    if problem := engines.parallel_problem(settings.engine, settings.tp, settings.pp):
        field, why = problem
        name = f"kv_canary_{field}"
        raise _usage(sources[name], str(raw[name]), why)
    name = "kv_canary_tp" if settings.tp > 1 else "kv_canary_pp"
    model = str(settings.model) if settings.model else None
    if why := engines.split_problem(settings.engine, DEFAULT_ATTENTION, settings.tp, settings.pp, settings.seed, model):
        name = "kv_canary_pp" if why.startswith("pp=") else name
        raise _usage(sources[name], str(raw[name]), f"must split the {settings.engine} engine's model "
                     f"({'--kv-canary-model' if model else 'its default'}, {DEFAULT_ATTENTION}): {why}")
    if settings.device != "cpu" and 0 < (gpus := count_gpus()) < ranks:
        raise _usage(sources[name], str(raw[name]), f"needs {ranks} GPUs (tp x pp ranks, one GPU each: NCCL refuses two "
                     f"ranks on one GPU), {gpus} visible; --kv-canary-device=cpu runs the ranks on the CPU")


DEFAULT_ATTENTION = ATTENTION_KINDS[0]


def split_bare_flag(args: list[str]) -> list[str]:
    """`--kv-canary tests/` means canary on, run tests/; argparse would read tests/ as the mode."""
    return [
        "--kv-canary=log" if arg == "--kv-canary" and i + 1 < len(args) and args[i + 1] not in CANARY_MODES
        and not args[i + 1].startswith("-") else arg
        for i, arg in enumerate(args)
    ]
