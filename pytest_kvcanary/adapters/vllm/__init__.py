"""vLLM (its CPU and CUDA builds) behind the canary seam, through vLLM's KV-connector interface.

`make_vllm_engine` is what ``--kv-canary-engine vllm`` builds; its pytest plugin, which registers
the adapter's option and builds it, is ../vllm_hooks.py. Modules: engine.py (the EngineUnderTest
over an in-process ``LLM``), connector.py (the KV connector vLLM loads), forward_inputs.py (what
vLLM's model runner hands a forward, which the canary's view is made of), blocks.py (the
scheduler-side account of what each block holds), pools.py (the canary's pool groups over vLLM's
KV caches), window_map.py (the sliding-window group's full-to-window slot map), states.py (a hybrid
model's recurrent state, the STATE group over vLLM's mamba blocks), layout.py (where a
slot's bytes lie in vLLM's CPU cache), isa.py (which CPU attention path, and so which layout, vLLM
runs), fp8.py and fp8_cache.py (an FP8 KV cache: the setting, the default model's scales, the
bytes vLLM stores), kv_scales.py (the SCALES group over an FP8 cache's scales), platform.py (CPU
build vs CUDA build: device, backends, CUDA graphs), write_through.py (what each layer's cache
write was handed, for TAIL), checkpoint.py (the default seeded random model), versions.py (what
differs between the vLLM releases it supports).

Besides the connector vLLM loads, the adapter hooks vLLM's objects in five places: a forward
pre-hook on its model, each attention layer impl's ``do_kv_cache_update`` (write-through), under
the hybrid KV cache manager the sliding-window managers' ``remove_skipped_blocks``, for a hybrid
model ``vllm.v1.worker.mamba_utils.collect_mamba_copy_meta`` (its state copies), and with an FP8
cache each attention layer's ``_k_scale`` / ``_v_scale`` (made rows of the SCALES group). Each is
recorded in the engine's Patches (../patches.py, shared with the transformers adapter), and
``VllmEngine.close()`` undoes them all and drops the engine from the connector's registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import VllmEngine


def make_vllm_engine(attention: str, device: str, seed: int, model: str | None, **settings: Any) -> VllmEngine:
    """An in-process vLLM LLM on `model` (a local Hugging Face checkpoint directory, which decides
    the attention kinds) or, by default, on a seeded random model of this attention kind ("mha";
    "swa": sliding-window layers alternating with full ones; "mla", latent attention, from vLLM
    0.28 on, CPU build only; "hybrid": gated delta net layers alternating with full attention, CPU
    build only). device: cpu (vLLM's CPU build) or cuda / cuda:0 (its CUDA build;
    KVCANARY_VLLM_CUDA_GRAPHS=1 runs it in PIECEWISE CUDA graphs, platform.py). settings: other
    `VllmSettings` fields (the run's --kv-canary-vllm-attention-isa and
    --kv-canary-vllm-kv-cache-dtype, vllm_hooks.py), the rest at their defaults. With an FP8 KV
    cache the default model is "mha" or "swa", with calibrated K/V scales for fp8 and fp8_e4m3
    (fp8_cache.py; fp8_e5m2 runs with scales of 1.0); another kind, or a CPU without AVX-512 or
    AMX, raises UnsupportedAttention (a test skips, saying why)."""
    from ...canary.seam import UnsupportedAttention
    from .checkpoint import random_checkpoint
    from .engine import VllmEngine, VllmSettings
    from .fp8 import ATTENTION_KINDS as FP8_ATTENTION_KINDS, no_fp8, quantized
    from .fp8_cache import scaled_checkpoint
    from .platform import check_device
    from .versions import no_hybrid, no_latent_attention

    where = check_device(device)
    if model is None and attention == "hybrid":
        reason = no_hybrid() if where == "cpu" else "a hybrid model has been run on vLLM's CPU build only"
        if reason:
            raise UnsupportedAttention(f"engine 'vllm' has no attention kind 'hybrid' here: {reason} "
                                       "(docs/vllm.md#hybrid-models)")
    if model is None and attention == "sparse":
        raise UnsupportedAttention("engine 'vllm' has no attention kind 'sparse': its default models have no indexer")
    if model is None and attention == "mla":
        reason = no_latent_attention() if where == "cpu" else "the adapter knows no CUDA MLA backend's cache yet"
        if reason:
            raise UnsupportedAttention(f"engine 'vllm' has no attention kind 'mla' here: {reason}")
    s = VllmSettings(device=where, **settings)
    checkpoint = model if model is not None else random_checkpoint(attention, seed)
    if quantized(s.kv_cache_dtype):
        if reason := no_fp8(where):
            raise UnsupportedAttention(f"engine 'vllm' runs no {s.kv_cache_dtype} KV cache here: {reason}")
        if model is None and attention not in FP8_ATTENTION_KINDS:
            raise UnsupportedAttention(f"engine 'vllm' has no attention kind {attention!r} with a {s.kv_cache_dtype} "
                                       f"KV cache: its default model is run with one for "
                                       f"{', '.join(FP8_ATTENTION_KINDS)} only (docs/vllm.md#fp8-kv-cache)")
        if model is None and s.kv_cache_dtype != "fp8_e5m2":  # vLLM refuses a checkpoint's scales with e5m2
            checkpoint = scaled_checkpoint(checkpoint, f"kvcanary-vllm-{attention}", seed)
    return VllmEngine(checkpoint, seed, s)
