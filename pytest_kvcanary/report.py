"""Tables, failure sections, the terminal summary and the JSON report (no torch).

The process that runs a guarded test turns it into a `ReportEntry` and attaches its JSON to the
test's report, so it reaches the process that writes the summary (the xdist controller, or the
only process) with the report itself: a worker that dies later loses nothing it finished.
`RunResults` collects the entries there; per-engine lines are sums over the entries of the tests
each engine served, so the summary, the JSON report and the per-test numbers always agree.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from .canary.violation import Violation

# The attributes every ledger entry (an injected fault) has (perturb/ledger.py's Injection says
# what half, layer and byte mean).
INJECTION_FIELDS = ("mode", "side", "group", "slot", "position", "row", "half", "layer", "byte", "step", "status",
                    "cause")
# Per-side counters of an engine: summed over its tests (each test's counters start at its reset).
COUNTERS = ("forwards", "protected_tokens", "sweeps", "violations", "rows", "dropped")
SHOWN_COUNTERS = COUNTERS[:4]


def report_target(path: Path) -> Path:
    """Where a report for `path` is written: the path itself, or the file a symlink at it points
    to (followed to the end; a dangling link's target is created). OSError for a link loop."""
    try:
        return Path(os.path.realpath(path, strict=False))
    except RuntimeError as e:  # a symlink loop, on Pythons that raise it so
        raise OSError(f"symlink loop ({e})") from None


def special_file(path: Path) -> str | None:
    """What `path` is when it exists and is neither a regular file nor a directory ("a FIFO",
    "a character device", ...), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [list(headers), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def violations_table(violations: Sequence[Violation], requests: Sequence[str | None] = ()) -> str:
    """A heading and one row per violation, or `violations: none`. requests: per violation, the
    request its row held ("req <id> '<prompt start>'") where the engine could tell; the column is
    left out when none is known."""
    if not violations:
        return "violations: none"
    headers = ["side", "step", "phase", "half", "group", "reasons", "slot", "pos", "row", "stored", "expected"]
    rows = [
        [v.side, v.step, v.phase, v.half, v.group, ",".join(v.reasons), v.slot, v.position,
         v.row if v.peer is None else f"vs rank {v.peer}", f"{v.stored:#x}", f"{v.expected:#x}"]
        for v in violations
    ]
    if any(v.rank is not None for v in violations):  # a parallel engine's: the rank (and stage) after the side
        for row, v in zip(rows, violations):
            row.insert(1, "-" if v.rank is None else v.rank if not v.stage else f"{v.rank} (stage {v.stage})")
        headers.insert(1, "rank")
    if any(requests):
        at = headers.index("row") + 1
        headers.insert(at, "request")
        for row, request in zip(rows, requests):
            row.insert(at, request or "-")
    return f"violations ({len(violations)}):\n{_table(headers, rows)}"


def _injection_fields(injections: Sequence[Any]) -> tuple[str, ...]:
    """INJECTION_FIELDS, with "rank" after the side where a fault was injected on a parallel engine."""
    if all(getattr(i, "rank", None) is None for i in injections):
        return INJECTION_FIELDS
    at = INJECTION_FIELDS.index("side") + 1
    return (*INJECTION_FIELDS[:at], "rank", *INJECTION_FIELDS[at:])


def injection_to_json(injection: Any) -> dict[str, Any]:
    return {name: getattr(injection, name) for name in _injection_fields([injection])}


def ledger_table(injections: Sequence[Any]) -> str:
    """A heading and one row per injected fault, or `ledger: no injections`."""
    if not injections:
        return "ledger: no injections"
    names = _injection_fields(injections)
    rows = ([*("-" if getattr(i, name, None) is None else getattr(i, name) for name in names[:-1]), i.cause or "-"]
            for i in injections)
    return f"ledger ({_count(len(injections), 'injection')}):\n{_table(names, rows)}"


@dataclass(frozen=True)
class EngineRef:
    """An engine handle as the results name it: the worker process holding it, its number there
    (`handle`), and the configuration it runs (`canary`: the CanaryConfig's fields; tp / pp: the
    ranks of a parallel engine, whose device names each rank's, in rank order; transport: how a
    prefill/decode pair moves its KV, "local" or "processes")."""

    worker: str
    handle: int
    engine: str
    kind: str
    attention: str
    device: str
    canary: dict[str, Any]
    tp: int = 1
    pp: int = 1
    transport: str = "local"


@dataclass(frozen=True)
class ReportEntry:
    """One test as the JSON report stores it, field for key in the same order: a guarded test
    (`guarded`), or one whose worker died while running it (`crashed`: nothing measured).
    stats: per side, the canary's counters for this test; expected: the test injected faults or
    asserted on violations, so its violations are its business (not shown as unexpected);
    violations and injections: their JSON rows (a violation with the request its row held); soaks:
    the workload soaks it ran (rounds, forwards, verdicts, each failure's replay)."""

    nodeid: str
    outcome: str
    worker: str | None
    handle: int | None = None
    seed: int | None = None
    kind: str | None = None
    attention: str | None = None
    device: str | None = None
    engine: str | None = None
    canary: dict[str, Any] | None = None
    perturbs: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    injections: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected: bool = False
    read_error: str | None = None
    soaks: list[dict[str, Any]] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    transport: str = "local"

    @classmethod
    def guarded(cls, nodeid: str, outcome: str, served_by: EngineRef, *, seed: int, perturbs: Sequence[Any],
                violations: Sequence[Violation], requests: Sequence[str | None], injections: Sequence[Any],
                stats: dict[str, dict[str, Any]], expected: bool, read_error: str | None,
                soaks: Sequence[dict[str, Any]] = ()) -> ReportEntry:
        """perturbs: the test's PerturbSpecs; requests: per violation, the request its row held;
        soaks: the workload soaks the test ran (SoakResult.to_json)."""
        return cls(
            nodeid=nodeid, outcome=outcome, seed=seed, **asdict(served_by), perturbs=[asdict(p) for p in perturbs],
            violations=[{**v.to_json(), "request": r} for v, r in zip(violations, requests, strict=True)],
            injections=[injection_to_json(i) for i in injections], stats=stats, expected=expected,
            read_error=read_error, soaks=list(soaks))

    @classmethod
    def crashed(cls, nodeid: str, worker: str | None) -> ReportEntry:
        return cls(nodeid=nodeid, outcome="crashed", worker=worker)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReportEntry:
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def served_by(self) -> EngineRef:
        """The engine handle of a guarded test."""
        return EngineRef(**{f.name: getattr(self, f.name) for f in fields(EngineRef)})

    def violation_rows(self) -> tuple[list[Violation], list[str | None]]:
        """The violations, and per violation the request its row held."""
        from .canary.violation import Violation

        rows = [{k: v for k, v in d.items() if k != "request"} for d in self.violations]
        return [Violation.from_json(d) for d in rows], [d["request"] for d in self.violations]


def failure_section(seed: int, replay: str, violations: Sequence[Violation], requests: Sequence[str | None],
                    injections: Sequence[Any], read_error: str | None, tables: bool) -> str:
    """The text a failed test's report carries under the `kv-canary` heading. tables: False when
    the failure message already shows them (a kv_canary assertion failed)."""
    lines = [f"seed: {seed}", f"replay: {replay}"]
    if read_error is not None:
        lines.append(f"could not read the engine's log: {read_error}")
    if tables:
        lines += [violations_table(violations, requests), ledger_table(injections)]
    return "\n".join(lines)


def _transport(transport: str) -> str:
    """A pair's transport as labels show it: nothing for the default (one process)."""
    return "" if transport == "local" else f" transport={transport}"


def _where(engine: dict[str, Any]) -> str:
    tp, pp = engine.get("tp", 1), engine.get("pp", 1)
    parallel = f" tp={tp} pp={pp}" if tp * pp > 1 else ""
    return (f"{engine['engine']}/{engine['kind']}/{engine['attention']}{parallel}"
            f"{_transport(engine.get('transport', 'local'))} on {engine['device']} [worker {engine['worker']}")


def _distinctions(engines: Sequence[dict[str, Any]]) -> list[str]:
    """Per engine, the canary settings that tell it apart from the other engines of the same
    name, kind, attention, device and worker (", sweep_interval=2"), else ""."""
    shown = []
    for engine in engines:
        twins = [e["canary"] for e in engines if _where(e) == _where(engine)]
        differing = [name for name in engine["canary"] if len({repr(c[name]) for c in twins}) > 1]
        shown.append("".join(f", {name}={engine['canary'][name]}" for name in differing))
    return shown


def _engine_line(engine: dict[str, Any], distinction: str, side: str, stats: dict[str, Any]) -> str:
    where = f"{_where(engine)}, {_count(engine['tests'], 'test')}{distinction}]"
    counts = " ".join(f"{name}={stats.get(name, '?')}" for name in SHOWN_COUNTERS)
    retired = f" (replaced: {engine['retired']})" if engine["retired"] else ""
    return f"{where} {side}: {counts} health={stats.get('health', '?')}{retired}"


class RunResults:
    """What the summary and the JSON report say: test entries, engine retirements, and how the
    run ended (interrupted, workers that died)."""

    def __init__(self) -> None:
        self.tests: list[ReportEntry] = []
        self._engines: dict[tuple[str, int], dict[str, Any]] = {}
        self.interrupted: str | None = None
        self.running: list[str] = []  # the tests that had started and not finished (named if interrupted)
        self.unguarded = 0  # tests that ran without a kv engine handle (not in `tests`)
        self.crashed_workers: list[dict[str, str]] = []
        self.report_error: str | None = None  # why the JSON report could not be written

    def _engine(self, ref: EngineRef) -> dict[str, Any]:
        key = (ref.worker, ref.handle)
        if key not in self._engines:
            self._engines[key] = {**asdict(ref), "tests": 0, "retired": None, "sides": {}}
        return self._engines[key]

    def add_test(self, entry: ReportEntry) -> None:
        self.tests.append(entry)
        engine = self._engine(entry.served_by)
        engine["tests"] += 1
        for side, stats in entry.stats.items():
            total = engine["sides"].setdefault(side, {**dict.fromkeys(COUNTERS, 0), "health": "ok"})
            for name in COUNTERS:
                total[name] += stats.get(name, 0)
            if stats.get("health", "ok") != "ok":
                total["health"] = stats["health"]

    def add_retired(self, ref: EngineRef, why: str) -> None:
        """An engine handle replaced after a test, and why."""
        self._engine(ref)["retired"] = why

    def add(self, payload: dict[str, Any]) -> None:
        """What a test report carried: {"test": entry JSON} and/or {"retired": [{"engine": engine
        JSON, "retired": why}, ...]}."""
        if "test" in payload:
            self.add_test(ReportEntry.from_json(payload["test"]))
        for event in payload.get("retired", ()):
            self.add_retired(EngineRef(**event["engine"]), event["retired"])

    def add_crashed(self, nodeid: str, gateway: Any) -> None:
        """The test a worker was running when it died (what the worker had logged died with it)."""
        self.tests.append(ReportEntry.crashed(nodeid, getattr(gateway, "id", None)))

    def worker_crashed(self, worker: str, error: str) -> None:
        self.crashed_workers.append({"worker": worker, "error": error})

    @property
    def engines(self) -> list[dict[str, Any]]:
        return list(self._engines.values())

    def worker_devices(self) -> dict[str, list[str]]:
        """Each worker and the devices its tests ran on, in first use order ("cuda:0,cuda:1": a
        prefill/decode pair's, or a parallel engine's ranks')."""
        devices: dict[str, list[str]] = {}
        for t in self.tests:
            if t.worker is not None and t.device is not None and t.device not in devices.setdefault(t.worker, []):
                devices[t.worker].append(t.device)
        return devices

    def unexpected(self) -> list[ReportEntry]:
        """Entries with violations the test neither caused nor asserted on, and whose failure
        section does not show them already."""
        return [t for t in self.tests if t.violations and not t.expected and t.outcome != "failed"]

    def summary_lines(self) -> list[str]:
        """One line per engine handle and side (a PD handle has two; the worker holding it, and
        the canary settings that tell handles otherwise alike apart, are named), the totals
        (violations owned by tests that injected faults or checked them with kv_canary, and the
        unexpected rest), then what needs attention: unexpected violations as one block, an
        interrupt, workers that died."""
        lines = [_engine_line(engine, distinction, side, stats)
                 for engine, distinction in zip(self.engines, _distinctions(self.engines))
                 for side, stats in engine["sides"].items()]
        guarded = [t for t in self.tests if t.outcome != "crashed"]
        violations = sum(len(t.violations) for t in self.tests)
        owned = sum(len(t.violations) for t in self.tests if t.expected)
        sides = ""
        if len(lines) > len(self.engines):
            why = [f"a {what} has {how}" for what, how, found in (
                ("prefill/decode handle", "two sides", any(e["kind"] == "pd" for e in self.engines)),
                ("parallel handle", "one per rank", any(e.get("tp", 1) * e.get("pp", 1) > 1 for e in self.engines)))
                if found]
            sides = f" ({len(lines)} lines: {', '.join(why) or 'a line per side'})"
        lines.append(f"{_count(len(guarded), 'guarded test')}, {_count(violations, 'violation')} "
                     f"({owned} owned by tests that injected or checked them, "
                     f"{violations - owned} unexpected), {_count(len(self.engines), 'engine handle')}{sides}")
        if self.unguarded:
            lines.append(f"{_count(self.unguarded, 'other test')} ran without kv_engine or kv_pd: not guarded, not "
                         "counted above (a test that builds its own engine is one)")
        workers = self.worker_devices()
        if len(workers) > 1 or any(e.get("tp", 1) * e.get("pp", 1) > 1 for e in self.engines):
            lines.append("devices: " + "; ".join(f"{w} -> {', '.join(d)}" for w, d in sorted(workers.items())))
        unexpected = self.unexpected()
        if unexpected:
            n = sum(len(t.violations) for t in unexpected)
            lines.append(f"unexpected violations: {_count(n, 'violation')} in {_count(len(unexpected), 'test')} "
                         "that neither injected faults nor checked them with kv_canary")
            for t in unexpected:
                lines += [f"{t.nodeid} (seed {t.seed}, {t.kind}/{t.attention}{_transport(t.transport)} on {t.device}):",
                          violations_table(*t.violation_rows())]
        lines += self.soak_lines()
        if self.interrupted:
            running = f"; running when it stopped: {', '.join(self.running)}" if self.running else ""
            lines.append(f"run interrupted ({self.interrupted}): results of the {_count(len(self.tests), 'test')} "
                         f"that finished{running}")
        for crash in self.crashed_workers:
            lines.append(f"worker {crash['worker']} died ({crash['error']}); the tests it finished are included")
        lines += [f"crashed: {t.nodeid} (its worker died while running it)"
                  for t in self.tests if t.outcome == "crashed"]
        return lines

    def soak_totals(self) -> dict[str, Any] | None:
        """The workload soaks of the run summed (rounds, forwards, verdicts) with each failure's
        replay, or None when no test ran one."""
        soaks = [(t.nodeid, s) for t in self.tests for s in t.soaks]
        if not soaks:
            return None
        verdicts: dict[str, int] = {}
        for _, s in soaks:
            for verdict, n in s["verdicts"].items():
                verdicts[verdict] = verdicts.get(verdict, 0) + n
        oracles = list(dict.fromkeys(s.get("oracle", "") for _, s in soaks if s.get("oracle")))
        return {"soaks": len(soaks), "rounds": sum(s["rounds"] for _, s in soaks),
                "forwards": sum(s["forwards"] for _, s in soaks), "verdicts": verdicts, "oracles": oracles,
                "failures": [{"nodeid": nodeid, **f} for nodeid, s in soaks for f in s["failures"]]}

    def soak_lines(self) -> list[str]:
        """The soak totals as the terminal summary shows them, a line per failure."""
        totals = self.soak_totals()
        if totals is None:
            return []
        counts = ", ".join(f"{n} {verdict}" for verdict, n in totals["verdicts"].items() if n)
        lines = [f"workload soak: {_count(totals['soaks'], 'soak')}, {totals['rounds']} rounds, "
                 f"{totals['forwards']} forwards: {counts or 'no rounds'}"]
        lines += [f"  oracle: {oracle}" for oracle in totals["oracles"]]
        for f in totals["failures"]:
            again = "" if f["reproduced"] else ", did not reproduce after a reset"
            lines.append(f"  {f['nodeid']} round {f['round']}: {f['verdict']} ({f['requests']} requests{again}); "
                         f"replay: {f['replay']}")
        return lines

    def write_json(self, path: Path, config: dict[str, Any]) -> None:
        """Write the report atomically (a temporary file beside it renamed over it): an interrupt
        never leaves half a report. A symlink is followed (its target gets the report). Raises
        OSError, naming `path`, when the path cannot be written or is not a regular file or a new
        path (a device, FIFO or directory is never replaced)."""
        target = report_target(path)
        if target.is_dir() or (kind := special_file(target)) is not None:
            what = "a directory" if target.is_dir() else kind
            raise OSError(f"{target} is {what}; a report is written to a regular file or a new path only")
        target.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "config": config,
            "run": {"interrupted": self.interrupted, "crashed_workers": self.crashed_workers},
            "tests": [t.to_json() for t in self.tests],
            "engines": self.engines,
            "soak": self.soak_totals(),
            "workers": self.worker_devices(),
        }
        partial = target.with_name(f".{target.name}.partial")
        try:
            partial.write_text(json.dumps(document, indent=2) + "\n")
            partial.replace(target)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(target)) from None
