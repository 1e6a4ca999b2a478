"""The embedded default: the reference engine, sized for tests."""

from __future__ import annotations

from ..engine.config import EngineConfig, ModelConfig
from ..engine.engine import Engine
from ..engine.weights import read_config


def reference_config(attention: str, device: str, seed: int, model: str | None = None, *,
                     speculative_k: int = 0) -> EngineConfig:
    """A small Llama-style model on random weights: mha, swa with a window short enough that test
    prompts slide past it, or mla (latent KV pools). model: a local checkpoint directory whose
    weights replace the random ones (mha and swa). speculative_k > 0: speculative decoding with
    that many draft tokens per step (mha and mla)."""
    shape = dict(attention=attention, window=16, full_every=2)
    config = (ModelConfig(seed=seed, max_context=256, **shape) if model is None
              else read_config(model, **shape))
    return EngineConfig(model=config, num_slots=1024, swa_num_slots=512, max_running=8,
                        max_batch_tokens=max(512, config.max_context), device=device, checkpoint=model,
                        speculative_k=speculative_k)


def make_reference_engine(attention: str, device: str, seed: int, model: str | None = None, *,
                          speculative_k: int = 0) -> Engine:
    """The engine of `reference_config`."""
    return Engine(reference_config(attention, device, seed, model, speculative_k=speculative_k))
