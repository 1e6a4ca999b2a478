"""The embedded default: the reference engine, sized for tests."""

from __future__ import annotations

from ..engine.config import EngineConfig, ModelConfig
from ..engine.engine import Engine


def make_reference_engine(attention: str, device: str, seed: int) -> Engine:
    """A small Llama-style model on random weights: mha, or swa with a window short enough that
    test prompts slide past it."""
    model = ModelConfig(attention=attention, window=16, full_every=2, seed=seed, max_context=256)
    return Engine(EngineConfig(model=model, num_slots=1024, swa_num_slots=512, max_running=8, device=device))
