"""Import facts a reviewer can check: the package root holds only the plugin's entry and what it
reads (settings, config, assertions, report, gpu, hookspecs); the engine and adapter layers never
import the plugin level (those modules, the engine handles in handles/, the plugin's support in
plugin_support/, the workload soak in soak/); the reference engine imports no adapter; the seam module imports only the
types it hands over; and no modules of the project import each other, directly or around a loop
(imports under TYPE_CHECKING and inside functions count too). Read from the source with `ast`;
nothing is imported."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"pytest_kvcanary": ROOT / "pytest_kvcanary", "kvcanary_kernels": ROOT / "kernels"}
LOWER_LAYERS = ("pytest_kvcanary.engine", "pytest_kvcanary.adapters")
PLUGIN_PACKAGES = ("pytest_kvcanary.handles", "pytest_kvcanary.plugin_support", "pytest_kvcanary.soak")
ROOT_MODULES = {"__init__", "plugin", "settings", "config", "assertions", "report", "gpu", "hookspecs"}
SEAM = "pytest_kvcanary.canary.seam"


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports anywhere in its source (a `from package import module`
    counts as importing that module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_plugin_level(name: str) -> bool:
    """A module file directly in pytest_kvcanary/, or one of the handles and the plugin's support."""
    prefix, _, rest = name.partition(".")
    at_root = prefix == "pytest_kvcanary" and rest != "" and "." not in rest and MODULES[name].name != "__init__.py"
    return at_root or any(name == p or name.startswith(p + ".") for p in PLUGIN_PACKAGES)


def test_every_package_is_installed():
    """pyproject's package list names every package folder, so a wheel holds each module."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    # kvcanary_examples: the example suite, installed for --pyargs (the conformance suite)
    assert listed == {name for name, path in MODULES.items() if path.name == "__init__.py"} | {"kvcanary_examples"}
    assert (ROOT / "examples" / "__init__.py").is_file()


def _in_lower_layer(name: str) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in LOWER_LAYERS)


def test_the_graph_sees_the_known_imports():
    """The reading itself works: known edges of each import form are found."""
    assert "pytest_kvcanary.engine.radix_cache" in GRAPH["pytest_kvcanary.engine.engine"]  # from .x import Y
    assert "pytest_kvcanary.canary.seam" in GRAPH["pytest_kvcanary.engine.pd"]  # from ..x.y import Y
    assert "kvcanary_kernels.records" in GRAPH["pytest_kvcanary.config"]  # absolute
    assert "pytest_kvcanary.handles.start" in GRAPH["pytest_kvcanary.plugin"]  # from .p import module, in a function
    assert "pytest_kvcanary.plugin_support.markers" in GRAPH["pytest_kvcanary.plugin"]  # from .p import module


def test_the_package_root_holds_only_the_plugin_and_what_it_reads():
    root = ROOT / "pytest_kvcanary"
    assert {p.stem for p in root.glob("*.py")} == ROOT_MODULES
    assert {p.name for p in root.iterdir() if (p / "__init__.py").exists()} == {
        "adapters", "canary", "engine", "handles", "perturb", "plugin_support", "soak"}


def test_engine_and_adapters_import_nothing_from_the_plugin_level():
    upward = sorted(f"{name} -> {target}" for name, targets in GRAPH.items() if _in_lower_layer(name)
                    for target in targets if _is_plugin_level(target))
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("target", ["pytest_kvcanary.handles.factories", "pytest_kvcanary.config",
                                    "pytest_kvcanary.plugin_support.markers"])
def test_an_upward_import_is_found(target, monkeypatch):
    """The layering check can fail: an adapter importing a handle module, the config or the markers."""
    source = "pytest_kvcanary.adapters.reference"
    monkeypatch.setitem(GRAPH, source, GRAPH[source] | {target})
    with pytest.raises(AssertionError, match=target):
        test_engine_and_adapters_import_nothing_from_the_plugin_level()


def test_the_seam_imports_only_the_types_it_hands_over():
    """An engine author's one import: it pulls in the seam's data types, the kernels' input types
    and the record layout, nothing of the runtime, the kernels' code or the plugin."""
    assert GRAPH[SEAM] == {"pytest_kvcanary.canary.host", "kvcanary_kernels.records"}
    assert GRAPH["pytest_kvcanary.canary.host"] <= {"kvcanary_kernels.records", "kvcanary_kernels.checks",
                                                    "kvcanary_kernels.inputs"}


def test_adapters_and_the_reference_engine_import_the_seam_not_the_handles():
    """The protocols an engine implements live in the seam; no adapter reaches past it."""
    users = {name for name, targets in GRAPH.items() if SEAM in targets}
    assert {"pytest_kvcanary.engine.engine", "pytest_kvcanary.engine.pd", "pytest_kvcanary.handles.factories",
            "pytest_kvcanary.adapters.transformers_cb.model", "pytest_kvcanary.canary.runtime"} <= users


def test_the_reference_engine_imports_no_adapter():
    """Adapters wrap engines: engine/ (the reference engine) sits below adapters/."""
    upward = sorted(f"{name} -> {target}" for name, targets in GRAPH.items()
                    if name.startswith("pytest_kvcanary.engine.") for target in targets
                    if target.startswith("pytest_kvcanary.adapters"))
    assert not upward, "\n".join(upward)


def _cycle() -> list[str] | None:
    """One import cycle among the project's modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("edge", [("pytest_kvcanary.engine.request", "pytest_kvcanary.engine.radix_cache"),
                                  ("pytest_kvcanary.canary.host", "pytest_kvcanary.canary.runtime")])
def test_a_cycle_is_found(edge, monkeypatch):
    """The cycle check can fail: one added import that closes a loop is reported."""
    source, target = edge
    monkeypatch.setitem(GRAPH, source, GRAPH[source] | {target})
    assert _cycle() is not None
