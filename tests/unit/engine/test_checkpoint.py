"""HF safetensors checkpoints: save a small random model, load it back, same outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.model import CausalLM
from pytest_kvcanary.reference_engine.weights import checkpoint_problem, read_config, save_checkpoint

PROMPTS = [list(b"checkpoint round trip"), list(b"check")]


@pytest.mark.parametrize("flavour", [dict(), dict(qkv_bias=True, tie_embeddings=False)], ids=["llama", "qwen2"])
def test_round_trip(tmp_path, flavour):
    cfg = ModelConfig(max_context=64, seed=7, **flavour)
    save_checkpoint(CausalLM(cfg), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "model.norm.weight" in tensors
    assert ("model.layers.0.self_attn.k_proj.bias" in tensors) == cfg.qkv_bias
    assert ("lm_head.weight" in tensors) != cfg.tie_embeddings
    loaded = read_config(tmp_path, seed=99)  # other random weights, replaced by the checkpoint's
    assert loaded == ModelConfig(max_context=64, seed=99, **flavour)
    expected = Engine(EngineConfig(model=cfg, max_batch_tokens=64)).generate(PROMPTS, 6)
    got = Engine(EngineConfig(model=loaded, checkpoint=str(tmp_path), max_batch_tokens=64)).generate(PROMPTS, 6)
    assert got == expected
    assert Engine(EngineConfig(model=loaded, max_batch_tokens=64)).generate(PROMPTS, 6) != expected


def test_bad_checkpoints(tmp_path):
    save_checkpoint(CausalLM(ModelConfig()), tmp_path)
    with pytest.raises(ValueError, match="does not fit the model"):
        Engine(EngineConfig(model=ModelConfig(hidden=32), checkpoint=str(tmp_path)))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        Engine(EngineConfig(checkpoint=str(tmp_path / "missing")))
    hf = json.loads((tmp_path / "config.json").read_text())
    for key, value, match in [("model_type", "gpt2", "model_type must be one of llama, qwen2; got 'gpt2'"),
                              ("rope_scaling", {"type": "yarn"}, "rope_scaling is not supported"),
                              ("hidden_act", "gelu", "hidden_act must be silu")]:
        (tmp_path / "config.json").write_text(json.dumps({**hf, key: value}))
        with pytest.raises(ValueError, match=match):
            read_config(tmp_path)


@pytest.mark.parametrize("flavour", [dict(), dict(qkv_bias=True, tie_embeddings=False)], ids=["llama", "qwen2"])
def test_matches_transformers(tmp_path, flavour):
    """Where Hugging Face transformers is installed: it loads our checkpoint and computes the same
    logits (the tensor names, RoPE and norms follow its Llama / Qwen2)."""
    transformers = pytest.importorskip("transformers")
    model = CausalLM(ModelConfig(max_context=64, seed=3, **flavour))
    save_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(model.logits_without_cache(ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flavour", [dict(), dict(qkv_bias=True, tie_embeddings=False)], ids=["llama", "qwen2"])
def test_a_checkpoint_is_judged_from_its_headers(tmp_path, flavour):
    """checkpoint_problem reads config.json and the safetensors headers only: a good checkpoint has
    none, a corrupt file or tensors that do not fit the model are named."""
    save_checkpoint(CausalLM(ModelConfig(**flavour)), tmp_path)
    assert checkpoint_problem(tmp_path) is None
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({**tensors, name: tensors[name][:8].contiguous()}, str(tmp_path / "model.safetensors"))
    assert checkpoint_problem(tmp_path) == (
        "has tensors that do not fit the model its config.json describes: model.layers.0.self_attn.q_proj.weight "
        f"shaped [8, {tensors[name].shape[1]}] where the model has {list(tensors[name].shape)}")
    save_file({k: v for k, v in tensors.items() if "norm" not in k}, str(tmp_path / "model.safetensors"))
    norms = sum("norm" in k for k in tensors)
    missing = f": missing model.layers.0.input_layernorm.weight and {norms - 1} more"
    assert checkpoint_problem(tmp_path).endswith(missing)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    assert checkpoint_problem(tmp_path) == ("has a model.safetensors that is not a readable safetensors file "
                                            "(Error while deserializing header: header too large)")
    with pytest.raises(ValueError, match="checkpoint .* has a model.safetensors that is not a readable"):
        Engine(EngineConfig(model=ModelConfig(**flavour), checkpoint=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_problem(tmp_path) == "has a config.json the engine cannot read (no 'num_attention_heads')"
