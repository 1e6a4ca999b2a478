"""pytest entry point of pytest-kvcanary: the hooks and fixtures (options: settings.py, engine
handles: handles/pool.py, results: report.py).

Loaded by every pytest run of the environment, so it imports nothing heavy: torch, triton and the
engines load inside the fixtures that start engines. The built-in engines are plugins of their own
(registered in `pytest_addhooks`), each implementing pytest_kvcanary_make_engine and registering
its own options, as a third-party engine's plugin does. Precedence: command line > kv_canary marker >
ini file, except the mode (a marker sets one test's mode, never turns on a run that is off); a
test that injects faults runs in log mode unless its marker says otherwise. A test owns its
violations when it injected faults or read them through kv_canary; others, in log mode, are
listed once in the summary. docs/running.md and docs/reports.md say more.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, NoReturn

import pytest

from .canary.seam import UnsupportedAttention
from .config import PD_TRANSPORTS
from .gpu import DeviceLeaseError, DeviceLeases, new_lock_dir, remove_lock_dir, runs_on_cpu
from .handles import factories
from .handles.factories import (NoParallelEngine, NoPrefillDecodePair, NotAnEngineUnderTest, UnknownEngine,
                                 parallel_problem)
from .handles.pool import EngineKey, EnginePool, WatchedHandle
from .plugin_support import markers
from .plugin_support.interrupts import Interrupts, mend_traceback
from .plugin_support.progress import ProgressFactory, ProgressLine
from .report import ReportEntry, RunResults, failure_section, violations_table
from .settings import OPTIONS, SETTINGS, EngineChecks, Settings, resolve, split_bare_flag
from .settings import run_settings as run_settings  # its path before it moved to settings.py

if TYPE_CHECKING:
    from .assertions import KvCanary
    from .config import PerturbSpec

OFF_REASON = "kv-canary is off: run pytest with --kv-canary (or set kv_canary = log in the ini file)"
SINGLE_SIDES = ("single",)
PD_SIDES = ("prefill", "decode")

_SETTINGS = SETTINGS  # settings.py's key: run_settings reads it there
_RESULTS = pytest.StashKey[RunResults]()
_LEASES = pytest.StashKey[DeviceLeases]()
_POOL = pytest.StashKey[EnginePool]()
_LOCK_DIR = pytest.StashKey[Path]()
_OWN_LOCK_DIR = pytest.StashKey[bool]()  # this process made the lock dir and removes it at the end
_KV_FIXTURES = frozenset({"kv_engine", "kv_pd", "kv_canary", "kv_device"})
_INTERRUPTS = pytest.StashKey[Interrupts]()
_COLLECTOR = "kv-canary-results"  # the name of the plugin object that collects the results


def _fail(message: str) -> NoReturn:
    raise pytest.fail.Exception(message, pytrace=False) from None


# What the start-up checks ask of the engines by name (settings.py asks; handles/factories.py answers).
ENGINE_CHECKS = EngineChecks(tuple(factories.BUILTIN_ENGINES), factories.engine_problem, factories.model_problem,
                             factories.parallel_problem, factories.split_problem, factories.hook_engines,
                             factories.ENGINE_OPTIONS)


def _worker(config: pytest.Config) -> str:
    return getattr(config, "workerinput", {}).get("workerid", "main")


def _uncaptured(config: pytest.Config) -> ContextManager[None]:
    capture = config.pluginmanager.getplugin("capturemanager")
    return capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()


def _tell(config: pytest.Config, message: str) -> None:
    """Show a message on the terminal now, also from inside a test's setup (past the output
    capture) and from an xdist worker (whose stderr is the terminal's)."""
    with _uncaptured(config):
        print(message, file=sys.stderr, flush=True)


def _progress(request: pytest.FixtureRequest) -> ProgressFactory | None:
    """How the test's long generations show progress: on stderr past the capture, in place on an
    interactive terminal, as lines where output is not captured (-s); not at all otherwise, nor
    from an xdist worker (the controller's terminal shows the tests' outcomes)."""
    config = request.config
    with _uncaptured(config):
        interactive = sys.stderr.isatty()
    if hasattr(config, "workerinput") or not (interactive or config.getoption("capture") == "no"):
        return None

    def write(text: str) -> None:
        with _uncaptured(config):
            sys.stderr.write(text)
            sys.stderr.flush()

    nodeid = request.node.nodeid
    return lambda describe: ProgressLine(write, lambda: f"kv-canary {nodeid}: {describe()}", interactive=interactive)


# ----------------------------------------------------------------------------- start-up, end

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-canary", "KV-cache canary (pytest-kvcanary)")
    for opt in OPTIONS:
        bare = {"nargs": "?", "const": "log"} if opt.name == "kv_canary" else {}
        group.addoption(opt.flag, dest=opt.name, default=None, metavar=opt.metavar, help=opt.help, **bare)
        parser.addini(opt.name, f"{opt.help} (the {opt.flag} option wins)", default=opt.default)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """The plugin's hooks, and the built-in engines' plugins that implement them, registered as any
    plugin is (light: each loads its engine only when asked for one; `-p no:kv-canary-engine-NAME`
    leaves one out)."""
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    for name, module in factories.BUILTIN_ENGINES.items():
        pluginmanager.register(module, f"kv-canary-engine-{name}")


def _early_value(early_config: pytest.Config, name: str) -> str:
    value = getattr(early_config.known_args_namespace, name, None)
    return value if value is not None else early_config.getini(name)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Before any conftest is imported: read a bare --kv-canary as "log", and when the canary
    will run on the CPU, choose Triton's interpreter (TRITON_INTERPRET=1, unless set) before
    anything can import triton."""
    fixed = split_bare_flag(args)
    if fixed != args:
        args[:] = fixed
        early_config.known_args_namespace = parser.parse_known_args(args, namespace=early_config.known_args_namespace)
    if "TRITON_INTERPRET" in os.environ or _early_value(early_config, "kv_canary") in ("off", ""):
        return
    if runs_on_cpu(_early_value(early_config, "kv_canary_device")):
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    for line in markers.MARKER_LINES:
        config.addinivalue_line("markers", line)
    settings = config.stash[_SETTINGS] = resolve(config, ENGINE_CHECKS)
    config.stash[_RESULTS] = RunResults()
    workerinput = getattr(config, "workerinput", None)
    own = settings.lock_dir is None and workerinput is None
    lock_dir = settings.lock_dir or (new_lock_dir() if own else Path(workerinput["kv_canary_lock_dir"]))
    config.stash[_LOCK_DIR], config.stash[_OWN_LOCK_DIR] = lock_dir, own
    workers = workerinput["workercount"] if workerinput else 1
    config.stash[_LEASES] = DeviceLeases(settings.device, lock_dir, settings.workers_per_gpu, workers=workers,
                                         on_wait=functools.partial(_tell, config))
    interrupts = config.stash[_INTERRUPTS] = Interrupts(worker=workerinput is not None)
    interrupts.install()
    if workerinput is None:
        config.pluginmanager.register(_Collector(config.stash[_RESULTS], interrupts), _COLLECTOR)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: the run's workers share its lock directory."""
    node.workerinput["kv_canary_lock_dir"] = str(node.config.stash[_LOCK_DIR])


def pytest_unconfigure(config: pytest.Config) -> None:
    collector = config.pluginmanager.get_plugin(_COLLECTOR)
    if collector is not None:
        config.pluginmanager.unregister(collector)
    if _LEASES in config.stash:
        config.stash[_LEASES].release()
    if config.stash.get(_OWN_LOCK_DIR, False):
        remove_lock_dir(config.stash[_LOCK_DIR])
    if _INTERRUPTS in config.stash:
        config.stash[_INTERRUPTS].restore()


@pytest.hookimpl(tryfirst=True)
def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Before pytest formats the interrupt's traceback, whatever frame it was raised in."""
    mend_traceback(excinfo.value)


def pytest_report_header(config: pytest.Config) -> str:
    return config.stash[_SETTINGS].header()


@pytest.hookimpl(tryfirst=True)  # before an xdist worker reports its collection as finished
def pytest_collection_finish(session: pytest.Session) -> None:
    """Lease this process's device, if one is free, before any test runs: xdist starts tests only
    once every worker has collected, so every worker holds its GPU before a PD test looks for a
    spare one. A worker that finds none free under a cap waits later, in its first kv test."""
    config = session.config
    if config.stash[_SETTINGS].canary.enabled and not config.option.collectonly and any(
        _KV_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items
    ):
        with contextlib.suppress(DeviceLeaseError):  # kv_device and the handles report it
            config.stash[_LEASES].try_primary()


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Any:
    """Warn about kv markers that do nothing (markers.ignored) as each test is collected: inside
    its module's collection, where `-W error` makes the warning that module's collection error
    (as pytest's own unknown-marker warning), not an internal error."""
    made = yield
    for item in made if isinstance(made, list) else [made]:
        if isinstance(item, pytest.Item):
            for message in markers.ignored(item):
                item.warn(markers.KvMarkerWarning(message))
    return made


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

@dataclass
class _TestRecord:
    """The handle a test got and the configuration it ran with; what the handle logged is read
    when the test's call phase ends."""

    key: EngineKey
    serial: int
    handle: WatchedHandle
    sides: tuple[str, ...]
    perturbs: tuple[PerturbSpec, ...]
    seed: int
    canary: KvCanary | None = None
    violations: list[Any] = field(default_factory=list)
    requests: list[str | None] = field(default_factory=list)
    injections: list[Any] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    soaks: list[dict[str, Any]] = field(default_factory=list)
    read_error: str | None = None

    def read(self) -> None:
        try:
            self.violations = list(self.handle.violations())
            self.requests = [self.handle.request_label(v) for v in self.violations]
            self.injections = list(self.handle.injections())
            self.stats = self.handle.stats()
            self.soaks = [soak.to_json() for soak in self.handle.soak_results]
        except Exception as e:  # the handle is marked as raised, and replaced after the test
            self.read_error = repr(e)

    @property
    def expected(self) -> bool:
        """The test caused its violations, read them itself, or ran a soak (which judges them)."""
        return bool(self.perturbs) or (self.canary is not None and self.canary.consulted) or bool(self.soaks)


_RECORD = pytest.StashKey[_TestRecord]()


def _marker_value(read: Callable[..., Any], node: pytest.Item, **kwargs: Any) -> Any:
    try:
        return read(node, **kwargs)
    except markers.MarkerError as e:
        _fail(str(e))


def _devices(config: pytest.Config, kind: str, ranks: int = 1) -> str:
    """The devices of a handle: its primary, a pair's (one or two), or a parallel engine's ranks'
    (skips when the run has fewer GPUs than ranks)."""
    leases = config.stash[_LEASES]
    try:
        if ranks > 1:
            devices = leases.ranks(ranks)
            if devices is None:
                pytest.skip(f"kv_parallel: the engine's {ranks} ranks need {ranks} GPUs (NCCL refuses two ranks on "
                            "one GPU), and fewer are visible; --kv-canary-device=cpu runs them on the CPU")
            return ",".join(dict.fromkeys(devices))
        return leases.primary() if kind == "single" else ",".join(dict.fromkeys(leases.pair()))
    except DeviceLeaseError as e:
        _fail(str(e))


def _topology(settings: Settings, node: pytest.Item) -> tuple[int, int]:
    """(tp, pp) of the test's engine: the command line's, else its kv_parallel marker's, else the ini's."""
    marked = _marker_value(markers.parallel, node)
    return tuple(getattr(settings, name) if name in settings.pinned or name not in marked else marked[name]
                 for name in markers.PARALLEL_FIELDS)


def _transport(settings: Settings, node: pytest.Item) -> str:
    """How the test's pair moves KV: the command line's, else its kv_pd marker's, else the ini's."""
    marked = _marker_value(markers.pd_transport, node)
    return settings.pd_transport if "transport" in settings.pinned else marked.get("transport", settings.pd_transport)


def _checkout(request: pytest.FixtureRequest, pool: EnginePool, key: EngineKey) -> Any:
    """The handle for key. An engine name nobody builds an engine under test for (a hook that
    returns None or something else) is the run's error, not each test's: this test errors, and
    the run stops after it, saying why."""
    try:
        return pool.checkout(key)
    except (NoPrefillDecodePair, NoParallelEngine, UnsupportedAttention) as e:
        raise pytest.skip.Exception(str(e)) from None
    except (UnknownEngine, NotAnEngineUnderTest) as e:
        request.session.shouldstop = f"--kv-canary-engine={key.engine}: {e}"
        _fail(str(e))


def _engine_handle(request: pytest.FixtureRequest, kind: str, attention: str) -> Iterator[WatchedHandle]:
    """Set up the test's engine handle of this kind (see kv_engine / kv_pd)."""
    if {"kv_engine", "kv_pd"} <= set(request.fixturenames):
        _fail("a test drives one engine handle: use kv_engine or kv_pd, not both")
    node = request.node
    settings = request.config.stash[_SETTINGS]
    tp, pp = _topology(settings, node)
    perturbs = _marker_value(markers.perturbs, node, pd=kind == "pd", ranks=tp * pp)
    overrides = _marker_value(markers.canary_overrides, node)
    if perturbs:  # its faults are expected: raise mode would stop it at the first one
        overrides.setdefault("mode", "log")
    canary = settings.canary.with_overrides(**{k: v for k, v in overrides.items() if k not in settings.pinned})
    if not settings.canary.enabled:
        pytest.skip(OFF_REASON)
    if not canary.enabled:
        pytest.skip("kv-canary is off for this test: its kv_canary marker sets mode='off'")
    model = str(settings.model) if settings.model else None
    if problem := parallel_problem(settings.engine, tp, pp):
        field, why = problem
        pytest.skip(f"kv_parallel({field}=...) {why}")
    transport = _transport(settings, node) if kind == "pd" else PD_TRANSPORTS[0]
    key = EngineKey(kind, canary, settings.engine, attention, _devices(request.config, kind, tp * pp), settings.seed,
                    model, tp, pp, transport)
    pool: EnginePool = request.getfixturevalue("_kv_engines")
    serial, handle = _checkout(request, pool, key)
    _marker_value(markers.check_perturbs_fit, node, groups=handle.pool_groups(), canary=canary,
                  engine=f"{settings.engine}/{attention}")
    if perturbs and (why := handle.unsupported(perturbs)):
        pytest.skip(why)
    pool.reset(key, settings.seed, perturbs)
    if hasattr(handle.target, "progress"):  # a handle that can show it (SidedHandle)
        handle.target.progress = _progress(request)
    node.stash[_RECORD] = _TestRecord(key, serial, handle, SINGLE_SIDES if kind == "single" else PD_SIDES,
                                      perturbs, settings.seed)
    yield handle
    pool.checkin(key)


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def kv_start_engine(pytestconfig: pytest.Config) -> Callable[[EngineKey], Any]:
    """The function that starts an engine handle from its configuration, one EngineKey
    (`pytest_kvcanary.handles.start.start_engine`, building engines through this run's hooks).
    Override it in a conftest.py to drive the kv fixtures with another harness."""
    from .handles import start

    return functools.partial(start.start_engine, config=pytestconfig)


@pytest.fixture(scope="session")
def _kv_engines(pytestconfig: pytest.Config, kv_start_engine: Callable[[EngineKey], Any]) -> Iterator[EnginePool]:
    pool = EnginePool(kv_start_engine, _worker(pytestconfig))
    pytestconfig.stash[_POOL] = pool  # kept after the session: reports made later still read it
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def kv_device(pytestconfig: pytest.Config) -> str:
    """The torch device this process leased: "cpu" or "cuda:i" (held until pytest exits)."""
    return _devices(pytestconfig, "single")


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
    """A prefill/decode engine pair handle, reset for this test; on two GPUs when the run has a
    spare one; each engine in a process of its own under kv_pd(transport="processes"). Skips when
    the canary is off, or when the engine has no prefill/decode pair."""
    yield from _engine_handle(request, "pd", kv_attention_kind)


@pytest.fixture
def kv_canary(request: pytest.FixtureRequest, kv_attention_kind: str) -> KvCanary:
    """Assertions over the test's handle: kv_pd when the test uses it, else kv_engine."""
    from .assertions import KvCanary

    handle = request.getfixturevalue("kv_pd" if "kv_pd" in request.fixturenames else "kv_engine")
    record = request.node.stash[_RECORD]
    record.canary = KvCanary(handle, record.sides, record.perturbs, record.key.tp * record.key.pp)
    return record.canary


# ----------------------------------------------------------------------------------- reporting

def _replay(item: pytest.Item, record: _TestRecord, settings: Settings) -> str:
    """The command line that reruns this test with the configuration it ran with."""
    _, sep, rest = item.nodeid.partition("::")
    target = os.path.relpath(item.path, item.config.invocation_params.dir) + sep + rest
    c = record.key.canary
    model = [f"--kv-canary-model={record.key.model}"] if record.key.model else []
    engine = [f"{ENGINE_CHECKS.options[name]}={value}" for name, value in settings.engine_options.items() if value]
    key = record.key
    parallel = [f"--kv-canary-tp={key.tp}", f"--kv-canary-pp={key.pp}"] if key.tp * key.pp > 1 else []
    if key.transport != PD_TRANSPORTS[0]:
        parallel.append(f"--kv-canary-pd-transport={key.transport}")
    return shlex.join([
        "pytest", target, f"--kv-canary={c.mode}", f"--kv-canary-seed={record.seed}",
        f"--kv-canary-real-data={c.real_data}", f"--kv-canary-sweep-interval={c.sweep_interval}",
        f"--kv-canary-device={settings.device}", f"--kv-canary-engine={key.engine}", *parallel, *model, *engine,
    ])


def _test_payload(item: pytest.Item, record: _TestRecord, report: pytest.TestReport,
                  call: pytest.CallInfo[None]) -> ReportEntry:
    """The test's entry for the results; adds the kv-canary section to the report: on failure
    the seed, the replay command and (unless a kv_canary assertion's message shows them) the
    tables; on unexpected violations in log mode, their table."""
    key, settings = record.key, item.config.stash[_SETTINGS]
    entry = ReportEntry.guarded(
        item.nodeid, report.outcome, item.config.stash[_POOL].describe(key, record.serial), seed=record.seed,
        perturbs=record.perturbs, violations=record.violations, requests=record.requests,
        injections=record.injections, stats=record.stats, expected=record.expected, read_error=record.read_error,
        soaks=record.soaks)
    if report.failed:
        shown = record.canary is not None and call.excinfo is not None and call.excinfo.value is record.canary.raised
        report.sections.append(("kv-canary", failure_section(
            record.seed, _replay(item, record, settings), record.violations, record.requests, record.injections,
            record.read_error, tables=not shown)))
    elif record.violations and not record.expected:
        report.sections.append(("kv-canary", "unexpected " + violations_table(record.violations, record.requests)))
    return entry


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach what the results need to the report: the test's entry (call phase) and engine
    handles replaced since the last report. It travels with the report to an xdist controller."""
    record = item.stash.get(_RECORD, None)
    if record is not None and call.when == "call":
        record.read()
        item.user_properties += [("kv_canary_violations", len(record.violations)), ("kv_canary_seed", record.seed)]
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    payload: dict[str, Any] = {}
    if record is not None and call.when == "call":
        payload["test"] = _test_payload(item, record, report, call).to_json()
    pool = item.config.stash.get(_POOL, None)
    if pool is not None and (retired := pool.take_retired()):
        payload["retired"] = retired
    if payload:
        report.kv_canary = payload  # type: ignore[attr-defined]


class _Collector:
    """Registered where the results are kept (the xdist controller, or the only process): takes
    what test reports carry and notes how the run ended."""

    def __init__(self, results: RunResults, interrupts: Interrupts) -> None:
        self.results = results
        self.interrupts = interrupts

    @pytest.hookimpl(tryfirst=True)  # noted before the terminal shows the test started
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.results.running.append(nodeid)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        # once the run is stopping, a test that ends was running when it stopped: it stays named
        if nodeid in self.results.running and not self.interrupts.received:
            self.results.running.remove(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        payload = getattr(report, "kv_canary", None)
        if report.when == "call" and "test" not in (payload or {}):
            self.results.unguarded += 1
        if payload is not None:
            self.results.add(payload)
        elif report.when == "???":  # xdist's report of the test a worker was running when it died
            self.results.add_crashed(report.nodeid, getattr(getattr(report, "node", None), "gateway", None))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object | None) -> None:
        """A worker went down; `error` says why when it did not finish normally."""
        if error == "keyboard-interrupt":
            self.results.interrupted = self.interrupts.reason or "keyboard interrupt"
        elif error is not None:
            lines = str(error).strip().splitlines()
            self.results.worker_crashed(node.gateway.id, lines[-1] if lines else "no reason given")

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        if excinfo.type is KeyboardInterrupt:  # not pytest's own stops (collection errors, -x)
            self.results.interrupted = self.interrupts.reason or "keyboard interrupt"


@pytest.hookimpl(trylast=True)  # after the runner has torn down session fixtures (closing engines)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    settings = config.stash[_SETTINGS]
    if not hasattr(config, "workerinput") and settings.report is not None:
        try:
            config.stash[_RESULTS].write_json(settings.report, settings.to_json())
        except OSError as e:
            config.stash[_RESULTS].report_error = (f"{e.strerror}: {e.filename or settings.report}" if e.strerror
                                                   else str(e))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash[_RESULTS]
    settings = config.stash[_SETTINGS]
    abnormal = settings.canary.enabled and (results.interrupted or results.crashed_workers)
    if not (results.tests or results.engines or abnormal or settings.report):
        return
    terminalreporter.section("kv-canary")
    for line in results.summary_lines():
        terminalreporter.write_line(line)
    if results.report_error is not None:
        terminalreporter.write_line(f"report: could not write {settings.report} ({results.report_error})")
    elif settings.report is not None:
        terminalreporter.write_line(f"report: {settings.report}")
