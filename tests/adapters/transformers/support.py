"""What the transformers adapter tests share: engines over the seeded random checkpoints, the
canary handle around them, a prompt workload with shared prefixes, and the K/V a cacheless
forward of transformers computes (the reference the paged cache must hold)."""

from __future__ import annotations

import random
from typing import Any

import torch

from pytest_kvcanary.adapters.transformers_cb import TransformersEngine, load, random_checkpoint
from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.handles.factories import install_hint
from pytest_kvcanary.handles.single import EngineHandle

INSTALL = f"transformers is not installed: {install_hint('transformers')}"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Seed sweeps run the torch reference kernels on a CPU (bit-identical to the Triton ones).
KERNELS = "triton" if DEVICE == "cuda" else "torch"
# CUDA graphs on and off where CUDA is present; eager only on a CPU.
GRAPH_MODES = [False, True] if DEVICE == "cuda" else [False]


def make_engine(attention: str, **options: Any) -> TransformersEngine:
    """A fresh engine over the random checkpoint of this attention kind (seed 0)."""
    model, tokenizer = load(random_checkpoint(attention, 0), DEVICE)
    return TransformersEngine(model, tokenizer, **options)


def make_handle(attention: str, perturbs: tuple[PerturbSpec, ...] = (), seed: int = 0, **options: Any
                ) -> EngineHandle:
    """An engine with the canary attached (all KV bytes fingerprinted, a sweep every 2 forwards),
    reset for `seed` with these faults armed."""
    canary = CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS)
    handle = EngineHandle(make_engine(attention, **options), canary)
    handle.reset(seed, perturbs)
    return handle


def prompts_with_shared_prefixes(rng: random.Random, n: int, stems: list[list[int]], vocab: int = 256,
                                 page_size: int = 16) -> list[list[int]]:
    """n prompts, each a stem followed by a random tail of 1-24 tokens; about one in four repeats
    the previous prompt exactly (so one batch computes the same blocks twice). No prompt fills
    whole pages exactly: transformers 5.17 then recomputes its last token into a shared block when
    the whole prompt is cached (test_faults.py shows the canary catching that)."""
    prompts: list[list[int]] = []
    while len(prompts) < n:
        if prompts and rng.random() < 0.25:
            prompts.append(list(prompts[-1]))
            continue
        prompt = rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        if len(prompt) % page_size:
            prompts.append(prompt)
    return prompts


def stems(rng: random.Random, count: int = 4, vocab: int = 256) -> list[list[int]]:
    """Prompt stems of 16-40 tokens: at least one full block of 16 to share."""
    return [[rng.randrange(vocab) for _ in range(rng.randrange(16, 41))] for _ in range(count)]


@torch.no_grad()
def reference_kv(model: Any, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per model layer, (K, V) ``[len(tokens), H, D]`` of a cacheless forward over `tokens`."""
    from transformers import DynamicCache

    # Continuous batching may leave the model on its paged attention (transformers 5.17 does); a
    # cacheless forward needs the plain implementation behind it.
    paged = model.config._attn_implementation
    if paged.startswith("paged|"):
        model.set_attn_implementation(paged.removeprefix("paged|"))
    cache = DynamicCache()
    try:
        model(input_ids=torch.tensor([tokens], device=model.device), past_key_values=cache, use_cache=True)
    finally:
        if paged.startswith("paged|"):
            model.set_attn_implementation(paged)
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def python_tails(handle: EngineHandle) -> list[int]:
    """Record the engine step of every Python call of the runtime's after_forward from now on (a
    forward replayed from a CUDA graph runs the captured TAIL without one)."""
    engine, runtime = handle.engine, handle.side.runtime
    after_forward, steps = runtime.after_forward, []

    def recording(view: Any) -> None:
        steps.append(engine._forward.steps)
        after_forward(view)

    runtime.after_forward = recording
    return steps
