"""The canary does not change what transformers computes: greedy outputs of continuous batching
with the canary attached equal transformers' own `generate`, request by request, and the canary
reports nothing."""

from __future__ import annotations

import pytest
import torch

from .support import DEVICE, GRAPH_MODES, INSTALL, make_handle

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb import load, random_checkpoint  # noqa: E402

STEM = "Once upon a time, in a cache far away, "
PROMPTS = [STEM + tail for tail in ("a dog", "a cat", "a log", "a dog")] + [f"{i} {STEM}" for i in range(5)] + [
    "short", STEM * 3]
MAX_NEW_TOKENS = 12


@torch.no_grad()
def own_generate(attention: str, prompts: list[str]) -> list[list[int]]:
    """transformers' generate, one prompt at a time, on a separately loaded copy of the model."""
    model, tokenizer = load(random_checkpoint(attention, 0), DEVICE)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


@pytest.mark.parametrize("use_cuda_graph", GRAPH_MODES)
@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_greedy_outputs_equal_transformers_generate(attention, use_cuda_graph):
    # 64-token forwards: long prompts prefill in chunks beside other requests' decodes.
    handle = make_handle(attention, max_batch_tokens=64, use_cuda_graph=use_cuda_graph)
    outputs = handle.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    assert outputs == own_generate(attention, PROMPTS)
    handle.side.runtime.drain()
    assert handle.violations() == []
    stats = handle.stats()["single"]
    assert stats["forwards"] > 10 and stats["protected_tokens"] > 0 and stats["health"] == "ok"
