"""Hugging Face transformers continuous batching as an engine under test (``--kv-canary-engine
transformers``). Needs the transformers package: in a clone of the project,
``pip install -e ".[transformers]"``.

    versions.py       what differs between the supported transformers releases (cache layout, config)
                      and every private part of transformers the adapter reads or patches
    layout_sectors.py, layout_block_manager.py   the paged cache of 5.18+ and of 5.17
    cache_groups.py   what every layout hands the engine (GroupCache, free causes)
    ../patches.py     the attributes of transformers objects replaced, undone together (Patches,
                      shared with the vLLM adapter)
    block_log.py      what the prefix cache does not keep about its blocks; the sweep's cache walk
    model.py          a local checkpoint, or the seeded random one written on first use
    lanes.py          which lane (row of the canary's tables) each request holds
    batch_buffers.py  what the host stages per forward (batch size, new tokens, changed table rows)
    staging.py        filling those buffers from the batch transformers prepared
    defects.py        5.17's writes into hashed blocks, named as the engine's defects
    forward_view.py   the canary's view derived on the device from the forward's own inputs
    forward.py        GuardedForward: the canary's work around and inside each forward
    offload.py        transformers' CPU swap pool as a host tier
    engine.py         TransformersEngine: the GuardedEngine seam around ContinuousBatchProcessor
    parallel.py       TensorParallelShards: the engine of each rank of a tensor-parallel engine
"""

from __future__ import annotations

import os
from pathlib import Path

from .engine import TransformersEngine
from .model import load, random_checkpoint
from .parallel import TensorParallelShards

__all__ = ["ASYNC_BATCHING_VARIABLE", "CUDA_GRAPHS_VARIABLE", "TensorParallelShards", "TransformersEngine", "load",
           "make_transformers_engine", "random_checkpoint", "transformers_shards"]

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
    hf_model, tokenizer = load(_checkpoint(attention, seed, model), device)
    return TransformersEngine(hf_model, tokenizer, **_engine_options())


def transformers_shards(attention: str, seed: int, model: str | None) -> TensorParallelShards:
    """What `--kv-canary-engine transformers` runs on each rank of a tensor-parallel engine: the
    engine make_transformers_engine builds, its model loaded as the rank's shard. The random
    checkpoint is written here, in the launcher (a rank loads it; under an initialised process
    group transformers would save it on rank 0 only)."""
    return TensorParallelShards(str(_checkpoint(attention, seed, model)), tuple(_engine_options().items()))


def _checkpoint(attention: str, seed: int, model: str | None) -> str | Path:
    return model if model is not None else random_checkpoint(attention, seed)


def _engine_options() -> dict[str, bool]:
    """TransformersEngine's options the environment variables set."""
    return dict(use_cuda_graph=switched_on(CUDA_GRAPHS_VARIABLE),
                use_async_batching=switched_on(ASYNC_BATCHING_VARIABLE))
