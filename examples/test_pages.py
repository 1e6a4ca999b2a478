"""KV in pages of 16 tokens: the pools hand out whole pages, the radix cache shares whole pages of a
common prefix, and a sliding window frees a page once all of it slid out. The canary maps each
position through the engine's block table; greedy outputs equal those of per-token slots. The
reference engine is built with pages and guarded by hand here, through the runtime an engine
author wires to their own engine."""

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
SYSTEM = "You are a careful assistant. Answer in one short line, and never repeat yourself. "  # 5 pages
QUESTIONS = ["What is a cache?", "What is a page?", "Why share a prefix?", "What slides?"]


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_pages_of_16_tokens_with_a_shared_prefix_are_clean(attention):
    per_token = make_reference_engine(attention, DEVICE, seed=0).generate([SYSTEM + q for q in QUESTIONS], 8)
    engine = make_reference_engine(attention, DEVICE, seed=0, page_size=16)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(canary)

    first = engine.generate([SYSTEM + QUESTIONS[0]], 8)
    written = canary.stats().protected_tokens
    rest = engine.generate([SYSTEM + q for q in QUESTIONS[1:]], 8)
    assert first + rest == per_token
    # Each later prompt reused the system prompt's whole pages instead of computing them again.
    assert canary.stats().protected_tokens - written < 3 * len(SYSTEM)
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []
