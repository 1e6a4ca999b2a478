"""vLLM's FP8 KV cache (``kv_cache_dtype`` fp8, fp8_e4m3 or fp8_e5m2) on its CPU build: the setting.
Nothing here imports torch at module load (the adapter's pytest plugin imports it); the default
model's scales and reading the quantized cache are fp8_cache.py's.

- The setting: ``VllmSettings.kv_cache_dtype`` (default the environment variable
  KVCANARY_VLLM_KV_CACHE_DTYPE, else ``auto``: the model's dtype); under pytest the run's
  --kv-canary-vllm-kv-cache-dtype (vllm_hooks.py). vLLM's CPU attention stores FP8 only on x86
  with AVX-512 or AMX and for head sizes divisible by 32 (`no_fp8` says why not here).
- The model (fp8_cache.py): vLLM takes static per-tensor K and V scales from a checkpoint whose
  quantization config declares a KV-cache scheme (what llm-compressor writes: compressed-tensors,
  ``kv_cache_scheme`` 8-bit float, per tensor), as ``self_attn.k_scale`` / ``v_scale`` weights;
  without them every scale is 1.0. The default model is the random checkpoint with such a config
  and scales calibrated as llm-compressor does (each layer's K and V amax over seeded calibration
  tokens, over e4m3's largest value), so the layers' scales differ.
- The cache (fp8_cache.py): one byte a value (``uint8``), K dimension-major and V token by token
  inside a block, as on the ``vec`` path in the model's dtype, both fingerprinted (K byte by byte);
  the bytes a write stores are taken from vLLM's own cache write.
"""

from __future__ import annotations

import os

ENV = "KVCANARY_VLLM_KV_CACHE_DTYPE"
CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT = "auto"
ATTENTION_KINDS = ("mha", "swa")  # the default models run with an FP8 cache


def default_kv_cache_dtype() -> str:
    """The setting's default: the environment variable (unchecked), else ``auto``."""
    return os.environ.get(ENV, DEFAULT)


def check_kv_cache_dtype(value: str) -> None:
    if value not in CHOICES:
        raise ValueError(f"kv_cache_dtype (VllmSettings.kv_cache_dtype, or {ENV}) must be one of "
                         f"{', '.join(CHOICES)}; got {value!r}")


def quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"


def no_fp8(device: str) -> str | None:
    """Why vLLM runs no FP8 KV cache under the adapter here, or None."""
    import torch

    if device != "cpu":
        return "an FP8 KV cache has been run on vLLM's CPU build only"
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        return "vLLM's CPU attention stores an FP8 KV cache on x86 with AVX-512 or AMX only; this CPU has neither"
    return None
