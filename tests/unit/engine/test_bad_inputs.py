"""Bad configuration and bad requests raise ValueError naming the field, value and what is allowed."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.reference_engine import ByteTokenizer, Engine, EngineConfig, ModelConfig


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention="gqa"), "attention must be one of mha, swa, mla, hybrid, sparse; got 'gqa'"),
    (dict(hidden=0), "hidden must be an integer >= 1; got 0"),
    (dict(num_layers=2.5), "num_layers must be an integer >= 1; got 2.5"),
    (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads; got 3"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(attention="swa", full_every=1), r"full_every must be in \[2, num_layers=4\] for swa"),
    (dict(attention="swa", window=0), "window must be an integer >= 1; got 0"),
    (dict(dtype=torch.int32), "dtype must be one of"),
    (dict(rope_theta=0.0), "rope_theta and rms_eps must be > 0"),
    (dict(attention="mla", qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(attention="mla", kv_lora_rank=0), "kv_lora_rank must be an integer >= 1; got 0"),
    (dict(attention="mla", kv_lora_rank=30, qk_rope_head_dim=4, dtype=torch.bfloat16),
     r"kv_lora_rank \+ qk_rope_head_dim \(34\) must make a latent row of a multiple of 16 bytes in "
     r"torch.bfloat16; got 68 bytes"),
])
def test_model_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_slots=1), r"num_slots must be an integer >= 2 \(slot 0 is reserved\); got 1"),
    (dict(swa_num_slots=True), "swa_num_slots must be an integer >= 2"),
    (dict(max_running=0), "max_running must be an integer >= 1; got 0"),
    (dict(max_batch_tokens=100), r"max_batch_tokens must be >= model.max_context \(256\); got 100"),
    (dict(device="gpu0"), "device must be a torch device string"),
    (dict(model="mha"), "model must be a ModelConfig; got str"),
])
def test_engine_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("attention", ["mha", "swa", "mla"])
def test_submit_errors(attention):
    model = ModelConfig(attention=attention, max_context=32)
    engine = Engine(EngineConfig(model=model, num_slots=40, swa_num_slots=12, max_batch_tokens=32))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit("", 4)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], 4)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1; got 0"):
        engine.submit("hi", 0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=512\); got 512"):
        engine.submit([1, 512], 4)
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_new_tokens \(3\) = 33 exceeds max_context \(32\)"):
        engine.submit([1] * 30, 3)
    if attention == "swa":
        with pytest.raises(ValueError, match="pool too small for a single request: it needs 13 KV slots, "
                                             "swa_num_slots=12 holds 11"):
            engine.submit([1] * 10, 4)
    small = Engine(EngineConfig(model=model, num_slots=8, max_batch_tokens=32))
    with pytest.raises(ValueError, match="it needs 9 KV slots, num_slots=8 holds 7"):
        small.submit([1] * 6, 4)
    assert not engine.scheduler.has_work and not small.scheduler.has_work


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([104, 300, 105]) == "h\ufffdi"
