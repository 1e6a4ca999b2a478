"""The model the adapter runs by default: a small seeded random model with a byte-level tokenizer,
written once per process and (attention, seed) into a temporary directory (nothing is downloaded).

Its shapes fit vLLM's CPU attention backends. attention "mha": a Llama with 2 full-attention
layers (head size 32); "swa": a Llama with 4 layers alternating sliding-window and full attention
(``layer_types``, which vLLM honours), with a window short enough that test prompts slide past
it; "mla": a DeepSeek-V2 with 2 dense layers of latent attention (vLLM's CPU MLA kernel needs a
latent row of 512 + 64); "hybrid": a Qwen3-Next with 4 layers alternating gated delta net
(recurrent) and full attention (vLLM's CPU GDN kernel needs key and value heads of 128; one
recurrent layer per attention layer keeps vLLM's recurrent layers in one KV cache group; 4 KV heads
of 128 make an attention page of 64 tokens as large as a recurrent state, so vLLM's blocks, and
its prefix cache's checkpoints, are 64 tokens; vLLM's Qwen3-Next has mixture-of-experts MLPs
only, and its dense GDN models need Triton (OLMo-hybrid) or torchvision (Qwen3.5), which vLLM's
CPU build runs without).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..random_checkpoint import write_random_checkpoint

ATTENTION_KINDS = ("mha", "swa", "mla", "hybrid")
SLIDING_WINDOW = 24  # tokens


def random_model_config(attention: str) -> Any:
    from transformers import DeepseekV2Config, LlamaConfig, Qwen3NextConfig

    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}; got {attention!r}")
    shape = dict(vocab_size=259, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 max_position_embeddings=1024, pad_token_id=256, bos_token_id=257, eos_token_id=258,
                 tie_word_embeddings=False)
    if attention == "mla":
        return DeepseekV2Config(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                                qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=2, **shape)
    if attention == "hybrid":
        return Qwen3NextConfig(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                               num_key_value_heads=4, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=1,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                               shared_expert_intermediate_size=64, **shape)
    if attention == "mha":
        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, **shape)
    return LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, head_dim=32,
                       layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=SLIDING_WINDOW, **shape)


def random_checkpoint(attention: str, seed: int) -> Path:
    """The directory of the seeded random checkpoint (bfloat16 weights, what vLLM's CPU build
    computes in, and tokenizer), written on first use."""
    import torch

    return write_random_checkpoint(random_model_config(attention), f"kvcanary-vllm-{attention}", seed,
                                   torch.bfloat16)
