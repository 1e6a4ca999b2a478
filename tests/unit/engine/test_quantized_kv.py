"""KV stored in FP8 or FP4 (ModelConfig.kv_dtype): greedy outputs equal a no-cache recomputation
that stores and reads K/V the same way, with the canary clean; a forward handed a wrong scale (1.0
on a prefix hit, another layer's) is reported at HEAD of that forward, at the layer, before its
samples are used; a scale the pool holds damaged is found by the sweep; a damaged FP4 block scale
is found with its block's slot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.canary.seam import ScaleInputs
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
ONE = 0x3F800000  # 1.0's float32 bits


def quantized_engine(attention: str = "mha", kv_dtype: str = "fp8_e4m3", kv_scale: str = "head",
                     **engine_kw) -> Engine:
    model = ModelConfig(attention=attention, max_context=64, seed=3, kv_dtype=kv_dtype, kv_scale=kv_scale)
    return Engine(EngineConfig(model=model, max_batch_tokens=64, device=DEVICE, **engine_kw))


def guarded(engine: Engine, kernels: str = KERNELS) -> CanaryRuntime:
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=kernels), engine)
    engine.set_forward_hooks(runtime)
    return runtime


def logged(runtime: CanaryRuntime) -> list:
    """Every violation logged so far (the periodic drains' and a final one's)."""
    runtime.drain()
    return runtime.log.violations


@pytest.mark.parametrize("attention,kv_dtype,kv_scale,decode_mode", [
    ("mha", "fp8_e4m3", "head", "eager"),
    ("mha", "fp8_e5m2", "tensor", "padded"),
    ("mla", "fp8_e4m3", "tensor", "padded"),
    ("mla", "fp8_e5m2", "head", "eager"),
    ("mha", "fp4_e2m1", "head", "padded"),
    ("mla", "fp4_e2m1", "tensor", "eager"),
])
def test_quantized_outputs_equal_a_no_cache_recomputation_and_the_canary_is_clean(
        attention, kv_dtype, kv_scale, decode_mode, assert_reference, random_prompts):
    engine = quantized_engine(attention, kv_dtype, kv_scale, decode_mode=decode_mode)
    runtime = guarded(engine)
    assert engine.pools.full.k_layers[0].dtype == engine.config.model.kv_storage != torch.float32
    prompts = random_prompts(1, 4)
    outputs = engine.generate(prompts, 8)
    assert_reference(engine, prompts, outputs)
    assert logged(runtime) == [] and runtime.health_problems() == []
    scales = runtime.scales
    assert scales is not None and runtime.group_kinds[-1] is GroupKind.SCALES
    assert sorted(h.name for h in scales.buffers) == (["K"] if attention == "mla" else ["K", "V"])
    assert scales.guarded[next(iter(scales.buffers))].shape[1] == (2 if (attention, kv_scale) == ("mha", "head") else 1)
    if kv_dtype != "fp4_e2m1":  # the stored bytes are FP8 of K / scale: read without the scale, far off
        k = engine.pools.full.k_layers[0][1:30].float()
        assert k.abs().max() > 20 * (k * engine.model.kv_scales.k[0][:, None]).abs().max()


def test_a_forward_that_dequantizes_a_prefix_hit_with_scale_one_is_reported_before_its_samples(monkeypatch):
    """SGLang #24198's class: one path of the attention (here: a prefill extending a cached prefix)
    runs without the layer's scales. HEAD of each such forward reports every scale it was handed."""
    engine = quantized_engine()
    runtime = guarded(engine)
    view_of = engine._view

    def without_scales_on_a_prefix_hit(batch):
        view = view_of(batch)
        if batch.is_prefill and max(batch.prefix_lens) > 0:
            view = dataclasses.replace(view, scales=ScaleInputs(*(torch.ones_like(s) for s in view.scales)))
        return view

    monkeypatch.setattr(engine, "_view", without_scales_on_a_prefix_hit)
    engine.generate([[7] * 20], 4)  # nothing cached: the right scales
    assert logged(runtime) == []
    prompt = [7] * 20 + [9, 9]
    (out,) = engine.generate([prompt], 4)  # a prefix hit
    found = logged(runtime)
    layers, heads = engine.model.kv_scales.k.shape
    assert {(v.phase, v.group, v.reasons, v.stored) for v in found} == {("HEAD", "SCALES", ("verify_scale",), ONE)}
    assert {(v.half, v.slot, v.position) for v in found} == {(h, i, j) for h in "KV" for i in range(layers)
                                                             for j in range(heads)}
    assert len({v.step for v in found}) == 1
    ids = torch.tensor(prompt + out[:-1], device=engine.device)
    assert out != engine.model.logits_without_cache(ids).argmax(-1)[len(prompt) - 1:].tolist(), "no damage to see"


def test_a_forward_handed_another_layers_scales_is_reported_at_each_layer():
    engine = quantized_engine(kv_scale="tensor")
    runtime = guarded(engine)
    view_of = engine._view
    engine._view = lambda batch: dataclasses.replace(
        view_of(batch), scales=ScaleInputs(*(s.roll(1, 0).contiguous() for s in engine.model.kv_scales)))
    engine.generate([[5, 6, 7]], 1)
    found = logged(runtime)
    layers = engine.model.kv_scales.k.shape[0]
    assert {(v.half, v.slot) for v in found} == {(h, i) for h in "KV" for i in range(layers)}
    k = engine.model.kv_scales.k
    row = {v.slot: v for v in found if v.half == "K"}
    assert all(row[i].expected == k[i, 0].view(torch.int32).item() & 0xFFFFFFFF for i in range(layers))


def test_a_scale_damaged_in_the_pool_is_found_by_the_sweep():
    engine = quantized_engine()
    runtime = guarded(engine, kernels="triton")  # the Triton kernels (interpreted on a CPU)
    engine.generate([[1, 2, 3, 4]], 2)
    engine.model.kv_scales.v[2, 1] *= 2
    runtime.sweep()
    (v,) = logged(runtime)
    assert (v.phase, v.group, v.half, v.slot, v.position, v.reasons) == ("SWEEP", "SCALES", "V", 2, 1, ("verify_scale",))


def test_an_fp8_view_without_scales_is_refused_naming_the_field():
    engine = quantized_engine()
    runtime = guarded(engine)
    view_of = engine._view
    engine._view = lambda batch: dataclasses.replace(view_of(batch), scales=None)
    with pytest.raises(ValueError, match=r"ForwardView.scales is None: an engine with a SCALES group"):
        engine.generate([[1, 2]], 1)
    assert runtime.forwards == 0


@pytest.mark.parametrize("model,engine_kw,message", [
    (dict(kv_dtype="fp8"), {}, "kv_dtype must be one of auto, float32, float16, bfloat16, fp8_e4m3, fp8_e5m2, fp4_e2m1, "
                                  "mxfp4; got 'fp8'"),
    (dict(kv_dtype="mxfp4"), {}, "kv_dtype 'mxfp4' needs head_dim a multiple of 32 \\(a block scale per 32 values\\); "
                                 "got 16"),
    (dict(kv_dtype="fp4_e2m1", head_dim=8, num_kv_heads=4, num_heads=4), {},
     "kv_dtype 'fp4_e2m1' needs head_dim a multiple of 16 \\(a block scale per 16 values\\); got 8"),
    (dict(kv_dtype="fp8_e4m3", kv_scale="block"), {}, "kv_scale must be one of tensor, head; got 'block'"),
    (dict(kv_dtype="fp8_e4m3", num_kv_heads=1, num_heads=1, head_dim=8), {},
     r"num_kv_heads x head_dim \(1 x 8\) must make a KV row of a multiple of 16 bytes"),
    (dict(kv_dtype="fp8_e5m2"), dict(speculative_k=2),
     "speculative_k > 0 needs model.kv_dtype 'auto' \\(the draft pool stores the model's dtype\\); got 'fp8_e5m2'"),
])
def test_bad_kv_dtype_settings_raise_naming_the_field(model, engine_kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=ModelConfig(**model), **engine_kw)


def test_a_float_kv_dtype_is_a_plain_cast_with_no_scales(assert_reference, random_prompts):
    engine = quantized_engine(kv_dtype="bfloat16")
    runtime = guarded(engine)
    prompts = random_prompts(2, 3)
    assert_reference(engine, prompts, engine.generate(prompts, 6))
    assert engine.pools.full.k_layers[0].dtype == torch.bfloat16 and engine.model.kv_scales is None
    assert runtime.scales is None and logged(runtime) == []


def test_a_flipped_bit_of_an_fp4_block_scale_is_reported_at_its_slot():
    """An FP4 row leads with its block scales: the 16 bytes partial mode reads of a head hold them."""
    engine = quantized_engine(kv_dtype="fp4_e2m1")
    runtime = CanaryRuntime(CanaryConfig(real_data="partial", sweep_interval=0, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    prompt = [11, 12, 13, 14, 15, 16]
    engine.generate([prompt], 1)
    slot = int(engine.cache_walk().slots[2])
    engine.pools.full.k_layers[0].view(torch.uint8)[slot, 0, 0] ^= 1 << 6  # head 0's first block scale
    engine.generate([prompt + [17]], 1)
    (v,) = logged(runtime)
    assert (v.phase, v.group, v.half, v.slot, v.reasons) == ("HEAD", "FULL", "K", slot, ("verify_real_kv_hash",))
