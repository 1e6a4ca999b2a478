"""The soak, its benchmark and the fault injector read the canary runtime through its readout
(`CanaryRuntime.readout`, canary/readout.py) only: no attribute chain into the runtime's groups,
halves, sources, records or state guard, and no import of the modules that hold them. Read from
the source with `ast` (nothing is imported), as the layering test reads imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pytest_kvcanary"
CALLERS = sorted([*(PACKAGE / "soak").glob("*.py"), *(PACKAGE / "perturb").glob("*.py"), ROOT / "benchmarks" / "soak.py"])
# Members of the runtime's own state (GroupState, HalfState, StateGuard, HostRecords) and of the
# pools it holds: reading them re-derives what the readout answers.
INTERNAL_MEMBERS = {"halves", "sources", "source_layers", "records", "pool", "k_layers", "v_layers", "mapped_slots",
                    "to_group_slots", "has_sources", "stored_hashes", "read_hashes", "host_records"}
# The runtime's attributes holding them (`host_records` above): `runtime.groups`, `runtime.state`.
RUNTIME_MEMBERS = {"groups", "state"}
# The canary modules that hold them (a caller imports the readout's types instead).
INTERNAL_MODULES = {"pytest_kvcanary.canary.groups", "pytest_kvcanary.canary.state",
                    "pytest_kvcanary.canary.host_records", "pytest_kvcanary.canary.plans"}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported(node: ast.ImportFrom, module: str) -> list[str]:
    """The modules a `from ... import ...` names (a relative one resolved against `module`)."""
    base = node.module or ""
    if node.level:
        package = module.split(".")[:-node.level]
        base = ".".join(package + ([node.module] if node.module else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _named(node: ast.expr) -> str | None:
    """The name an expression ends in: `runtime` for `runtime` and `side.runtime`."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def reaches_in(source: str, module: str = "pytest_kvcanary.perturb.example") -> list[str]:
    """Each reach into the runtime's internals in `source`, as "line: what"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNAL_MEMBERS:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in RUNTIME_MEMBERS and _named(node.value) == "runtime":
            found.append(f"{node.lineno}: runtime.{node.attr}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in INTERNAL_MODULES]
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: import {m}" for m in _imported(node, module) if m in INTERNAL_MODULES]
    return found


def test_the_callers_are_read():
    names = {p.name for p in CALLERS}
    assert {"runner.py", "suite.py", "injector.py", "targets.py", "soak.py"} <= names


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_soak_and_the_injector_read_the_runtime_through_its_readout(path: Path):
    found = reaches_in(path.read_text(), _module(path))
    assert not found, f"{path.relative_to(ROOT)} reaches into the runtime (use CanaryRuntime.readout()):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source, found", [
    ("dtype = handle.sides[0].runtime.groups[0].pool.k_layers[0].dtype",
     ["1: .k_layers", "1: .pool", "1: runtime.groups"]),
    ("state = self.runtime.state", ["1: runtime.state"]),
    ("held = runtime.host_records", ["1: .host_records"]),
    ("layer = group.halves[half].sources[0]", ["1: .halves", "1: .sources"]),
    ("space, slot = group.mapped_slots(rows, positions)", ["1: .mapped_slots"]),
    ("from ..canary.groups import GroupState", ["1: import pytest_kvcanary.canary.groups"]),
    ("from pytest_kvcanary.canary.plans import sweep_entries", ["1: import pytest_kvcanary.canary.plans"]),
    ("from ..canary import state", ["1: import pytest_kvcanary.canary.state"]),
])
def test_a_reach_into_the_runtime_is_found(source: str, found: list[str]):
    """The check can fail: each form the callers once used is reported."""
    assert sorted(reaches_in(source)) == sorted(found)


def test_the_readout_and_view_state_are_not_reaches():
    """What the callers may read: the readout, a forward view's state, the seam's pools."""
    assert reaches_in("g = runtime.readout().group(kind); s = view.state.slots; p = tier.pools; "
                      "r = runtime.readout().state_restores(); k = runtime.group_kinds") == []
