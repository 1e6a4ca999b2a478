"""Engines by name: the built-in ones, and those a conftest's hooks build (no torch at import).

`--kv-canary-engine NAME` resolves to a built-in factory (reference; transformers and vllm, each
loaded only when named and needing its optional package), else to the first
`pytest_kvcanary_make_engine` hook implementation that knows the name. A prefill/decode pair
(kv_pd) comes from the built-in reference pair or a `pytest_kvcanary_make_pd_pair` hook. A parallel
engine (kv_parallel) comes from a built-in engine's shard factory: the reference engine splits
tensor and pipeline parallel, transformers tensor parallel only.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..canary.seam import missing_methods

if TYPE_CHECKING:
    from ..canary.seam import EngineUnderTest, PrefillDecodePair


class Builtin(NamedTuple):
    factory: str  # "module:function" with the signature (attention, device, seed, model)
    package: str | None  # the optional package it drives, installed with the extra of that name
    model_check: str  # "module:function" (path) -> why a --kv-canary-model directory cannot serve, or None
    # "module:function" (attention, seed, model) -> the ShardFactory of a parallel engine (handles.rank),
    # and the kv_parallel fields it splits over (tp, pp); None and () when it runs in one process only
    shards: str | None = None
    splits: tuple[str, ...] = ()


BUILTIN_ENGINES = {
    "reference": Builtin("pytest_kvcanary.adapters.reference:make_reference_engine", None,
                         "pytest_kvcanary.handles.checkpoints:reference_problem",
                         "pytest_kvcanary.adapters.reference:reference_shards", ("tp", "pp")),
    "transformers": Builtin("pytest_kvcanary.adapters.transformers_cb:make_transformers_engine", "transformers",
                            "pytest_kvcanary.handles.checkpoints:transformers_problem",
                            "pytest_kvcanary.adapters.transformers_cb:transformers_shards", ("tp",)),
    "vllm": Builtin("pytest_kvcanary.adapters.vllm:make_vllm_engine", "vllm",
                    "pytest_kvcanary.handles.checkpoints:any_checkpoint_problem"),
}


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
    if builtin is None or builtin.package is None or importlib.util.find_spec(builtin.package) is not None:
        return None
    return f"needs the {builtin.package} package, which is not installed: {install_hint(builtin.package)}"


def parallel_problem(name: str, tp: int, pp: int) -> tuple[str, str] | None:
    """Why engine `name` cannot run as tp x pp ranks here, as (the field at fault, "tp" or "pp";
    what it must be), or None (also for one rank)."""
    builtin = BUILTIN_ENGINES.get(name)
    splits = () if builtin is None else builtin.splits
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
    from ..engine.parallel.topology import Topology

    try:
        make_shards(name, attention, seed, model).check(Topology(tp, pp))
    except UnsupportedAttention:
        return None
    except ValueError as e:
        return str(e)
    return None


def parallel_engines() -> list[str]:
    """The built-in engines that run parallel, each with what it splits over."""
    return [f"{name} ({' x '.join(b.splits)})" for name, b in BUILTIN_ENGINES.items() if b.splits]


def make_shards(name: str, attention: str, seed: int, model: str | None) -> Any:
    """The ShardFactory (handles.rank) of the built-in engine `name`. Raises NoParallelEngine when
    it has none, UnknownEngine when its package is missing, and what the engine's model raises
    (UnsupportedAttention for an attention kind it lacks)."""
    builtin = BUILTIN_ENGINES.get(name)
    if builtin is None or builtin.shards is None:
        raise NoParallelEngine(f"kv_parallel runs {', '.join(parallel_engines())}; engine {name!r} has no parallel "
                               "engine here")
    if problem := engine_problem(name):
        raise UnknownEngine(f"engine {name!r} {problem}")
    return _load(builtin.shards)(attention, seed, model)


def model_problem(name: str, model: Path) -> str | None:
    """Why the checkpoint directory `model` cannot serve the built-in engine `name`, or None
    (also for engines a hook builds: they judge their models themselves)."""
    builtin = BUILTIN_ENGINES.get(name)
    return None if builtin is None else _load(builtin.model_check)(model)


def _load(factory: str) -> Any:
    module, _, function = factory.partition(":")
    return getattr(importlib.import_module(module), function)


def make_engine(name: str, attention: str, device: str, seed: int, model: str | None,
                pluginmanager: Any | None) -> EngineUnderTest:
    """The built-in engine `name`, else the first pytest_kvcanary_make_engine result. Raises
    UnknownEngine when nobody knows the name (or its package is missing), NotAnEngineUnderTest
    when the result lacks a method the harness needs."""
    builtin = BUILTIN_ENGINES.get(name)
    engine = None
    if builtin is not None:
        if problem := engine_problem(name):
            raise UnknownEngine(f"engine {name!r} {problem}")
        engine = _load(builtin.factory)(attention, device, seed, model)
    elif pluginmanager is not None:
        engine = pluginmanager.hook.pytest_kvcanary_make_engine(name=name, attention=attention, device=device,
                                                                seed=seed, model=model)
    if engine is None:
        raise UnknownEngine(f"no engine named {name!r}: --kv-canary-engine names {', '.join(BUILTIN_ENGINES)} or "
                          "an engine a pytest_kvcanary_make_engine hook implementation returns")
    if missing := missing_methods(engine):
        raise NotAnEngineUnderTest(f"engine {name!r} ({type(engine).__name__}) does not implement EngineUnderTest "
                                   f"(pytest_kvcanary/canary/seam.py): missing {', '.join(missing)}")
    return engine


def make_pd_pair(name: str, attention: str, devices: tuple[str, str], seed: int, model: str | None,
                 pluginmanager: Any | None) -> PrefillDecodePair:
    """A prefill/decode pair of engine `name` on (prefill, decode) devices: the reference pair,
    else the first pytest_kvcanary_make_pd_pair result. Raises NoPrefillDecodePair when neither
    builds one (before any engine is started)."""
    pair = None
    if name == "reference":
        from ..engine.pd import PDPair

        pair = PDPair(*(make_engine(name, attention, device, seed, model, pluginmanager) for device in devices))
    elif pluginmanager is not None:
        pair = pluginmanager.hook.pytest_kvcanary_make_pd_pair(
            name=name, attention=attention, prefill_device=devices[0], decode_device=devices[1], seed=seed,
            model=model)
    if pair is None:
        raise NoPrefillDecodePair(
            f"kv_pd needs a prefill/decode pair of engine {name!r}, and none is known: the reference engine "
            "has one; for another engine, return one from a pytest_kvcanary_make_pd_pair hook "
            "(the PrefillDecodePair seam in pytest_kvcanary/canary/seam.py)")
    return pair
