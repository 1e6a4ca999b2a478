"""A second worked adapter (docs/adapters.md): an engine the project does not know, written as an
author would, over a transformers `StaticCache`. A tiny Llama (random weights, seeded, saved and
loaded from a temporary directory: nothing downloads), greedy, one request at a time, no prefix
cache. Run the conformance suite on it from this directory:

    pytest -p static_cache_engine --kv-canary --kv-canary-engine=static \
        --pyargs kvcanary_examples pytest_kvcanary.soak.suite

What it shows:
- A head-major cache (``[batch, heads, positions, head_dim]``, every transformers cache) handed
  as it is: one buffer per (layer, KV head), views, no copy.
- No spare slot: a StaticCache's position 0 holds a token. The adapter gives each layer's cache a
  backing store one position longer and hands the cache a view past position 0, so the canary's
  slot 0 is a spare no token is stored in; slot s holds position s - 1.
- Capabilities: no prefix cache and no cache walk (those examples skip, naming it), one request
  per forward; a token table in the view and feed_token (one line), so next_token_swap runs.
"""

from __future__ import annotations

import tempfile
from typing import Sequence

import torch

from pytest_kvcanary.adapters import EngineSpec
from pytest_kvcanary.canary.seam import (Capabilities, Capacities, ForwardHooks, ForwardView, GroupKind, PoolGroup,
                                         SlotMapping, UnsupportedAttention)


def tiny_llama(seed: int, device: str):
    """A two-layer Llama over byte tokens with seeded random weights, through save_pretrained and
    from_pretrained as a real checkpoint would come."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with tempfile.TemporaryDirectory() as path:
        LlamaForCausalLM(config).save_pretrained(path)
        model = LlamaForCausalLM.from_pretrained(path)
    return model.to(device).eval()


class StaticCacheEngine:
    def __init__(self, device: str = "cpu", seed: int = 0, max_context: int = 160) -> None:
        from transformers import StaticCache

        self.model = tiny_llama(seed, device)
        config = self.model.config
        heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        self.cache = StaticCache(config=config, max_cache_len=max_context)
        # Each layer's K/V live in a store one position longer; the cache writes past position 0.
        shape = (1, heads, max_context + 1, dim)
        self.k_store = [torch.zeros(shape, device=device) for _ in self.cache.layers]
        self.v_store = [torch.zeros(shape, device=device) for _ in self.cache.layers]
        for layer, k, v in zip(self.cache.layers, self.k_store, self.v_store):
            layer.lazy_initialization(k[:, :, 1:], v[:, :, 1:])
            layer.keys, layer.values = k[:, :, 1:], v[:, :, 1:]
        # Position p of the one request is slot p + 1: a per-token table, filled once.
        self.table = torch.arange(1, max_context + 1, device=device).unsqueeze(0)
        # The token each position holds, as the engine believes (-1: none): the canary's token checks.
        self.tokens = torch.full((1, max_context), -1, device=device)
        self.max_context = max_context
        self.hooks: ForwardHooks | None = None
        self.finished = 0

    # The GuardedEngine seam ------------------------------------------------------------------------
    def canary_groups(self) -> list[PoolGroup]:
        # One buffer per (layer, KV head): store[0, h] is [positions, head_dim], one slot per row.
        k = [store[0, h] for store in self.k_store for h in range(store.shape[1])]
        v = [store[0, h] for store in self.v_store for h in range(store.shape[1])]
        return [PoolGroup(GroupKind.FULL, k, v, self.max_context + 1, SlotMapping(self.table))]

    def canary_capacities(self) -> Capacities:
        return Capacities(max_batch=1, max_tokens=self.max_context, max_context=self.max_context)

    def cache_walk(self) -> None:
        return None  # no prefix cache

    def capabilities(self) -> Capabilities:
        return Capabilities(prefix_cache=False, cache_walk=False, concurrent=False, feed_token=True)

    def feed_token(self, view: ForwardView, index: int, token: int) -> None:
        view.input_ids[index] = token  # the forward embeds view.input_ids itself

    # What the fixtures drive -----------------------------------------------------------------------
    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self.hooks = hooks

    def reset(self) -> None:
        self.cache.reset()
        self.finished = 0

    def finished_requests(self) -> int:
        return self.finished

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        outputs = []
        for prompt in prompts:
            tokens = list(prompt.encode() if isinstance(prompt, str) else prompt)
            if len(tokens) + max_new_tokens > self.max_context:
                raise ValueError(f"a request of {len(tokens)} + {max_new_tokens} tokens exceeds max_context="
                                 f"{self.max_context}")
            self.cache.reset()  # one request at a time, from position 0
            self.tokens.fill_(-1)
            new, prefix = tokens, 0
            for _ in range(max_new_tokens):
                token = self._forward(prefix, new)
                prefix += len(new)
                new = [token]
                tokens.append(token)
            outputs.append(tokens[-max_new_tokens:] if max_new_tokens else [])
            self.finished += 1
        return outputs

    @torch.no_grad()
    def _forward(self, prefix: int, new: list[int]) -> int:
        n, pad, dev = len(new), self.max_context - len(new), self.table.device
        self.tokens[0, prefix:prefix + n] = torch.tensor(new, device=dev)
        view = ForwardView(token_table=self.tokens, rows=torch.tensor([0], device=dev), prefix_lens=torch.tensor([prefix], device=dev),
                           extend_lens=torch.tensor([n], device=dev),
                           input_ids=torch.tensor(new + [0] * pad, device=dev),
                           positions=torch.tensor(list(range(prefix, prefix + n)) + [0] * pad, device=dev))
        if self.hooks:
            self.hooks.before_forward(view)  # HEAD: verify what this forward reads
        ids, positions = view.input_ids[:n].unsqueeze(0), view.positions[:n]
        logits = self.model(input_ids=ids, position_ids=positions.unsqueeze(0), cache_position=positions,
                            past_key_values=self.cache, use_cache=True).logits
        if self.hooks:
            self.hooks.after_forward(view)  # TAIL: stamp what it wrote, recheck what it read
            self.hooks.end_forward()
        return int(logits[0, -1].argmax())


def pytest_kvcanary_make_engine(spec: EngineSpec) -> StaticCacheEngine | None:
    if spec.name != "static":
        return None
    if spec.attention != "mha":
        raise UnsupportedAttention(f"the static-cache engine has no {spec.attention} attention")
    return StaticCacheEngine(spec.device, spec.seed)
