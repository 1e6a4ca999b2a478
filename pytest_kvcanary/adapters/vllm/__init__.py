"""vLLM (its CPU build) behind the canary seam, through vLLM's KV-connector interface.

`make_vllm_engine` is what ``--kv-canary-engine vllm`` builds. Modules: engine.py (the
EngineUnderTest over an in-process ``LLM``), connector.py (the KV connector vLLM loads),
forward_inputs.py (what vLLM's model runner hands a forward, which the canary's view is made of),
blocks.py (the scheduler-side account of what each block holds), layout.py (where a slot's bytes
lie in vLLM's CPU cache), isa.py (which CPU attention path, and so which layout, vLLM runs),
write_through.py (what each layer's cache write was handed, for TAIL), checkpoint.py (the default
seeded random model), versions.py (what differs between the vLLM releases it supports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import VllmEngine


def make_vllm_engine(attention: str, device: str, seed: int, model: str | None) -> VllmEngine:
    """An in-process vLLM LLM on `model` (a local Hugging Face checkpoint directory, which decides
    the attention kinds) or, by default, on a seeded random model of this attention kind ("mha";
    "swa": sliding-window layers alternating with full ones; "mla", latent attention, from vLLM
    0.28 on). vLLM's CPU build runs on the CPU only."""
    if device != "cpu":
        raise ValueError(f"the vLLM adapter drives vLLM's CPU build: device must be cpu; got {device!r}")
    from ...canary.seam import UnsupportedAttention
    from .checkpoint import random_checkpoint
    from .engine import VllmEngine
    from .versions import no_latent_attention

    if model is None and attention == "mla" and (reason := no_latent_attention()):
        raise UnsupportedAttention(f"engine 'vllm' has no attention kind 'mla' here: {reason}")
    return VllmEngine(model if model is not None else random_checkpoint(attention, seed), seed)
