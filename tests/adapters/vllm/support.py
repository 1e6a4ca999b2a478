"""What the vLLM adapter tests share: engines over the seeded random checkpoints, the canary
handle around them, prompt workloads with shared prefixes, and the K/V a cacheless transformers
forward computes (the reference the paged cache must hold). Nothing here imports vLLM at module
load: each test module skips first when it is missing."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.handles.factories import install_hint

INSTALL = f"vLLM is not installed: {install_hint('vllm')}"
KERNELS = "torch"  # the reference kernels: bit-identical to the Triton ones, fast on a CPU


def unsupported(attention: str) -> str | None:
    """Why the installed vLLM runs no `attention` (versions.py), or None. Call once vLLM imports."""
    from pytest_kvcanary.adapters.vllm.versions import no_latent_attention

    return no_latent_attention() if attention == "mla" else None


def attention_param(attention: str, *values: Any) -> Any:
    """A test parameter (the attention kind, then `values`), skipped where the installed vLLM runs
    no such attention. Call once vLLM imports."""
    reason = unsupported(attention)
    return pytest.param(attention, *values, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


def make_engine(attention: str = "mha", **settings: Any) -> Any:
    """A fresh adapter over the random checkpoint of this attention kind (seed 0)."""
    from pytest_kvcanary.adapters.vllm.checkpoint import random_checkpoint
    from pytest_kvcanary.adapters.vllm.engine import VllmEngine, VllmSettings

    return VllmEngine(random_checkpoint(attention, 0), 0, VllmSettings(**settings))


def make_handle(engine: Any, perturbs: tuple[PerturbSpec, ...] = (), seed: int = 0, **canary: Any) -> Any:
    """The canary attached to `engine` (all real-KV bytes it can read fingerprinted, a sweep every
    2 forwards unless overridden), reset for `seed` with these faults armed."""
    from pytest_kvcanary.handles.single import EngineHandle

    config = CanaryConfig(**{"real_data": "all", "sweep_interval": 2, "kernels": KERNELS, **canary})
    handle = EngineHandle(engine, config)
    handle.reset(seed, perturbs)
    return handle


def stems(rng: random.Random, count: int = 4, vocab: int = 256) -> list[list[int]]:
    """Prompt stems of 32-80 tokens: at least one full block of 32 to share."""
    return [[rng.randrange(vocab) for _ in range(rng.randrange(32, 81))] for _ in range(count)]


def prompts_with_shared_prefixes(rng: random.Random, n: int, stems: list[list[int]], vocab: int = 256
                                 ) -> list[list[int]]:
    """n prompts, each a stem and a random tail of 1-40 tokens; about one in four repeats the
    previous prompt exactly (one batch then computes and hits the same blocks)."""
    prompts: list[list[int]] = []
    for _ in range(n):
        if prompts and rng.random() < 0.25:
            prompts.append(list(prompts[-1]))
        else:
            prompts.append(rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 41))])
    return prompts


def count_same_step_hits(book) -> list[int]:
    """Wrap the book's plan to count rows that hit blocks their own step computes (their
    verified prefix stops before vLLM's computed tokens)."""
    counted = [0]
    plan = book.plan

    def counting(step):
        rows = plan(step)
        computed = [r.num_computed_tokens for r in step.scheduled_new_reqs]
        computed += step.scheduled_cached_reqs.num_computed_tokens
        counted[0] += sum(row.first < c for row, c in zip(rows, computed))
        return rows

    book.plan = counting
    return counted


class PrefixCacheCounter:
    """vLLM's own prefix-cache counters (the PrefixCacheStats its KV cache manager hands its stat
    loggers and restarts every step), summed from installation on: queries and hits, in tokens.
    (vLLM's Prometheus registry keeps only the newest engine of a process, so it is not read.)"""

    def __init__(self, engine: Any, monkeypatch: Any) -> None:
        self.queries = self.hits = 0
        manager = engine.book.manager
        take = manager.make_prefix_cache_stats

        def counting() -> Any:
            stats = take()
            if stats is not None:
                self.queries += stats.queries
                self.hits += stats.hits
            return stats

        monkeypatch.setattr(manager, "make_prefix_cache_stats", counting)


@torch.no_grad()
def reference_kv(model: Any, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (K, V) ``[kv_heads, len(tokens), head_size]`` of a cacheless transformers forward."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


class ViewRecorder:
    """Installed between an engine and the forward hooks its canary set: keeps, per forward, the
    slots the mapping gives the positions its view writes (view order), read before the forward."""

    def __init__(self, engine: Any) -> None:
        self.hooks, self.written = engine._hooks, []
        self.group = engine.canary_groups()[0]
        engine.set_forward_hooks(self)

    def before_forward(self, view: Any) -> None:
        bs, table = self.group.page_size, self.group.mapping.table
        self.written.append([int(table[row, p // bs]) * bs + p % bs for row, prefix, extend in
                             zip(view.rows.tolist(), view.prefix_lens.tolist(), view.extend_lens.tolist())
                             for p in range(prefix, prefix + extend)])
        self.hooks.before_forward(view)

    def kv_stored(self, *args: Any) -> None:
        self.hooks.kv_stored(*args)

    def after_forward(self, view: Any) -> None:
        self.hooks.after_forward(view)

    def end_forward(self) -> None:
        self.hooks.end_forward()
