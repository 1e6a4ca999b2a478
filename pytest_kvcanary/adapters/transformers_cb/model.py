"""The models the adapter runs: a local Hugging Face checkpoint, or a small seeded random one it
writes itself (nothing is downloaded).

The random checkpoints are a Llama (attention "mha") and a Qwen2 whose layers alternate sliding
window and full attention (attention "swa"), with a byte-level tokenizer (one token per UTF-8
byte, no merges). Each is written once per process and (attention, seed) into a temporary
directory and loaded from there like any checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...canary.seam import UnsupportedAttention
from ..random_checkpoint import write_random_checkpoint

ATTENTION_KINDS = ("mha", "swa")
SLIDING_WINDOW = 24  # tokens; test prompts slide past it


def random_model_config(attention: str) -> Any:
    """A tiny config: 2 Llama layers (mha), or 4 Qwen2 layers alternating sliding and full (swa)."""
    from transformers import LlamaConfig, Qwen2Config

    if attention == "hybrid":
        raise UnsupportedAttention("engine 'transformers' has no attention kind 'hybrid': the continuous-batching "
                                   "cache of transformers 5.17 to 5.23 (generation/continuous_batching/cache.py, "
                                   "ATTN_TYPE_TO_ALLOCATOR) pages full_attention and sliding_attention layers only; "
                                   "a Mamba or linear-attention layer is refused as an invalid layer type")
    if attention not in ATTENTION_KINDS:
        raise UnsupportedAttention(f"engine 'transformers' has no attention kind {attention!r}; it runs "
                                   f"{', '.join(ATTENTION_KINDS)}")
    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024, pad_token_id=256, bos_token_id=257, eos_token_id=258,
                 tie_word_embeddings=False)
    if attention == "mha":
        return LlamaConfig(num_hidden_layers=2, **shape)
    return Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                       max_window_layers=0, layer_types=["sliding_attention", "full_attention"] * 2, **shape)


def random_checkpoint(attention: str, seed: int) -> Path:
    """The directory of the seeded random checkpoint (model and tokenizer), written on first use."""
    return write_random_checkpoint(random_model_config(attention), f"kvcanary-{attention}", seed)


def load(path: str | Path, device: str, tensor_parallel: int = 1) -> tuple[Any, Any]:
    """(model, tokenizer) from a local checkpoint directory, the model in eval mode on `device`
    with SDPA attention (what continuous batching runs on any device). tensor_parallel > 1: this
    process's shard of the model split over that many ranks by the model's own tensor-parallel
    plan (transformers' DistributedConfig; needs an initialised default process group of that
    many ranks, every rank calling it, and the accelerate package); `device` must then be the one
    transformers puts the rank on (LOCAL_RANK's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--kv-canary-model must be a local Hugging Face checkpoint directory (with config.json); "
                         f"got {str(path)!r}")
    options: dict[str, Any] = {}
    if tensor_parallel > 1:
        from transformers.distributed import DistributedConfig

        options["distributed_config"] = DistributedConfig(tp_size=tensor_parallel)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="auto", attn_implementation="sdpa",
                                                 **options)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tensor_parallel == 1:
        model = model.to(device)
    elif model.device != torch.device(device):
        raise ValueError(f"transformers put this rank's shard on {model.device}, not on {device}")
    return model.eval(), tokenizer
