"""Decode on padded fixed-size batches (what a CUDA graph replays) computes what eager decode does."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.reference_engine import EngineConfig


@pytest.mark.parametrize("attention", ["mha", "swa", "mla", "hybrid"])
def test_padded_decode_equals_eager_decode_and_the_no_cache_reference(attention, make_engine, random_prompts,
                                                                      assert_reference, check_invariants):
    prompts = random_prompts(7, 5)  # 7 requests: decode batches of 7 run padded to 8, fewer to 4 / 2 / 1
    eager = make_engine(attention).generate(prompts, 9)
    engine = make_engine(attention, decode_mode="padded")
    buffers = engine.pools.full.k_layers + engine.pools.full.v_layers + (engine.states.buffers if engine.states else [])
    reserved = [t[0].clone() for t in buffers]
    assert engine.generate(prompts, 9) == eager
    assert_reference(engine, prompts, eager)
    check_invariants(engine)
    after = [t[0] for t in buffers]
    assert all(torch.equal(a, b) for a, b in zip(reserved, after)), "padding rows wrote the reserved slot"


def test_graph_decode_needs_cuda():
    with pytest.raises(ValueError, match="decode_mode='graph' needs a CUDA device; got device='cpu'"):
        EngineConfig(decode_mode="graph", device="cpu")
    with pytest.raises(ValueError, match="decode_mode must be one of eager, padded, graph; got 'fast'"):
        EngineConfig(decode_mode="fast")
