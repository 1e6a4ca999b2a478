"""Tables, failure sections, the terminal summary and the JSON report (no torch).

A process collects its results in `RunResults`: one entry per guarded test and one per engine it
closed. Entries are plain JSON values, so an xdist worker can ship them to the controller, which
merges them into one summary and one report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from .canary.violation import Violation

# The attributes every ledger entry (an injected fault) has.
INJECTION_FIELDS = ("mode", "side", "group", "slot", "position", "row", "byte", "step", "status", "cause")
STAT_FIELDS = ("forwards", "protected_tokens", "sweeps", "violations")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [list(headers), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def violations_table(violations: Sequence[Violation]) -> str:
    """A heading and one row per violation, or `violations: none`."""
    if not violations:
        return "violations: none"
    headers = ("side", "step", "phase", "half", "group", "reasons", "slot", "pos", "row", "stored", "expected")
    rows = (
        (v.side, v.step, v.phase, v.half, v.group, ",".join(v.reasons), v.slot, v.position, v.row,
         f"{v.stored:#x}", f"{v.expected:#x}")
        for v in violations
    )
    return f"violations ({len(violations)}):\n{_table(headers, rows)}"


def injection_to_json(injection: Any) -> dict[str, Any]:
    return {name: getattr(injection, name) for name in INJECTION_FIELDS}


def ledger_table(injections: Sequence[Any]) -> str:
    """A heading and one row per injected fault, or `ledger: no injections`."""
    if not injections:
        return "ledger: no injections"
    rows = ([*(getattr(i, name) for name in INJECTION_FIELDS[:-1]), i.cause or "-"] for i in injections)
    return f"ledger ({_count(len(injections), 'injection')}):\n{_table(INJECTION_FIELDS, rows)}"


def failure_section(seed: int, replay: str, violations: Sequence[Violation], injections: Sequence[Any],
                    read_error: str | None) -> str:
    """The text a failed test's report carries under the `kv-canary` heading."""
    lines = [f"seed: {seed}", f"replay: {replay}"]
    if read_error is not None:
        lines.append(f"could not read the engine's log: {read_error}")
    lines += [violations_table(violations), ledger_table(injections)]
    return "\n".join(lines)


def _engine_line(engine: dict[str, Any], side: str, stats: dict[str, Any]) -> str:
    where = (f"{engine['engine']}/{engine['kind']}/{engine['attention']} on {engine['device']} "
             f"[{engine['worker']}, {_count(engine['tests'], 'test')}]")
    counts = " ".join(f"{name}={stats.get(name, '?')}" for name in STAT_FIELDS)
    retired = f" (replaced: {engine['retired']})" if engine["retired"] else ""
    return f"{where} {side}: {counts} health={stats.get('health', '?')}{retired}"


class RunResults:
    """Results of guarded tests and closed engines, as JSON-ready dicts (the report's schema)."""

    def __init__(self) -> None:
        self.tests: list[dict[str, Any]] = []
        self.engines: list[dict[str, Any]] = []

    def add_test(self, *, nodeid: str, outcome: str, worker: str, seed: int, kind: str, attention: str,
                 device: str, engine: str, canary: dict[str, Any], perturbs: list[dict[str, Any]],
                 violations: Sequence[Violation], injections: Sequence[Any], read_error: str | None) -> None:
        """One guarded test: its call-phase outcome, configuration, violations and ledger."""
        self.tests.append({
            "nodeid": nodeid, "outcome": outcome, "worker": worker, "seed": seed, "kind": kind,
            "attention": attention, "device": device, "engine": engine, "canary": canary, "perturbs": perturbs,
            "violations": [v.to_json() for v in violations],
            "injections": [injection_to_json(i) for i in injections], "read_error": read_error,
        })

    def add_engine(self, *, worker: str, engine: str, kind: str, attention: str, device: str,
                   canary: dict[str, Any], tests: int, retired: str | None, sides: dict[str, dict[str, Any]]) -> None:
        """One closed engine handle: `tests` it served, `retired` (why it was replaced early, or
        None) and `sides`, its stats() per side."""
        self.engines.append({
            "worker": worker, "engine": engine, "kind": kind, "attention": attention, "device": device,
            "canary": canary, "tests": tests, "retired": retired, "sides": sides,
        })

    def payload(self) -> dict[str, Any]:
        return {"tests": self.tests, "engines": self.engines}

    def merge(self, payload: dict[str, Any]) -> None:
        """Add another process's `payload()`."""
        self.tests += payload["tests"]
        self.engines += payload["engines"]

    def summary_lines(self) -> list[str]:
        """One line per engine (per side of a PD pair), then the totals."""
        lines = [
            _engine_line(engine, side, stats)
            for engine in self.engines
            for side, stats in engine["sides"].items()
        ]
        violations = sum(len(t["violations"]) for t in self.tests)
        lines.append(f"{_count(len(self.tests), 'guarded test')}, {_count(violations, 'violation')}, "
                     f"{_count(len(self.engines), 'engine handle')}")
        return lines

    def write_json(self, path: Path, config: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {"config": config, "tests": self.tests, "engines": self.engines}
        path.write_text(json.dumps(document, indent=2) + "\n")
