"""What differs between vLLM's CPU build and its CUDA build, answered in one place (versions.py
answers what differs between releases).

- Device: the CPU build runs on ``cpu``; the CUDA build on the process's first visible GPU (vLLM's
  worker takes ``cuda:0``: another index is refused, naming CUDA_VISIBLE_DEVICES).
- Attention backends and their caches: ``CPU_ATTN`` and ``CPU_MLA`` (CPU build, layout.py's CPU
  probes); ``FLASH_ATTN`` and ``FLASHINFER`` (CUDA build: layout.py's `probe_paged`); any other
  backend is refused at start-up, naming it.
- CUDA graphs (CUDA build only): off by default (``enforce_eager``); with
  ``KVCANARY_VLLM_CUDA_GRAPHS=1`` vLLM compiles its model and runs it in PIECEWISE CUDA graphs,
  split at the attention ops and at the KV-cache write, so that attention, the cache write (and
  write-through) and the model's Python call (the canary's pre-hook) run eagerly at every step.
  vLLM's own default (FULL_AND_PIECEWISE) replays full decode graphs without calling the model's
  Python forward: the canary could not see those forwards, so a FULL mode is refused.
- Model runner: the adapter reads the V1 model runner's persistent batch (``input_batch``); vLLM
  0.26's CUDA build picks its V2 runner (``vllm.v1.worker.gpu``) for a dense model unless
  ``VLLM_USE_V2_MODEL_RUNNER=0``, which the adapter sets on CUDA (the CPU build runs V1).
- Memory: a KV budget (``kv_cache_memory_bytes``) keeps the CPU worker from reserving a share of
  the machine's memory; on a GPU a low ``gpu_memory_utilization`` lets several engines share one
  process (vLLM only checks that much memory is free at start-up).

Nothing here imports vLLM or torch at module load.
"""

from __future__ import annotations

import os
from typing import Any

CUDA_GRAPHS_ENV = "KVCANARY_VLLM_CUDA_GRAPHS"
ATTENTION_BACKEND_ENV = "KVCANARY_VLLM_ATTENTION_BACKEND"
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA")
CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
# The custom ops vLLM must split its compiled graph at for the canary to run every step.
EAGER_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")
KV_CACHE_BYTES = 1 << 26


def default_cuda_graphs() -> bool:
    """The CUDA-graphs setting's default: KVCANARY_VLLM_CUDA_GRAPHS (1 on, 0 or unset off)."""
    value = os.environ.get(CUDA_GRAPHS_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{CUDA_GRAPHS_ENV} must be one of 0, 1; got {value!r}")
    return value == "1"


def default_attention_backend() -> str | None:
    """vLLM's attention backend to ask for on CUDA: KVCANARY_VLLM_ATTENTION_BACKEND, else None
    (vLLM's choice)."""
    value = os.environ.get(ATTENTION_BACKEND_ENV) or None
    if value is not None and value not in CUDA_BACKENDS:
        raise ValueError(f"{ATTENTION_BACKEND_ENV} must be one of {', '.join(CUDA_BACKENDS)}; got {value!r}")
    return value


def check_device(device: str) -> str:
    """`device` as the adapter runs vLLM on it: ``cpu`` or ``cuda``; raises ValueError otherwise."""
    if device == "cpu":
        return "cpu"
    if device in ("cuda", "cuda:0"):
        return "cuda"
    if device.startswith("cuda:"):
        raise ValueError(f"vLLM's worker runs on the first visible GPU (cuda:0); got {device!r}: make that GPU "
                         "the first one (CUDA_VISIBLE_DEVICES) or run one test process per GPU")
    raise ValueError(f"the vLLM adapter runs on cpu (vLLM's CPU build) or cuda (its CUDA build); got {device!r}")


def engine_arguments(device: str, cuda_graphs: bool, attention_backend: str | None) -> dict[str, Any]:
    """vLLM ``LLM(...)`` keyword arguments that depend on the platform: eager or PIECEWISE graphs,
    the KV memory budget, the attention backend asked for."""
    if device == "cpu":
        if cuda_graphs:
            raise ValueError(f"CUDA graphs ({CUDA_GRAPHS_ENV}=1) need vLLM's CUDA build on a GPU; the device is cpu")
        return dict(enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES)
    out: dict[str, Any] = dict(kv_cache_memory_bytes=KV_CACHE_BYTES, gpu_memory_utilization=0.2)
    if cuda_graphs:
        out.update(enforce_eager=False, compilation_config={"cudagraph_mode": "PIECEWISE"})
    else:
        out.update(enforce_eager=True)
    if attention_backend is not None:
        out["attention_backend"] = attention_backend
    return out


def engine_environment(device: str) -> dict[str, str]:
    """Environment variables vLLM must see before the LLM is built on this device."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if device == "cuda" else {}


def check_model_runner(runner: Any) -> None:
    """Raise RuntimeError unless `runner` keeps the V1 persistent batch the adapter reads."""
    if not hasattr(runner, "input_batch"):
        raise RuntimeError(f"vLLM runs {type(runner).__module__}.{type(runner).__name__}, which keeps no persistent "
                           "batch (input_batch) for the canary to read: the adapter needs the V1 model runner "
                           "(VLLM_USE_V2_MODEL_RUNNER=0, which it sets on CUDA)")


def graph_mode(vllm_config: Any) -> str:
    """The CUDA-graph mode vLLM settled on (NONE, PIECEWISE, FULL, ...)."""
    mode = vllm_config.compilation_config.cudagraph_mode
    return "NONE" if mode is None else mode.name


def check_graph_mode(vllm_config: Any, model: Any) -> str:
    """Raise RuntimeError unless every forward calls `model` (the runner's model) in Python with
    attention and the KV-cache write run eagerly; returns the mode, for reports."""
    import torch

    mode = vllm_config.compilation_config.cudagraph_mode
    name = graph_mode(vllm_config)
    if mode is not None and mode.has_full_cudagraphs():
        raise RuntimeError(f"vLLM runs FULL CUDA graphs here (cudagraph_mode {name}): a replayed decode graph skips "
                           "the model's Python call, so the canary's pre-hook and write-through would miss those "
                           f"forwards. Run eagerly ({CUDA_GRAPHS_ENV}=0) or with PIECEWISE graphs "
                           f"({CUDA_GRAPHS_ENV}=1), which the adapter asks for")
    if not isinstance(model, torch.nn.Module) or type(model).__name__.endswith("Wrapper"):
        raise RuntimeError(f"vLLM's model runner calls a {type(model).__name__}, not the model: the canary's forward "
                           "pre-hook would not run at every step (VLLM_USE_BREAKABLE_CUDAGRAPH or micro-batching?)")
    if mode is not None and mode.has_piecewise_cudagraphs():
        splits = vllm_config.compilation_config.splitting_ops or []
        missing = [op for op in EAGER_OPS if op not in splits]
        if missing:
            raise RuntimeError(f"vLLM's PIECEWISE graphs do not split at {', '.join(missing)} (splitting_ops "
                               f"{splits}): the KV-cache write would replay inside a graph, unseen by write-through")
    return name
