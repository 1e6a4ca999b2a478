"""Fixtures the vLLM adapter's tests share: a float32 engine (its KV compared with a cacheless
transformers forward, in float32) and that reference model, once per module."""

from __future__ import annotations

import pytest
import torch

from .support import make_engine


@pytest.fixture(scope="module")
def engine():
    return make_engine("mha", dtype="float32", num_blocks=24)


@pytest.fixture(scope="module")
def reference_model(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.llm.llm_engine.model_config.model, dtype=torch.float32)
