"""Hugging Face transformers continuous batching as a pytest plugin: `--kv-canary-engine
transformers` and its tensor-parallel shards. The adapter (transformers_cb, with torch and
transformers) loads only when a test asks for an engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .spec import EngineSpec

if TYPE_CHECKING:
    from .transformers_cb import TensorParallelShards, TransformersEngine

NAME = "transformers"
PACKAGE = "transformers"  # the optional package it drives, installed with the extra of that name
SPLITS = ("tp",)  # what a parallel engine of it splits over


@pytest.hookimpl
def pytest_kvcanary_make_engine(spec: EngineSpec) -> TransformersEngine | None:
    if spec.name != NAME:
        return None
    from .transformers_cb import make_transformers_engine

    return make_transformers_engine(spec.attention, spec.device, spec.seed, spec.model)


def make_shards(spec: EngineSpec) -> TensorParallelShards:
    """The ShardFactory (handles.rank) of a tensor-parallel transformers engine."""
    from .transformers_cb import transformers_shards

    return transformers_shards(spec.attention, spec.seed, spec.model)
