"""KV stored in FP8 (e4m3 and e5m2) or FP4 (e2m1 in NVFP4 blocks) through per-layer K and V scales,
per KV head or per layer. The fingerprint covers the stored, quantized bytes (FP4's block scales
with them); the per-layer scales are guarded as a group of their own,
"scales": before a forward reads KV, the scales it will dequantize with must be each layer's own.
The reference engine is built with FP8 pools and guarded by hand here (an EngineHandle: the canary
runtime, the fault injector and its ledger), as an engine author wires their own engine."""

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.handles.single import EngineHandle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
SYSTEM = "Answer in one short line. "
QUESTIONS = ["What is a scale?", "What is FP8?", "Why guard a scale?", "What is e4m3?"]


def quantized_handle(attention: str, kv_dtype: str = "fp8_e4m3", kv_scale: str = "head", **canary) -> EngineHandle:
    engine = make_reference_engine(attention, DEVICE, seed=0, kv_dtype=kv_dtype, kv_scale=kv_scale)
    return EngineHandle(engine, CanaryConfig(**{"real_data": "partial", "sweep_interval": 2, "kernels": KERNELS,
                                                **canary}))


@pytest.mark.parametrize("attention,kv_dtype,kv_scale", [
    ("mha", "fp8_e4m3", "head"), ("mha", "fp8_e5m2", "tensor"), ("swa", "fp8_e4m3", "tensor"),
    ("mla", "fp8_e4m3", "tensor"), ("mla", "fp8_e5m2", "head"), ("mha", "fp4_e2m1", "head"),
    ("mla", "fp4_e2m1", "tensor"),
])
def test_each_quantized_pool_is_clean_and_matches_a_recomputation(attention, kv_dtype, kv_scale):
    handle = quantized_handle(attention, kv_dtype, kv_scale, real_data="all")
    handle.reset(0, ())
    prompts = [SYSTEM + q for q in QUESTIONS]
    outputs = handle.generate(prompts, max_new_tokens=6)  # the system prompt's KV is reused
    engine = handle.engine
    assert engine.pools.full.k_layers[0].element_size() == 1  # one byte a value (FP4: a byte a pair)
    for prompt, out in zip(prompts, outputs):
        ids = engine.tokenizer.encode(prompt)
        seq = torch.tensor(ids + out[:-1], device=engine.device)
        assert out == engine.model.logits_without_cache(seq).argmax(-1)[len(ids) - 1:].tolist()
    assert handle.violations() == [] and handle.healthy()
    assert "scales" in handle.pool_groups()


@pytest.mark.parametrize("attention,kv_dtype", [("mha", "fp8_e4m3"), ("mla", "fp8_e5m2"), ("mha", "fp4_e2m1")])
@pytest.mark.parametrize("mode", ["scale_corrupt", "scale_reset"])
def test_a_damaged_scale_is_caught_before_the_forward_handed_it_reads_kv(mode, attention, kv_dtype):
    """The scale a forward dequantizes with gets a flipped bit, or 1.0 (SGLang #20705's class), for
    that forward: its HEAD names the layer (slot) and head (position)."""
    handle = quantized_handle(attention, kv_dtype)
    handle.reset(0, (PerturbSpec(mode, target_group="scales", warmup_steps=1, prob=0.5),))
    handle.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    injections = handle.injections()
    assert injections and all(i.status == "detected" for i in injections), [i.describe() for i in injections]
    for inj in injections:
        v = inj.detected_by
        assert (v.phase, v.reasons, v.step, v.slot, v.position, v.half) == (
            "HEAD", ("verify_scale",), inj.step, inj.layer, inj.position, inj.half)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("mode", ["real_kv_used", "real_kv_post_forward"])
def test_a_flipped_bit_of_a_quantized_byte_is_caught_at_its_slot(mode, kv_dtype):
    handle = quantized_handle("mha", kv_dtype)
    handle.reset(0, (PerturbSpec(mode, target_group="full", warmup_steps=1),))
    handle.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    handle.generate([SYSTEM], max_new_tokens=1)  # one more forward reads what the last one wrote
    handle.side.runtime.sweep()
    detected = [i for i in handle.injections() if i.status == "detected"]
    assert detected, [i.describe() for i in handle.injections()]
    assert all(i.detected_by.reasons == ("verify_real_kv_hash",) and i.detected_by.slot == i.slot for i in detected)
