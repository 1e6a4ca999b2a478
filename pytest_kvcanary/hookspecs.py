"""Hooks pytest-kvcanary adds to pytest: implement them in a conftest.py or a plugin.

The harness calls them in the test process, lazily, when a test first needs an engine of that
configuration. Built-in engine names (reference, transformers, vllm) never reach them. An
implementation may leave out trailing arguments it does not use; the first non-None result wins.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=True)
def pytest_kvcanary_make_engine(name: str, attention: str, device: str, seed: int, model: str | None) -> Any | None:
    """Build the engine called `name` (the --kv-canary-engine / kv_canary_engine setting), or
    return None when this implementation does not know the name.

    attention: "mha" or "swa"; device: a torch device string such as "cpu" or "cuda:1"; seed:
    the run's --kv-canary-seed; model: the --kv-canary-model checkpoint directory, or None. The
    engine returned implements `pytest_kvcanary.canary.seam.EngineUnderTest` (the
    `CanaryHost` seam plus set_forward_hooks, generate and reset).
    """


@pytest.hookspec(firstresult=True)
def pytest_kvcanary_make_pd_pair(name: str, attention: str, prefill_device: str, decode_device: str, seed: int,
                                 model: str | None) -> Any | None:
    """Build a prefill/decode pair of engine `name` for the kv_pd fixture, or return None when
    this implementation has none (kv_pd tests then skip, naming the engine).

    Arguments as for pytest_kvcanary_make_engine, with one device per side (the same device
    when only one is leased). The pair returned implements
    `pytest_kvcanary.canary.seam.PrefillDecodePair`.
    """
