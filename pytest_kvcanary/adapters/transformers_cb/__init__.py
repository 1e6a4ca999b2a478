"""Hugging Face transformers continuous batching as an engine under test (``--kv-canary-engine
transformers``). Needs the transformers package: in a clone of the project,
``pip install -e ".[transformers]"``.

    versions.py       what differs between the supported transformers releases (cache layout, config)
    block_log.py      what the prefix cache does not keep about its blocks; the sweep's cache walk
    model.py          a local checkpoint, or the seeded random one written on first use
    batch_buffers.py  what the host stages per forward (batch size, new tokens, changed table rows)
    forward_view.py   the canary's view derived on the device from the forward's own inputs
    engine.py         TransformersEngine: the CanaryHost seam around ContinuousBatchProcessor
"""

from __future__ import annotations

import os

from .engine import TransformersEngine
from .model import load, random_checkpoint

__all__ = ["ASYNC_BATCHING_VARIABLE", "CUDA_GRAPHS_VARIABLE", "TransformersEngine", "load", "make_transformers_engine",
           "random_checkpoint"]

CUDA_GRAPHS_VARIABLE = "KVCANARY_TRANSFORMERS_CUDA_GRAPHS"
ASYNC_BATCHING_VARIABLE = "KVCANARY_TRANSFORMERS_ASYNC_BATCHING"


def switched_on(variable: str) -> bool:
    """An on/off environment variable: 1 on, 0 or unset off."""
    value = os.environ.get(variable, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{variable} must be one of 0, 1; got {value!r}")
    return value == "1"


def make_transformers_engine(attention: str, device: str, seed: int, model: str | None) -> TransformersEngine:
    """The engine `--kv-canary-engine transformers` runs: the checkpoint directory `model`, else a
    small seeded random Llama (attention "mha") or Qwen2 alternating sliding-window and full
    layers (attention "swa"). With KVCANARY_TRANSFORMERS_CUDA_GRAPHS=1 (CUDA only) transformers
    captures its forward in CUDA graphs; with KVCANARY_TRANSFORMERS_ASYNC_BATCHING=1 (CUDA only)
    it batches asynchronously."""
    graphs, batching = switched_on(CUDA_GRAPHS_VARIABLE), switched_on(ASYNC_BATCHING_VARIABLE)
    path = model if model is not None else random_checkpoint(attention, seed)
    hf_model, tokenizer = load(path, device)
    return TransformersEngine(hf_model, tokenizer, use_cuda_graph=graphs, use_async_batching=batching)
