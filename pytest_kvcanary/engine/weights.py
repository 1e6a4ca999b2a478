"""Local Hugging Face checkpoints of Llama / Qwen2-style models: a directory with config.json and
*.safetensors holding the standard tensor names (``model.layers.0.self_attn.q_proj.weight``, ...).
The attention kind (mha / swa) is not read from config.json; pass it as an override."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .model import CausalLM

MODEL_TYPES = ("llama", "qwen2")


def read_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint at path; overrides (ModelConfig fields) win."""
    hf = json.loads((Path(path) / "config.json").read_text())
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"config.json model_type must be one of {', '.join(MODEL_TYPES)}; got {hf.get('model_type')!r}")
    if hf.get("rope_scaling"):
        raise ValueError(f"config.json rope_scaling is not supported; got {hf['rope_scaling']!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act must be silu; got {hf['hidden_act']!r}")
    heads = hf["num_attention_heads"]
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        hidden=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate=hf["intermediate_size"],
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_context=hf.get("max_position_embeddings", ModelConfig.max_context),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=hf.get("attention_bias", hf["model_type"] == "qwen2"),
        dtype=getattr(torch, hf.get("torch_dtype") or hf.get("dtype") or "float32", None),
    )
    return ModelConfig(**{**fields, **overrides})


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Copy the checkpoint's tensors into model (cast to its dtype). Missing, unexpected or
    mis-shaped tensors raise ValueError."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in checkpoint directory {str(path)!r}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    if model.cfg.tie_embeddings and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {str(path)!r} does not fit the model: {e}") from None


def save_checkpoint(model: CausalLM, path: str | Path) -> None:
    """Write model as an HF checkpoint (config.json + model.safetensors) that read_config and
    load_weights read back. Llama / Qwen2 layouts only (attention mha or swa)."""
    cfg, path = model.cfg, Path(path)
    if cfg.attention == "mla":
        raise ValueError(f"save_checkpoint writes Llama / Qwen2 checkpoints: attention must be mha or swa; "
                         f"got {cfg.attention!r}")
    path.mkdir(parents=True, exist_ok=True)
    hf = dict(
        model_type="qwen2" if cfg.qkv_bias else "llama",
        architectures=["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=cfg.max_context,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.qkv_bias,
        hidden_act="silu",
        torch_dtype=str(cfg.dtype).removeprefix("torch."),
    )
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(path / "model.safetensors"))
