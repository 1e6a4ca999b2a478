"""Hooks pytest-kvcanary adds to pytest: implement them in a conftest.py or a plugin.

The harness calls them in the test process, lazily, when a test first needs an engine of that
configuration, with one argument, `spec` (`pytest_kvcanary.adapters.EngineSpec`). The built-in
engines (reference, transformers, vllm) are implementations too, registered by the plugin; one a
conftest or a plugin registers is asked first. The first non-None result wins.

The separate arguments these hooks took before (name, attention, device, seed, model;
prefill_device and decode_device for a pair) are still passed, each now a field of `spec`; an
implementation that takes them (`name` first) gets a DeprecationWarning when it is registered.
"""

from __future__ import annotations

from typing import Any

import pytest

from .adapters.spec import EngineSpec

_OLD = ("pytest_kvcanary_make_engine(spec) takes one argument, spec (pytest_kvcanary.adapters.EngineSpec): read "
        "spec.name, spec.attention, spec.device, spec.seed and spec.model instead of taking them as arguments")
_OLD_PAIR = ("pytest_kvcanary_make_pd_pair(spec) takes one argument, spec (pytest_kvcanary.adapters.EngineSpec): "
             "read spec.name, spec.attention, spec.device (the prefill side's), spec.decode_device, spec.seed and "
             "spec.model instead of taking them as arguments")


# An implementation of the old form takes `name` (it may leave out trailing arguments only): the
# warning comes with it, once per implementation.
@pytest.hookspec(firstresult=True, warn_on_impl_args={"name": DeprecationWarning(_OLD)})
def pytest_kvcanary_make_engine(spec: EngineSpec, name: str, attention: str, device: str, seed: int,
                                model: str | None) -> Any | None:
    """Build the engine `spec` describes, or return None when this implementation does not know
    spec.name (the --kv-canary-engine / kv_canary_engine setting).

    spec.attention: "mha", "swa", "mla", "hybrid" or "sparse" (raise `UnsupportedAttention` for a kind the
    engine lacks); spec.device: a torch device string such as "cpu" or "cuda:1"; spec.seed: the
    run's --kv-canary-seed; spec.model: the --kv-canary-model checkpoint directory, or None;
    spec.config: the run's pytest config, for options the implementation's plugin registered. The
    engine returned implements `pytest_kvcanary.canary.seam.EngineUnderTest` (the `GuardedEngine`
    seam plus set_forward_hooks, generate and reset); its close(), when it has one, is called once
    the harness is done with it. The other arguments are deprecated (see the module docstring).
    """


@pytest.hookspec(firstresult=True, warn_on_impl_args={"name": DeprecationWarning(_OLD_PAIR)})
def pytest_kvcanary_make_pd_pair(spec: EngineSpec, name: str, attention: str, prefill_device: str,
                                 decode_device: str, seed: int, model: str | None) -> Any | None:
    """Build a prefill/decode pair of engine spec.name for the kv_pd fixture, or return None when
    this implementation has none (kv_pd tests then skip, naming the engine).

    spec as for pytest_kvcanary_make_engine, spec.device being the prefill side's device and
    spec.decode_device the decode side's (the same device when only one is leased). The pair
    returned implements `pytest_kvcanary.canary.seam.PrefillDecodePair`. The other arguments are
    deprecated (see the module docstring).
    """
