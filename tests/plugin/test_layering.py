"""Import facts a reviewer can check, read from the source with `ast` (nothing is imported;
imports under TYPE_CHECKING and inside functions count too):

- The layers, top to bottom, and the rule that every import points down (`LAYERS`): the entry
  (plugin.py, the package root) over the stock soak suite, over the engine handles, over the rest of
  the plugin level (settings, assertions, plugin_support), over what it reads (report, gpu,
  hookspecs; the workload soak), over the fault injector, the canary runtime and its seam, the
  configuration and the kernels. Engines (engine/, then adapters/) are a branch of their own that
  only the handles reach: the engine and adapter layers never import the plugin level, and the
  plugin level reaches an engine through the handles only. The one thing both branches hold is
  what every engine is built from (adapters/spec.py, the hooks' argument), which imports nothing.
- The package root holds only the plugin's entry and what it reads; the seam imports only the
  types it hands over; the reference engine imports no adapter.
- No modules of the project import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"pytest_kvcanary": ROOT / "pytest_kvcanary", "kvcanary_kernels": ROOT / "kvcanary_kernels"}
LOWER_LAYERS = ("pytest_kvcanary.reference_engine", "pytest_kvcanary.adapters")
PLUGIN_PACKAGES = ("pytest_kvcanary.handles", "pytest_kvcanary.plugin_support", "pytest_kvcanary.soak")
ROOT_MODULES = {"__init__", "plugin", "settings", "config", "assertions", "report", "gpu", "hookspecs"}

# Each layer: the modules it holds (a module or package name; the longest that names a module
# decides) and the layers directly beneath it. A module imports its own layer and anything beneath
# its layer, directly or further down; never a layer above it or beside it.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "entry": (("pytest_kvcanary", "pytest_kvcanary.plugin"), ("soak suite",)),
    # a module of tests pytest collects (--pyargs): it reads the run's settings, never the plugin
    "soak suite": (("pytest_kvcanary.soak.suite",), ("handles",)),
    "handles": (("pytest_kvcanary.handles",), ("plugin level", "adapters")),
    "plugin level": (("pytest_kvcanary.settings", "pytest_kvcanary.assertions", "pytest_kvcanary.plugin_support"),
                     ("plugin base", "soak")),
    "plugin base": (("pytest_kvcanary.report", "pytest_kvcanary.gpu", "pytest_kvcanary.hookspecs"),
                    ("perturb", "engine spec")),
    "soak": (("pytest_kvcanary.soak",), ("perturb",)),
    "adapters": (("pytest_kvcanary.adapters",), ("reference engine", "engine spec")),
    # what every engine is built from: the hookspecs name it, the adapters' plugins receive it
    "engine spec": (("pytest_kvcanary.adapters.spec",), ()),
    "reference engine": (("pytest_kvcanary.reference_engine",), ("canary",)),
    "perturb": (("pytest_kvcanary.perturb",), ("canary",)),
    "canary": (("pytest_kvcanary.canary",), ("config", "soak seam types")),
    # the types of the seam's soak members, defined with the soak, re-exported by the seam
    "soak seam types": (("pytest_kvcanary.soak.seam_types",), ("kernels",)),
    "config": (("pytest_kvcanary.config",), ("kernels",)),
    "kernels": (("kvcanary_kernels",), ()),
}
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


def _layer(name: str) -> str:
    """The layer of module `name`: the one holding the longest name that is `name` or a package
    above it."""
    held = [(len(held), layer) for layer, (modules, _) in LAYERS.items() for held in modules
            if name == held or name.startswith(held + ".")]
    assert held, f"{name} is in no layer: add it to LAYERS"
    return max(held)[1]


def _beneath(layer: str) -> set[str]:
    """The layers beneath `layer`, directly or further down."""
    found: set[str] = set()
    todo = list(LAYERS[layer][1])
    while todo:
        if (below := todo.pop()) not in found:
            found.add(below)
            todo += LAYERS[below][1]
    return found


def _upward() -> list[str]:
    """Every import into a layer above or beside the importer's, as "module (layer) -> module (layer)"."""
    return sorted(f"{name} ({_layer(name)}) -> {target} ({_layer(target)})" for name, targets in GRAPH.items()
                  for target in targets
                  if _layer(target) != _layer(name) and _layer(target) not in _beneath(_layer(name)))


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
    assert "pytest_kvcanary.reference_engine.radix_cache" in GRAPH["pytest_kvcanary.reference_engine.engine"]  # from .x import Y
    assert "pytest_kvcanary.canary.seam" in GRAPH["pytest_kvcanary.reference_engine.pd"]  # from ..x.y import Y
    assert "kvcanary_kernels.records" in GRAPH["pytest_kvcanary.config"]  # absolute
    assert "pytest_kvcanary.handles.start" in GRAPH["pytest_kvcanary.plugin"]  # from .p import module, in a function
    assert "pytest_kvcanary.plugin_support.markers" in GRAPH["pytest_kvcanary.plugin"]  # from .p import module


def test_the_package_root_holds_only_the_plugin_and_what_it_reads():
    root = ROOT / "pytest_kvcanary"
    assert {p.stem for p in root.glob("*.py")} == ROOT_MODULES
    assert {p.name for p in root.iterdir() if (p / "__init__.py").exists()} == {
        "adapters", "canary", "reference_engine", "handles", "perturb", "plugin_support", "soak"}


def test_every_module_is_in_a_layer_and_the_layers_are_a_hierarchy():
    """Each module has a layer; no layer lies beneath itself (the table is a DAG); every layer but
    the entry lies beneath it."""
    assert all(_layer(name) for name in GRAPH)
    assert not [layer for layer in LAYERS if layer in _beneath(layer)]
    assert _beneath("entry") == set(LAYERS) - {"entry"}


def test_every_import_points_down():
    upward = _upward()
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("source, target", [
    ("pytest_kvcanary.settings", "pytest_kvcanary.handles.factories"),  # settings -> handles
    ("pytest_kvcanary.settings", "pytest_kvcanary.adapters.vllm.isa"),  # settings -> an adapter
    ("pytest_kvcanary.hookspecs", "pytest_kvcanary.adapters.reference_hooks"),  # the hookspecs -> an engine
    ("pytest_kvcanary.adapters.spec", "pytest_kvcanary.adapters.reference"),  # the engine spec -> an adapter
    ("pytest_kvcanary.soak.suite", "pytest_kvcanary.plugin"),  # the soak -> the plugin
    ("pytest_kvcanary.soak.runner", "pytest_kvcanary.handles.sided"),  # the soak -> the handles
    ("pytest_kvcanary.assertions", "pytest_kvcanary.handles.protocol"),  # assertions -> handles
    ("pytest_kvcanary.report", "pytest_kvcanary.settings"),  # what the plugin level reads -> it
    ("pytest_kvcanary.canary.seam", "pytest_kvcanary.soak.runner"),  # the seam -> the soak
    ("pytest_kvcanary.canary.runtime", "pytest_kvcanary.perturb.ledger"),  # the runtime -> the injector
    ("pytest_kvcanary.reference_engine.engine", "pytest_kvcanary.adapters.reference"),  # the engine -> an adapter
    ("pytest_kvcanary.config", "pytest_kvcanary.canary.violation"),  # the configuration -> the runtime
    ("kvcanary_kernels.launch", "pytest_kvcanary.canary.seam"),  # the kernels -> the seam
])
def test_an_upward_import_is_refused(source, target, monkeypatch):
    """The rule refuses each import that ran up the layers once (settings -> handles and adapters,
    the soak -> the plugin, assertions -> handles) and its like, by the layers alone."""
    monkeypatch.setitem(GRAPH, source, GRAPH[source] | {target})
    assert f"{source} ({_layer(source)}) -> {target} ({_layer(target)})" in _upward()


def test_the_engine_spec_imports_nothing_of_the_project():
    """The hookspecs and the adapters both import it: it stays a leaf."""
    assert GRAPH["pytest_kvcanary.adapters.spec"] == set()


def test_settings_know_no_engines_options():
    """An engine's options are its plugin's: settings.py names none of them."""
    text = (ROOT / "pytest_kvcanary" / "settings.py").read_text()
    assert "vllm_attention_isa" not in text and "KVCANARY_VLLM" not in text


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
    """An engine author's one import: it pulls in the seam's data types, the kernels' input types,
    the record layout and the soak's types, nothing of the runtime, the kernels' code or the plugin."""
    types = {"pytest_kvcanary.canary.seam_data", "kvcanary_kernels.inputs", "kvcanary_kernels.records",
             "pytest_kvcanary.soak.seam_types"}
    assert GRAPH[SEAM] == types
    assert GRAPH["pytest_kvcanary.canary.seam_data"] <= types | {"kvcanary_kernels.checks"}
    assert GRAPH["pytest_kvcanary.soak.seam_types"] == {"kvcanary_kernels.records"}


def test_adapters_and_the_reference_engine_import_the_seam_not_the_handles():
    """The protocols an engine implements live in the seam; no adapter reaches past it."""
    users = {name for name, targets in GRAPH.items() if SEAM in targets}
    assert {"pytest_kvcanary.reference_engine.engine", "pytest_kvcanary.reference_engine.pd", "pytest_kvcanary.handles.factories",
            "pytest_kvcanary.adapters.transformers_cb.model", "pytest_kvcanary.canary.runtime"} <= users


def test_the_reference_engine_imports_no_adapter():
    """Adapters wrap engines: reference_engine/ sits below adapters/."""
    upward = sorted(f"{name} -> {target}" for name, targets in GRAPH.items()
                    if name.startswith("pytest_kvcanary.reference_engine.") for target in targets
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


@pytest.mark.parametrize("edge", [("pytest_kvcanary.reference_engine.request", "pytest_kvcanary.reference_engine.radix_cache"),
                                  ("pytest_kvcanary.canary.seam_data", "pytest_kvcanary.canary.runtime")])
def test_a_cycle_is_found(edge, monkeypatch):
    """The cycle check can fail: one added import that closes a loop is reported."""
    source, target = edge
    monkeypatch.setitem(GRAPH, source, GRAPH[source] | {target})
    assert _cycle() is not None


MAX_CLASS_LINES = 400


def _long_classes(limit: int) -> list[str]:
    """Classes of the project's modules longer than `limit` lines, with their lengths."""
    found = []
    for name, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def test_no_product_class_is_over_400_lines():
    """A class past that holds more than one concept: split it by concept, not by lines."""
    assert not _long_classes(MAX_CLASS_LINES), "\n".join(_long_classes(MAX_CLASS_LINES))


def test_a_long_class_is_found():
    """The size check can fail: with a lower limit the longest classes are named."""
    assert any(".RadixCache: " in line for line in _long_classes(300))
