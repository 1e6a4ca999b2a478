"""vLLM with an FP8 KV cache (``kv_cache_dtype="fp8"``, vLLM's CPU attention): the random model with
calibrated per-layer K/V scales, the quantized bytes fingerprinted (V token by token; K, kept
dimension-major, byte by byte), the scales guarded as the SCALES group. A clean workload stays clean
and matches vLLM's own uncached scoring; a scale reset to 1.0 (by the fault injector, or in vLLM's
own layer), scales swapped between layers, a scale tensor damaged and a bit flipped in a stored FP8
byte of K or V are each reported with their reason at their layer or slot."""

from __future__ import annotations

import random

import pytest
import torch

from pytest_kvcanary.config import PerturbSpec

from .support import INSTALL, make_handle, prompts_with_shared_prefixes, stems

pytest.importorskip("vllm", reason=INSTALL)


def _no_fp8() -> str | None:
    from pytest_kvcanary.adapters.vllm.fp8 import no_fp8

    return no_fp8("cpu")


pytestmark = pytest.mark.skipif(_no_fp8() is not None, reason=_no_fp8() or "")
SEEDS = range(3)


@pytest.fixture(scope="module")
def engine():
    from pytest_kvcanary.adapters.vllm import make_vllm_engine

    return make_vllm_engine("mha", "cpu", 0, None, kv_cache_dtype="fp8")


def layers(engine) -> list:
    return engine._scales.layers


def workload(handle, seed: int) -> list[tuple[list[int], list[int]]]:
    """Distinct prompts, then prompts sharing prefixes (prefix hits); (prompt, output) pairs."""
    rng = random.Random(seed)
    first = [[rng.randrange(256) for _ in range(rng.randrange(40, 90))] for _ in range(3)]
    second = prompts_with_shared_prefixes(rng, 5, stems(rng, count=2))
    pairs = []
    for prompts, n in ((first, 4), (second, 6), ([p + [rng.randrange(256) for _ in range(9)] for p in first], 6)):
        pairs += list(zip(prompts, handle.generate(prompts, n)))
    return pairs


def test_a_kv_cache_dtype_is_checked_where_it_is_given(pytestconfig, monkeypatch):
    from pytest_kvcanary.adapters import vllm_hooks
    from pytest_kvcanary.adapters.vllm.engine import VllmSettings

    with pytest.raises(ValueError, match=r"kv_cache_dtype \(VllmSettings.kv_cache_dtype, or "
                                         r"KVCANARY_VLLM_KV_CACHE_DTYPE\) must be one of auto, fp8, fp8_e4m3, "
                                         r"fp8_e5m2; got 'fp16'"):
        VllmSettings(kv_cache_dtype="fp16")
    monkeypatch.setenv("KVCANARY_VLLM_KV_CACHE_DTYPE", "fp8_e5m2")
    assert VllmSettings().kv_cache_dtype == "fp8_e5m2"
    assert VllmSettings().llm_arguments("model", 0)["kv_cache_dtype"] == "fp8_e5m2"
    resolve = (pytestconfig, vllm_hooks.KV_CACHE_DTYPE, vllm_hooks.KV_CACHE_DTYPE_FLAG, "KVCANARY_VLLM_KV_CACHE_DTYPE",
               ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), "auto")
    assert vllm_hooks._resolve(*resolve) == "fp8_e5m2"
    monkeypatch.setenv("KVCANARY_VLLM_KV_CACHE_DTYPE", "int8")
    with pytest.raises(pytest.UsageError, match=r"the environment variable KVCANARY_VLLM_KV_CACHE_DTYPE \(the default "
                                                r"of --kv-canary-vllm-kv-cache-dtype\) must be one of auto, fp8, "
                                                r"fp8_e4m3, fp8_e5m2; got 'int8'"):
        vllm_hooks._resolve(*resolve)


def test_the_cache_is_fp8_and_the_layers_have_calibrated_scales(engine):
    from kvcanary_kernels.records import GroupKind
    from kvcanary_kernels.sources import strided_read

    groups = {g.kind: g for g in engine.canary_groups()}
    assert set(groups) == {GroupKind.FULL, GroupKind.SCALES}
    full, scales = groups[GroupKind.FULL], groups[GroupKind.SCALES]
    assert full.k_layers[0].dtype == torch.uint8 and full.opaque_halves == frozenset()
    k_view = full.k_layers[0]  # one head's K: dimension d of a block's tokens together, a byte each
    assert k_view.stride()[1:] == (1, k_view.shape[1]) and strided_read(k_view, k_view.shape[1]).sample_bytes == 1
    k, v = scales.k_layers[0], scales.v_layers[0]
    assert k.shape == v.shape == (2, 1)
    assert len({*k.flatten().tolist(), *v.flatten().tolist()}) == 4 and 1.0 not in k and 1.0 not in v
    for i, layer in enumerate(layers(engine)):  # what vLLM holds and hands its ops
        assert (layer._k_scale_float, layer._v_scale_float) == (float(k[i, 0]), float(v[i, 0]))
        assert layer._k_scale.data_ptr() == k[i].data_ptr()


def test_a_clean_workload_is_clean_and_matches_uncached_scoring(engine):
    from pytest_kvcanary.soak.runner import default_tie_tolerance
    from pytest_kvcanary.soak.verdicts import scored_damage

    for real_data in ("partial", "all"):
        handle = make_handle(engine, real_data=real_data)
        pairs = workload(handle, 0)
        assert handle.violations() == []
        stats = handle.stats()["single"]
        assert stats["forwards"] > 0 and stats["sweeps"] > 0 and stats["health"] == "ok"
    tolerance = default_tie_tolerance(str(torch.uint8), False)  # the margin the soak gives 8-bit KV
    for (prompt, output), s in zip(pairs, engine.score_uncached(pairs)):
        assert scored_damage(output, s.best, s.runner_up, s.margin, tolerance)[0] is None, (prompt, output, s)


def detections(engine, spec: PerturbSpec) -> list:
    """(injection, the violation that detected it) of every fault `spec` injected over SEEDS; each
    seed injects one at least, and every injection is detected."""
    found = []
    for seed in SEEDS:
        handle = make_handle(engine, (spec,), seed)
        workload(handle, seed)
        injections = handle.injections()
        assert injections, f"seed {seed}: no fault was injected"
        for inj in injections:
            assert inj.status == "detected", inj
            found.append((inj, inj.detected_by))
    return found


@pytest.mark.parametrize("mode", ["scale_reset", "scale_corrupt"])
def test_a_damaged_scale_is_caught_at_head_of_its_forward(engine, mode):
    for inj, v in detections(engine, PerturbSpec(mode, target_group="scales", warmup_steps=1, prob=0.5)):
        assert (v.group, v.phase, v.reasons, v.slot, v.position, v.half) == (
            "SCALES", "HEAD", ("verify_scale",), inj.layer, 0, inj.half), (inj, v)


def test_a_scale_fed_as_1_changes_what_vllm_computes(engine):
    """The injector's damage reaches vLLM's ops (the view's scales are fed to the forward)."""
    prompts = [[random.Random(i).randrange(256) for _ in range(40)] for i in range(3)]
    clean = make_handle(engine).generate(prompts, 6)
    reset = make_handle(engine, (PerturbSpec("scale_reset", target_group="scales"),)).generate(prompts, 6)
    assert reset != clean
    assert [(layer._k_scale_float, layer._v_scale_float) for layer in layers(engine)] == [
        (float(k), float(v)) for k, v in zip(*(g.flatten() for g in engine._scales.pool))], "put back after"


def test_a_scale_vllm_resets_to_1_or_takes_from_another_layer_is_caught(engine, monkeypatch):
    """Damage in vLLM's own layers (the floats its ops receive), no injector: HEAD of the next
    forward names the layer and half."""
    one, two = layers(engine)
    prompt = [random.Random(7).randrange(256) for _ in range(70)]
    handle = make_handle(engine)
    handle.generate([prompt], 1)  # its first two blocks cached, quantized with the layers' scales
    monkeypatch.setattr(one, "_v_scale_float", 1.0)
    handle.generate([prompt + [1, 2, 3]], 6)  # a prefix hit: they are read with 1.0
    found = {(v.phase, v.group, v.slot, v.half, v.reasons) for v in handle.violations()}
    assert found == {("HEAD", "SCALES", 0, "V", ("verify_scale",))}
    monkeypatch.undo()

    prompts = [prompt]

    handle = make_handle(engine)
    first, second = one._v_scale_float, two._v_scale_float
    monkeypatch.setattr(one, "_v_scale_float", second)
    monkeypatch.setattr(two, "_v_scale_float", first)
    handle.generate(prompts, 2)
    found = {(v.phase, v.group, v.slot, v.half, v.reasons) for v in handle.violations()}
    assert found == {("HEAD", "SCALES", 0, "V", ("verify_scale",)), ("HEAD", "SCALES", 1, "V", ("verify_scale",))}


def test_a_damaged_scale_tensor_is_caught_by_the_sweep(engine):
    handle = make_handle(engine, sweep_interval=1)
    layer = layers(engine)[0]
    held = float(layer._v_scale)
    layer._v_scale.fill_(1.0)  # vLLM's stored scale tensor, a row of the SCALES pool
    try:
        handle.generate([[5, 6, 7] * 12], 2)
    finally:
        layer._v_scale.fill_(held)
    found = {(v.phase, v.group, v.slot, v.half, v.reasons) for v in handle.violations()}
    assert found == {("SWEEP", "SCALES", 0, "V", ("verify_scale",))}


def test_a_flipped_fp8_byte_is_caught_at_its_slot(engine):
    found = detections(engine, PerturbSpec("real_kv_used", target_group="full", warmup_steps=2))
    for inj, v in found:
        assert (v.phase, v.slot, v.half, v.reasons) == ("HEAD", inj.slot, inj.half, ("verify_real_kv_hash",)), (inj, v)
    assert {inj.half for inj, _ in found} == {"K", "V"}


@pytest.mark.parametrize("half", ["K", "V"])
def test_a_flipped_byte_in_vllms_cache_is_caught_at_its_slot(engine, half):
    """A bit flipped in a cached block's K or V (vLLM's own tensor, addressed through its layout: K
    dimension-major, V token by token): the next request hitting that prefix is reported at HEAD,
    at that slot, on that half."""
    from kvcanary_kernels.records import GroupKind, Half

    handle = make_handle(engine, sweep_interval=0)
    prompt = [random.Random(3).randrange(256) for _ in range(70)]
    handle.generate([prompt], 2)
    group = handle.side.runtime.group(GroupKind.FULL)
    walk = engine.cache_walk()
    slot = int(walk.slots[walk.positions == 40][0])
    bs = group.pool.page_size
    layers = group.pool.k_layers if half == "K" else group.pool.v_layers
    kv = layers[group.halves[Half[half]].source_layers[0]]  # [blocks, block_size, head_size] uint8, any strides
    kv[slot // bs, slot % bs, 5] ^= 0x40  # the top bit of value 5's exponent
    handle.generate([prompt + [9, 9]], 2)
    found = {(v.phase, v.slot, v.half, v.reasons) for v in handle.violations()}
    assert found == {("HEAD", slot, half, ("verify_real_kv_hash",))}


def test_fp8_e5m2_runs_clean_with_scales_of_1():
    """vLLM refuses a checkpoint's scales with e5m2: the plain random model runs, its scales 1.0
    (still guarded); its layout is probed through e5m2's own values."""
    from pytest_kvcanary.adapters.vllm import make_vllm_engine

    engine = make_vllm_engine("mha", "cpu", 0, None, kv_cache_dtype="fp8_e5m2")
    assert engine._scales.pool[0].eq(1.0).all() and engine._scales.pool[1].eq(1.0).all()
    handle = make_handle(engine)
    workload(handle, 1)
    assert handle.violations() == []
    assert handle.stats()["single"]["forwards"] > 0


def test_a_cpu_without_avx512_or_amx_is_refused_naming_why(monkeypatch):
    from pytest_kvcanary.adapters.vllm import make_vllm_engine
    from pytest_kvcanary.canary.seam import UnsupportedAttention

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(UnsupportedAttention, match="engine 'vllm' runs no fp8 KV cache here: vLLM's CPU attention "
                                                   "stores an FP8 KV cache on x86 with AVX-512 or AMX only"):
        make_vllm_engine("mha", "cpu", 0, None, kv_cache_dtype="fp8")
    monkeypatch.undo()
    with pytest.raises(UnsupportedAttention, match="no attention kind 'mla' with a fp8_e4m3 KV cache"):
        make_vllm_engine("mla", "cpu", 0, None, kv_cache_dtype="fp8_e4m3")
