"""Hooks pytest-kvcanary adds to pytest: implement them in a conftest.py or a plugin."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=True)
def pytest_kvcanary_make_engine(name: str, attention: str, device: str, seed: int) -> Any | None:
    """Build the engine called `name` (the --kv-canary-engine / kv_canary_engine setting), or
    return None when this implementation does not know the name.

    The harness calls it once per engine it starts (once per side of a prefill/decode pair), in
    the test process, lazily. attention: "mha" or "swa"; device: a torch device string such as
    "cpu" or "cuda:1"; seed: the run's --kv-canary-seed. The engine returned implements
    `pytest_kvcanary.canary.host.CanaryHost`. The first non-None result is used.
    """
