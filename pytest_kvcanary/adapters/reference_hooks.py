"""The reference engine as a pytest plugin: `--kv-canary-engine reference` (the default), its
prefill/decode pair and its tensor/pipeline-parallel shards. The engine loads (with torch) only
when a test asks for one."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .spec import EngineSpec

if TYPE_CHECKING:
    from ..reference_engine.engine import Engine
    from ..reference_engine.parallel.shard import ReferenceShards
    from ..reference_engine.pd import PDPair

NAME = "reference"
PACKAGE = None  # the optional package it drives: none, it is the project's own
SPLITS = ("tp", "pp")  # what a parallel engine of it splits over


@pytest.hookimpl
def pytest_kvcanary_make_engine(spec: EngineSpec) -> Engine | None:
    if spec.name != NAME:
        return None
    from .reference import make_reference_engine

    return make_reference_engine(spec.attention, spec.device, spec.seed, spec.model)


@pytest.hookimpl
def pytest_kvcanary_make_pd_pair(spec: EngineSpec) -> PDPair | None:
    if spec.name != NAME:
        return None
    from ..reference_engine.pd import PDPair
    from .reference import make_reference_engine

    devices = (spec.device, spec.decode_device or spec.device)
    return PDPair(*(make_reference_engine(spec.attention, device, spec.seed, spec.model) for device in devices))


def make_shards(spec: EngineSpec) -> ReferenceShards:
    """The ShardFactory (handles.rank) of a parallel reference engine (spec.device is unused: each
    rank runs on its own)."""
    from .reference import reference_shards

    return reference_shards(spec.attention, spec.seed, spec.model)
