"""Engines by name, built through the `pytest_kvcanary_make_engine` hook (no torch at import).

`--kv-canary-engine NAME` resolves to the first `pytest_kvcanary_make_engine` implementation that
knows the name: a conftest's or a plugin's, else a built-in engine's. The built-in engines are
ordinary implementations, each in a pytest plugin of its own that the plugin registers
(adapters/reference_hooks.py, transformers_hooks.py, vllm_hooks.py; transformers and vllm need
their optional packages). A prefill/decode pair (kv_pd) comes from `pytest_kvcanary_make_pd_pair`
the same way (the reference engine's plugin has one). What only the built-in engines have is
read from their plugins here: the package each needs and the parallel engine (kv_parallel) each
splits into, the reference engine over tensor and pipeline parallel, transformers tensor
parallel only; handles/checkpoints.py judges a --kv-canary-model directory for each.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..adapters import reference_hooks, transformers_hooks, vllm_hooks
from ..adapters.spec import EngineSpec
from ..canary.seam import missing_methods
from . import checkpoints

if TYPE_CHECKING:
    from ..canary.seam import EngineUnderTest, PrefillDecodePair

# The built-in engines' plugins by engine name. Each module names its engine (NAME), the optional
# package it drives (PACKAGE, None for none), what a parallel engine of it splits over (SPLITS, ()
# for one process only) and, when it splits, its shard factory (make_shards(spec)).
BUILTIN_ENGINES: dict[str, ModuleType] = {m.NAME: m for m in (reference_hooks, transformers_hooks, vllm_hooks)}
# The options the built-in engines' plugins register (a module's OPTIONS), ini key -> flag: what the
# run's header, replay command and report show.
ENGINE_OPTIONS: dict[str, str] = {name: flag for m in BUILTIN_ENGINES.values()
                                  for name, flag in getattr(m, "OPTIONS", {}).items()}


class UnknownEngine(LookupError):
    """No engine of that name can be built here; the message says why and what is known."""


class NotAnEngineUnderTest(TypeError):
    """What the hook returned lacks methods EngineUnderTest requires; the message names them."""


class NoPrefillDecodePair(LookupError):
    """The engine has no prefill/decode pair; kv_pd tests skip with this message."""


class NoParallelEngine(LookupError):
    """The engine has no parallel form of that shape here (see parallel_problem); kv_parallel tests
    skip with this message."""


# How to install each engine's package, run in a clone of the project: the commands the docs give
# (a test checks), vLLM's in an environment of its own (docs/vllm.md).
INSTALL = {
    "transformers": 'pip install -e ".[transformers]"',
    "vllm": 'python3 -m venv .venv-vllm && . .venv-vllm/bin/activate && pip install "torch==2.13.0" -e ".[vllm,test]" '
            '&& pip uninstall -y torchvision torchaudio torchcodec',
}


def install_hint(package: str) -> str:
    return f"in a clone of pytest-kvcanary, {INSTALL[package]}"


def engine_problem(name: str) -> str | None:
    """Why the built-in engine `name` cannot run here (its package is missing), or None."""
    builtin = BUILTIN_ENGINES.get(name)
    if builtin is None or builtin.PACKAGE is None or importlib.util.find_spec(builtin.PACKAGE) is not None:
        return None
    return f"needs the {builtin.PACKAGE} package, which is not installed: {install_hint(builtin.PACKAGE)}"


def hook_engines(pluginmanager: Any) -> bool:
    """Whether a plugin or a conftest other than the built-in engines' implements
    pytest_kvcanary_make_engine (and so may know names the built-in engines do not)."""
    builtin = set(BUILTIN_ENGINES.values())
    return any(impl.plugin not in builtin for impl in pluginmanager.hook.pytest_kvcanary_make_engine.get_hookimpls())


def parallel_problem(name: str, tp: int, pp: int) -> tuple[str, str] | None:
    """Why engine `name` cannot run as tp x pp ranks here, as (the field at fault, "tp" or "pp";
    what it must be), or None (also for one rank)."""
    builtin = BUILTIN_ENGINES.get(name)
    splits = () if builtin is None else builtin.SPLITS
    for field, value in (("tp", tp), ("pp", pp)):
        if value > 1 and field not in splits:
            if not splits:
                return field, (f"needs an engine that runs parallel here: {', '.join(parallel_engines())}; "
                               f"engine {name!r} runs in one process only")
            return field, f"must be 1 with engine {name!r}: it runs parallel over {' and '.join(splits)} only"
    return None


def split_problem(name: str, attention: str, tp: int, pp: int, seed: int, model: str | None) -> str | None:
    """Why the model of built-in engine `name` (its default, or the checkpoint `model`) cannot be
    split over tp x pp ranks for this attention kind: what its shard factory's check says ("tp=3
    must divide model.num_heads (4): ..."), or None (also for an engine or kind it does not run:
    parallel_problem and the engine say so)."""
    if tp * pp == 1 or parallel_problem(name, tp, pp) or engine_problem(name):
        return None
    from ..canary.seam import UnsupportedAttention
    from ..reference_engine.parallel.topology import Topology

    try:
        make_shards(EngineSpec(name, attention, "cpu", seed, model)).check(Topology(tp, pp))
    except UnsupportedAttention:
        return None
    except ValueError as e:
        return str(e)
    return None


def parallel_engines() -> list[str]:
    """The built-in engines that run parallel, each with what it splits over."""
    return [f"{name} ({' x '.join(b.SPLITS)})" for name, b in BUILTIN_ENGINES.items() if b.SPLITS]


def make_shards(spec: EngineSpec) -> Any:
    """The ShardFactory (handles.rank) of the built-in engine spec.name (spec.device is unused:
    each rank runs on its own). Raises NoParallelEngine when it has none, UnknownEngine when its
    package is missing, and what the engine's model raises (UnsupportedAttention for an attention
    kind it lacks)."""
    builtin = BUILTIN_ENGINES.get(spec.name)
    if builtin is None or not builtin.SPLITS:
        raise NoParallelEngine(f"kv_parallel runs {', '.join(parallel_engines())}; engine {spec.name!r} has no "
                               "parallel engine here")
    if problem := engine_problem(spec.name):
        raise UnknownEngine(f"engine {spec.name!r} {problem}")
    return builtin.make_shards(spec)


def model_problem(name: str, model: Path) -> str | None:
    """Why the checkpoint directory `model` cannot serve the built-in engine `name`, or None
    (also for engines a hook builds: they judge their models themselves)."""
    check = checkpoints.PROBLEMS.get(name)
    return None if check is None else check(model)


@functools.cache
def _builtin_hooks() -> Any:
    """The hooks as seen outside a pytest run (a spec without config): the built-in engines' only."""
    import pluggy

    from .. import hookspecs

    manager = pluggy.PluginManager("pytest")
    manager.add_hookspecs(hookspecs)
    for module in BUILTIN_ENGINES.values():
        manager.register(module)
    return manager.hook


def _hooks(spec: EngineSpec) -> Any:
    return spec.config.pluginmanager.hook if spec.config is not None else _builtin_hooks()


def make_engine(spec: EngineSpec) -> EngineUnderTest:
    """The first pytest_kvcanary_make_engine result for spec (a conftest's or a plugin's before a
    built-in engine's). Raises UnknownEngine when nobody knows the name (or the built-in engine's
    package is missing), NotAnEngineUnderTest when the result lacks a method the harness needs."""
    if problem := engine_problem(spec.name):
        raise UnknownEngine(f"engine {spec.name!r} {problem}")
    engine = _hooks(spec).pytest_kvcanary_make_engine(  # the separate arguments for old implementations
        spec=spec, name=spec.name, attention=spec.attention, device=spec.device, seed=spec.seed, model=spec.model)
    if engine is None:
        raise UnknownEngine(f"no engine named {spec.name!r}: --kv-canary-engine names {', '.join(BUILTIN_ENGINES)} "
                            "or an engine a pytest_kvcanary_make_engine hook implementation returns")
    if missing := missing_methods(engine):
        raise NotAnEngineUnderTest(f"engine {spec.name!r} ({type(engine).__name__}) does not implement EngineUnderTest "
                                   f"(pytest_kvcanary/canary/seam.py): missing {', '.join(missing)}")
    return engine


def make_pd_pair(spec: EngineSpec) -> PrefillDecodePair:
    """The first pytest_kvcanary_make_pd_pair result for spec (prefill on spec.device, decode on
    spec.decode_device). Raises NoPrefillDecodePair when none builds one (before any engine is
    started)."""
    pair = _hooks(spec).pytest_kvcanary_make_pd_pair(  # the separate arguments for old implementations
        spec=spec, name=spec.name, attention=spec.attention, prefill_device=spec.device,
        decode_device=spec.decode_device, seed=spec.seed, model=spec.model)
    if pair is None:
        raise NoPrefillDecodePair(
            f"kv_pd needs a prefill/decode pair of engine {spec.name!r}, and none is known: the reference engine "
            "has one; for another engine, return one from a pytest_kvcanary_make_pd_pair hook "
            "(the PrefillDecodePair seam in pytest_kvcanary/canary/seam.py)")
    return pair
