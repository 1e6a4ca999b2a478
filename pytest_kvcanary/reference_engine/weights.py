"""Local Hugging Face checkpoints of Llama / Qwen2-style models: a directory with config.json and
*.safetensors holding the standard tensor names (``model.layers.0.self_attn.q_proj.weight``, ...).
The attention kind (mha / swa) is not read from config.json; pass it as an override.
`checkpoint_problem` judges a checkpoint from config.json and the safetensors headers alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..canary.seam import UnsupportedAttention
from .config import ModelConfig
from .model import CausalLM

MODEL_TYPES = ("llama", "qwen2")


def _dtype(hf: dict[str, Any]) -> torch.dtype:
    """The dtype config.json names (torch_dtype, else dtype; float32 without either)."""
    key = "torch_dtype" if hf.get("torch_dtype") else "dtype"
    name = hf.get(key) or "float32"
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json {key} must name a torch dtype (float32, float16, bfloat16); got {name!r}")
    return dtype


def read_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint at path; overrides (ModelConfig fields) win.
    UnsupportedAttention for attention="mla": a Llama / Qwen2 checkpoint has no latent attention."""
    hf = json.loads((Path(path) / "config.json").read_text())
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"config.json model_type must be one of {', '.join(MODEL_TYPES)}; got {hf.get('model_type')!r}")
    if overrides.get("attention") in ("mla", "hybrid", "sparse"):
        raise UnsupportedAttention(f"engine 'reference' runs the {hf['model_type']} checkpoint {str(path)!r} as mha or "
                                   "swa only: it has no mla (latent attention), hybrid (recurrent mixer) or sparse "
                                   "(indexer) tensors")
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
        dtype=_dtype(hf),
    )
    return ModelConfig(**{**fields, **overrides})


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the *.safetensors files of the checkpoint directory, read
    from their headers (no tensor is read). ValueError naming the file that is not a safetensors
    file, or saying there is none."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError("has no *.safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with open(f, "rb"):  # safetensors reports an unreadable file as a missing one
                pass
        except OSError as e:
            raise ValueError(f"has a {f.name} that cannot be read ({e.strerror or e})") from None
        try:
            with safe_open(str(f), framework="numpy") as st:
                shapes.update((name, tuple(st.get_slice(name).get_shape())) for name in st.keys())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"has a {f.name} that is not a readable safetensors file ({e})") from None
    return shapes


def _count(names: list[str]) -> str:
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def misfit(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], *, strict: bool = True) -> str | None:
    """Why tensors of these shapes cannot fill the model's state dict, or None. strict: every
    tensor of the model must be there and nothing else (else only the tensors both have count)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problems = []
    if strict and (missing := sorted(expected.keys() - shapes.keys())):
        problems.append(f"missing {_count(missing)}")
    if strict and (unexpected := sorted(shapes.keys() - expected.keys())):
        problems.append(f"unexpected {_count(unexpected)}")
    if wrong := sorted(name for name in expected.keys() & shapes.keys() if expected[name] != shapes[name]):
        first = wrong[0]
        problems.append(f"{_count(wrong)} shaped {list(shapes[first])} where the model has {list(expected[first])}")
    return "; ".join(problems) or None


def _tied(model: CausalLM, shapes: dict[str, Any]) -> dict[str, Any]:
    """A tied model's checkpoint may leave lm_head out: it is the embedding."""
    if model.cfg.tie_embeddings and "model.embed_tokens.weight" in shapes:
        return {"lm_head.weight": shapes["model.embed_tokens.weight"], **shapes}
    return shapes


def checkpoint_problem(path: str | Path, **overrides: Any) -> str | None:
    """Why the checkpoint directory cannot fill the model its config.json describes (overrides:
    ModelConfig fields), or None. Reads config.json and the safetensors headers; the model is
    built on the meta device, so no weight is read or allocated."""
    try:
        cfg = read_config(path, **overrides)
    except (KeyError, TypeError, ValueError) as e:
        return f"has a config.json the engine cannot read ({e if not isinstance(e, KeyError) else f'no {e}'})"
    try:
        shapes = tensor_shapes(path)
    except ValueError as e:
        return str(e)
    with torch.device("meta"):
        model = CausalLM(cfg)
    why = misfit(model, _tied(model, shapes))
    return None if why is None else f"has tensors that do not fit the model its config.json describes: {why}"


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Copy the checkpoint's tensors into model (cast to its dtype). ValueError naming the
    checkpoint when a file is not safetensors, or for missing, unexpected or mis-shaped tensors."""
    try:
        shapes = tensor_shapes(path)
    except ValueError as e:
        raise ValueError(f"checkpoint {str(path)!r} {e}") from None
    if why := misfit(model, _tied(model, shapes)):
        raise ValueError(f"checkpoint {str(path)!r} does not fit the model: {why}")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(_tied(model, state), strict=True)


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
