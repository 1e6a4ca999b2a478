"""pytest entry point of pytest-kvcanary: options, ini keys, markers, fixtures and reporting.

Loaded by every pytest run of the environment, so it imports nothing heavy: torch, triton and the
engines load inside the fixtures that start engines.

Precedence: an option given on the command line wins over a kv_canary marker, which wins over the
ini file. The mode is the one exception: --kv-canary (or the kv_canary ini key) turns the run on
and sets its default mode, and a kv_canary(mode=...) marker sets one test's mode: "log" for a test
that asserts on the faults it injects (raise mode would stop it at the first violation), "off" to
opt out. A marker cannot turn on a run that is off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import pytest

from . import markers
from .config import CANARY_MODES, REAL_DATA_MODES, SIDES, CanaryConfig, PerturbSpec
from .gpu import DEVICE_SETTINGS, DeviceLeaseError, DeviceLeases, default_lock_dir
from .report import RunResults, failure_section

if TYPE_CHECKING:
    from .assertions import KvCanary

OFF_REASON = "kv-canary is off: run pytest with --kv-canary (or set kv_canary = log in the ini file)"
SINGLE_SIDES = ("single",)


# ----------------------------------------------------------------------------------- settings

def _one_of(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"one of {', '.join(allowed)}")
        return value

    return parse


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = lo - 1
        if number < lo:
            raise ValueError(f"an integer >= {lo}")
        return number

    return parse


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
_OPTIONS = (
    _Option("kv_canary", "--kv-canary", "MODE", "off", _one_of(*CANARY_MODES),
            "turn the KV canary on: log (default when given without a value: record violations) or "
            "raise (the engine raises on a violation); off by default"),
    _Option("kv_canary_real_data", "--kv-canary-real-data", "MODE", _DEFAULT.real_data, _one_of(*REAL_DATA_MODES),
            "how much of each slot's real KV bytes the canary fingerprints: none, partial, all"),
    _Option("kv_canary_sweep_interval", "--kv-canary-sweep-interval", "N", str(_DEFAULT.sweep_interval),
            _int_at_least(0), "forwards between radix-cache sweeps (0 = never)"),
    _Option("kv_canary_seed", "--kv-canary-seed", "N", "0", _int_at_least(0),
            "seed of engines and fault injection; a failed test prints it in its replay command"),
    _Option("kv_canary_device", "--kv-canary-device", "DEVICE", "auto", _one_of(*DEVICE_SETTINGS),
            "device of the engines: auto (a leased GPU if any, else cpu), cpu, cuda"),
    _Option("kv_canary_engine", "--kv-canary-engine", "NAME", "reference", _text,
            "engine to test, as named to the pytest_kvcanary_make_engine hook"),
    _Option("kv_canary_report", "--kv-canary-report", "PATH", "", str, "write a JSON report to PATH"),
    _Option("kv_canary_workers_per_gpu", "--kv-canary-workers-per-gpu", "N", "1", _int_at_least(1),
            "xdist workers that may share one GPU"),
    _Option("kv_canary_lock_dir", "--kv-canary-lock-dir", "PATH", "", str,
            "directory of the GPU lease locks; share it to share GPUs between runs (default: one per run)"),
)
# Options that set a CanaryConfig field; all but the mode, given on the command line, win over markers.
_CANARY_FIELDS = {"kv_canary": "mode", "kv_canary_real_data": "real_data", "kv_canary_sweep_interval": "sweep_interval"}


@dataclass(frozen=True)
class Settings:
    """The run's options, resolved once: command line over ini file over defaults.

    pinned: CanaryConfig fields (other than mode) given on the command line, which kv_canary
    markers cannot change.
    report / lock_dir: absolute, or None when unset.
    """

    canary: CanaryConfig
    seed: int
    device: str
    engine: str
    report: Path | None
    workers_per_gpu: int
    lock_dir: Path | None
    pinned: frozenset[str]

    def header(self) -> str:
        if not self.canary.enabled:
            return "kv-canary: off (enable with --kv-canary)"
        c = self.canary
        return (f"kv-canary: mode={c.mode} real_data={c.real_data} sweep_interval={c.sweep_interval} "
                f"seed={self.seed} device={self.device} engine={self.engine}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(report=str(self.report) if self.report else None,
                 lock_dir=str(self.lock_dir) if self.lock_dir else None, pinned=sorted(self.pinned))
        return d


def _resolve(config: pytest.Config) -> Settings:
    """Raises pytest.UsageError naming the option (or ini key), the value and the allowed values."""
    values: dict[str, Any] = {}
    from_cli: set[str] = set()
    for opt in _OPTIONS:
        raw = config.getoption(opt.name)
        source = opt.flag
        if raw is None:
            raw, source = config.getini(opt.name), f"ini option {opt.name}"
        else:
            from_cli.add(opt.name)
        try:
            values[opt.name] = opt.parse(raw)
        except ValueError as e:
            raise pytest.UsageError(f"{source} must be {e}; got {raw!r}") from None

    def path(name: str) -> Path | None:
        if not values[name]:
            return None
        ini_dir = config.inipath.parent if config.inipath else config.rootpath
        return (config.invocation_params.dir if name in from_cli else ini_dir) / values[name]

    return Settings(
        canary=CanaryConfig(**{f: values[name] for name, f in _CANARY_FIELDS.items()}),
        seed=values["kv_canary_seed"],
        device=values["kv_canary_device"],
        engine=values["kv_canary_engine"],
        report=path("kv_canary_report"),
        workers_per_gpu=values["kv_canary_workers_per_gpu"],
        lock_dir=path("kv_canary_lock_dir"),
        pinned=frozenset(f for name, f in _CANARY_FIELDS.items() if name in from_cli and f != "mode"),
    )


def _split_bare_flag(args: list[str]) -> list[str]:
    """`--kv-canary tests/` means canary on, run tests/; argparse would read tests/ as the mode."""
    return [
        "--kv-canary=log" if arg == "--kv-canary" and i + 1 < len(args) and args[i + 1] not in CANARY_MODES
        and not args[i + 1].startswith("-") else arg
        for i, arg in enumerate(args)
    ]


_SETTINGS = pytest.StashKey[Settings]()
_RESULTS = pytest.StashKey[RunResults]()
_LEASES = pytest.StashKey[DeviceLeases]()
_KV_FIXTURES = frozenset({"kv_engine", "kv_pd", "kv_canary", "kv_device"})


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-canary", "KV-cache canary (pytest-kvcanary)")
    for opt in _OPTIONS:
        bare = {"nargs": "?", "const": "log"} if opt.name == "kv_canary" else {}
        group.addoption(opt.flag, dest=opt.name, default=None, metavar=opt.metavar, help=opt.help, **bare)
        parser.addini(opt.name, f"{opt.help} (the {opt.flag} option wins)", default=opt.default)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    fixed = _split_bare_flag(args)
    if fixed != args:
        args[:] = fixed
        early_config.known_args_namespace.file_or_dir = parser.parse_known_args(args).file_or_dir


def pytest_configure(config: pytest.Config) -> None:
    for line in markers.MARKER_LINES:
        config.addinivalue_line("markers", line)
    settings = config.stash[_SETTINGS] = _resolve(config)
    config.stash[_RESULTS] = RunResults()
    config.stash[_LEASES] = DeviceLeases(settings.device, settings.lock_dir or default_lock_dir(),
                                         settings.workers_per_gpu)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LEASES in config.stash:
        config.stash[_LEASES].release()


def pytest_report_header(config: pytest.Config) -> str:
    return config.stash[_SETTINGS].header()


@pytest.hookimpl(tryfirst=True)  # before an xdist worker reports its collection as finished
def pytest_collection_finish(session: pytest.Session) -> None:
    """Lease this process's device before any test runs. xdist starts tests only once every worker
    has collected, so every worker holds its GPU before a PD test may lease a second one."""
    config = session.config
    if config.stash[_SETTINGS].canary.enabled and not config.option.collectonly and any(
        _KV_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items
    ):
        with contextlib.suppress(DeviceLeaseError):  # kv_device and the handles report it
            config.stash[_LEASES].primary()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kv_attention_kind" not in metafunc.fixturenames:
        return
    try:
        kinds = markers.attention_kinds(metafunc.definition)
    except markers.MarkerError:
        return  # the kv_attention_kind fixture errors the test with the message
    if len(kinds) > 1:
        metafunc.parametrize("kv_attention_kind", kinds, ids=kinds, indirect=True)


# ------------------------------------------------------------------------------ engine handles

class _Guarded:
    """An engine handle that notes when a call on it raises (the pool then replaces it)."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._raised = False

    def __repr__(self) -> str:
        return repr(self._target)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except BaseException:
                self._raised = True
                raise

        return call


class _EngineKey(NamedTuple):
    kind: str  # "single" or "pd"
    canary: CanaryConfig
    attention: str
    device: str  # "cuda:0"; for a pd pair on two GPUs "cuda:0,cuda:1"
    engine: str


class _EnginePool:
    """This process's engine handles, one per key, reused by the tests that share a key. A handle
    that raised or reports itself unhealthy is closed after its test and replaced on next use;
    every closed handle leaves an engine entry (its stats) in the results."""

    def __init__(self, start: Callable[..., Any], config: pytest.Config) -> None:
        self._start = start
        self._config = config
        self._handles: dict[_EngineKey, _Guarded] = {}
        self._tests: Counter[_EngineKey] = Counter()

    def checkout(self, key: _EngineKey, seed: int, perturbs: tuple[PerturbSpec, ...]) -> _Guarded:
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = _Guarded(self._start(
                key.kind, canary=key.canary, attention=key.attention, device=key.device, seed=seed,
                engine_name=key.engine, pluginmanager=self._config.pluginmanager))
        self._tests[key] += 1
        try:
            handle.reset(seed, perturbs)
        except Exception:
            self._retire(key, "reset raised")
            raise
        return handle

    def checkin(self, key: _EngineKey) -> None:
        handle = self._handles[key]
        try:
            healthy = not handle._raised and handle.healthy()
        except Exception:
            healthy = False
        if not healthy:
            self._retire(key, "raised" if handle._raised else "unhealthy")

    def close(self) -> None:
        for key in list(self._handles):
            self._retire(key, None)

    def _retire(self, key: _EngineKey, why: str | None) -> None:
        target = self._handles.pop(key)._target
        try:
            sides = target.stats()
        except Exception as e:
            sides = {key.kind: {"health": f"stats unavailable: {e!r}"}}
        self._config.stash[_RESULTS].add_engine(
            worker=_worker(self._config), engine=key.engine, kind=key.kind, attention=key.attention,
            device=key.device, canary=asdict(key.canary), tests=self._tests.pop(key), retired=why, sides=sides)
        target.close()


def _worker(config: pytest.Config) -> str:
    return getattr(config, "workerinput", {}).get("workerid", "main")


@dataclass
class _TestRecord:
    """The handle a test got and the configuration it ran with; violations and injections are
    read from the handle when the test's call phase ends."""

    key: _EngineKey
    handle: _Guarded
    sides: tuple[str, ...]
    perturbs: tuple[PerturbSpec, ...]
    seed: int
    violations: list[Any] = field(default_factory=list)
    injections: list[Any] = field(default_factory=list)
    read_error: str | None = None

    def read_log(self) -> None:
        try:
            self.violations = list(self.handle.violations())
            self.injections = list(self.handle.injections())
        except Exception as e:  # the handle is marked as raised, and replaced after the test
            self.read_error = repr(e)


_RECORD = pytest.StashKey[_TestRecord]()


def _marker_value(read: Callable[..., Any], node: pytest.Item, **kwargs: Any) -> Any:
    try:
        return read(node, **kwargs)
    except markers.MarkerError as e:
        pytest.fail(str(e), pytrace=False)


def _engine_handle(request: pytest.FixtureRequest, kind: str, attention: str) -> Iterator[_Guarded]:
    """Set up the test's engine handle of this kind (see kv_engine / kv_pd)."""
    if {"kv_engine", "kv_pd"} <= set(request.fixturenames):
        pytest.fail("a test drives one engine handle: use kv_engine or kv_pd, not both", pytrace=False)
    node = request.node
    settings = request.config.stash[_SETTINGS]
    perturbs = _marker_value(markers.perturbs, node, pd=kind == "pd")
    overrides = _marker_value(markers.canary_overrides, node)
    canary = settings.canary.with_overrides(**{k: v for k, v in overrides.items() if k not in settings.pinned})
    if not settings.canary.enabled:
        pytest.skip(OFF_REASON)
    if not canary.enabled:
        pytest.skip("kv-canary is off for this test: its kv_canary marker sets mode='off'")
    leases = request.config.stash[_LEASES]
    try:
        device = leases.primary() if kind == "single" else ",".join(dict.fromkeys(leases.pair()))
    except DeviceLeaseError as e:
        pytest.fail(str(e), pytrace=False)
    key = _EngineKey(kind, canary, attention, device, settings.engine)
    pool: _EnginePool = request.getfixturevalue("_kv_engines")
    handle = pool.checkout(key, settings.seed, perturbs)
    node.stash[_RECORD] = _TestRecord(key, handle, SINGLE_SIDES if kind == "single" else SIDES, perturbs,
                                      settings.seed)
    yield handle
    pool.checkin(key)


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def kv_start_engine(kv_device: str) -> Callable[..., Any]:
    """The function that starts engine handles (`pytest_kvcanary.harness.start_engine`).
    Override it in a conftest.py to drive the kv fixtures with another harness.

    On CPU it first sets TRITON_INTERPRET=1 (unless set): the kernels then run under Triton's
    interpreter, which must be chosen before they are imported."""
    if kv_device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import harness

    return harness.start_engine


@pytest.fixture(scope="session")
def _kv_engines(pytestconfig: pytest.Config, kv_start_engine: Callable[..., Any]) -> Iterator[_EnginePool]:
    pool = _EnginePool(kv_start_engine, pytestconfig)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def kv_device(pytestconfig: pytest.Config) -> str:
    """The torch device this process leased: "cpu" or "cuda:i" (held until pytest exits)."""
    try:
        return pytestconfig.stash[_LEASES].primary()
    except DeviceLeaseError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def kv_attention_kind(request: pytest.FixtureRequest) -> str:
    """The attention kind of this test's engine: from kv_attention (a parameter when it names
    several), "mha" without the marker."""
    if hasattr(request, "param"):
        return request.param
    return _marker_value(markers.attention_kinds, request.node)[0]


@pytest.fixture
def kv_engine(request: pytest.FixtureRequest, kv_attention_kind: str) -> Iterator[Any]:
    """A single engine handle, reset for this test (caches flushed, log and ledger cleared, the
    test's kv_perturb faults armed). Skips when the canary is off."""
    yield from _engine_handle(request, "single", kv_attention_kind)


@pytest.fixture
def kv_pd(request: pytest.FixtureRequest, kv_attention_kind: str) -> Iterator[Any]:
    """A prefill/decode engine pair handle, reset for this test; on two GPUs when a second one
    can be leased. Skips when the canary is off."""
    yield from _engine_handle(request, "pd", kv_attention_kind)


@pytest.fixture
def kv_canary(request: pytest.FixtureRequest, kv_attention_kind: str) -> KvCanary:
    """Assertions over the test's handle: kv_pd when the test uses it, else kv_engine."""
    from .assertions import KvCanary

    handle = request.getfixturevalue("kv_pd" if "kv_pd" in request.fixturenames else "kv_engine")
    return KvCanary(handle, request.node.stash[_RECORD].sides)


# ----------------------------------------------------------------------------------- reporting

def _replay(item: pytest.Item, record: _TestRecord, settings: Settings) -> str:
    """The command line that reruns this test with the configuration it ran with."""
    _, sep, rest = item.nodeid.partition("::")
    target = os.path.relpath(item.path, item.config.invocation_params.dir) + sep + rest
    c = record.key.canary
    return shlex.join([
        "pytest", target, f"--kv-canary={c.mode}", f"--kv-canary-seed={record.seed}",
        f"--kv-canary-real-data={c.real_data}", f"--kv-canary-sweep-interval={c.sweep_interval}",
        f"--kv-canary-device={settings.device}", f"--kv-canary-engine={record.key.engine}",
    ])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    record = item.stash.get(_RECORD, None)
    if record is None or call.when != "call":
        yield
        return
    record.read_log()
    item.user_properties += [("kv_canary_violations", len(record.violations)), ("kv_canary_seed", record.seed)]
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    settings = item.config.stash[_SETTINGS]
    key = record.key
    item.config.stash[_RESULTS].add_test(
        nodeid=item.nodeid, outcome=report.outcome, worker=_worker(item.config), seed=record.seed,
        kind=key.kind, attention=key.attention, device=key.device, engine=key.engine, canary=asdict(key.canary),
        perturbs=[asdict(p) for p in record.perturbs], violations=record.violations,
        injections=record.injections, read_error=record.read_error)
    if report.failed:
        report.sections.append(("kv-canary", failure_section(
            record.seed, _replay(item, record, settings), record.violations, record.injections, record.read_error)))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object | None) -> None:
    """xdist controller: merge a finished worker's results."""
    payload = getattr(node, "workeroutput", {}).get("kv_canary")
    if payload is not None:
        node.config.stash[_RESULTS].merge(payload)


@pytest.hookimpl(trylast=True)  # after the runner has torn down session fixtures (closing engines)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    results = config.stash[_RESULTS]
    if hasattr(config, "workeroutput"):
        config.workeroutput["kv_canary"] = results.payload()
        return
    settings = config.stash[_SETTINGS]
    if settings.report is not None:
        results.write_json(settings.report, settings.to_json())


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash[_RESULTS]
    settings = config.stash[_SETTINGS]
    if not (results.tests or results.engines or settings.report):
        return
    terminalreporter.section("kv-canary")
    for line in results.summary_lines():
        terminalreporter.write_line(line)
    if settings.report is not None:
        terminalreporter.write_line(f"report: {settings.report}")
