"""The KV codecs against element-by-element references on fresh random rows: FP8 stores x / scale
clamped to the format's range; FP4 stores per block an NVFP4 e4m3 block scale (16 values) or an MX
E8M0 one (32 values) and the values' e2m1 codes, two a byte, and reads back code x block scale x
scale. An MXFP4 engine's outputs equal a no-cache recomputation, mha and mla, with the canary clean,
and a flipped byte of its pool is reported at its slot."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.kv_quant import E2M1, FP4_BLOCKS, fp4_row_bytes, make_codec

NV, MX = FP4_BLOCKS["fp4_e2m1"], FP4_BLOCKS["mxfp4"]


def _rows(seed: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(7, heads, dim, generator=g) * torch.rand(7, heads, 1, generator=g) * 8
    rows[0, 0, :MX] = 0  # an all-zero block
    return rows, 0.01 + 0.01 * torch.rand(heads, generator=g)


@pytest.mark.parametrize("kv_dtype,fp8", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_stores_rows_over_their_scale_clamped_to_the_format(kv_dtype, fp8):
    rows, scale = _rows(1, 2, 16)
    rows[1, 1, 3] = 1e9  # past the format's range: the largest finite value
    codec = make_codec(kv_dtype, torch.float32, 16)
    stored = codec.store(rows, scale)
    top = torch.finfo(fp8).max
    expected = torch.stack([(rows[:, h] / float(scale[h])).clamp(-top, top) for h in range(2)], dim=1).to(fp8)
    assert stored.dtype == fp8 and torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(codec.load(stored, scale), expected.float() * scale[:, None])


def _nv_unit(block: torch.Tensor) -> tuple[int, float]:
    """NVFP4: the block's e4m3 scale byte (amax / 6) and its value."""
    unit = (block.abs().max() / 6).to(torch.float8_e4m3fn)
    return int(unit.view(torch.uint8)), float(unit.float())


def _mx_unit(block: torch.Tensor) -> tuple[int, float]:
    """MXFP4: the E8M0 byte of 2 ** (floor(log2(amax)) - 2) (-127 for an all-zero block) and its value."""
    amax = float(block.abs().max())
    exponent = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax > 0 else -127
    return exponent + 127, 2.0 ** exponent


def _fp4_reference(row: torch.Tensor, scale: float, size: int, unit_of) -> tuple[list[int], list[int]]:
    """One head's row: its block scales' bytes and its values' 4-bit codes, value by value."""
    scales, codes = [], []
    for block in (row / scale).split(size):
        byte, unit = unit_of(block)
        scales.append(byte)
        for value in block.tolist():
            q = value / unit if unit > 0 else value
            magnitude = min(range(8), key=lambda c: (abs(E2M1[c] - min(abs(q), 6.0)), c))
            codes.append(magnitude | (8 if q < 0 and magnitude else 0))
    return scales, codes


@pytest.mark.parametrize("kv_dtype,heads,dim", [("fp4_e2m1", 2, 16), ("fp4_e2m1", 1, 48), ("fp4_e2m1", 3, 64),
                                                  ("mxfp4", 2, 32), ("mxfp4", 1, 96)])
def test_fp4_packs_block_scales_then_two_codes_a_byte(kv_dtype, heads, dim):
    rows, scale = _rows(heads + dim, heads, dim)
    codec = make_codec(kv_dtype, torch.float32, dim)
    stored = codec.store(rows, scale)
    size, unit_of = {"fp4_e2m1": (NV, _nv_unit), "mxfp4": (MX, _mx_unit)}[kv_dtype]
    blocks, width = dim // size, fp4_row_bytes(dim, size)
    assert stored.dtype == torch.uint8 and stored.shape == (7, heads, width) and width % 16 == 0
    loaded = codec.load(stored, scale)
    for t in range(7):
        for h in range(heads):
            scales, codes = _fp4_reference(rows[t, h], float(scale[h]), size, unit_of)
            row = stored[t, h].tolist()
            assert row[:blocks] == scales
            assert row[blocks:blocks + dim // 2] == [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2])]
            assert row[blocks + dim // 2:] == [0] * (width - blocks - dim // 2)
            units = [unit_of(block)[1] for block in (rows[t, h] / float(scale[h])).split(size)]
            values = [E2M1[c & 7] * (-1 if c & 8 else 1) * units[i // size] for i, c in enumerate(codes)]
            assert torch.equal(loaded[t, h], torch.tensor(values) * scale[h])
    if kv_dtype == "fp4_e2m1":  # what reads back stores the same bytes (MX's scale follows amax's exponent,
        assert torch.equal(codec.store(loaded, scale), stored)  # which a read back may round below)


def mxfp4_engine(attention: str, decode_mode: str = "eager") -> Engine:
    """MX blocks need heads of a multiple of 32 values: mha 2 KV heads of 32, mla a latent row of 64."""
    shape = dict(head_dim=32) if attention == "mha" else dict(kv_lora_rank=48)
    model = ModelConfig(attention=attention, max_context=64, seed=5, kv_dtype="mxfp4", kv_scale="head", **shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Engine(EngineConfig(model=model, max_batch_tokens=64, device=device, decode_mode=decode_mode))


def guarded(engine: Engine, real_data: str = "all", sweep_interval: int = 2) -> CanaryRuntime:
    kernels = "triton" if torch.cuda.is_available() else "torch"
    runtime = CanaryRuntime(CanaryConfig(real_data=real_data, sweep_interval=sweep_interval, kernels=kernels), engine)
    engine.set_forward_hooks(runtime)
    return runtime


@pytest.mark.parametrize("attention,decode_mode", [("mha", "padded"), ("mla", "eager")])
def test_mxfp4_outputs_equal_a_no_cache_recomputation_and_the_canary_is_clean(attention, decode_mode,
                                                                              assert_reference, random_prompts):
    engine = mxfp4_engine(attention, decode_mode)
    runtime = guarded(engine)
    k = engine.pools.full.k_layers[0]
    assert k.dtype == torch.uint8 and k.shape[-1] == fp4_row_bytes(32 if attention == "mha" else 64, MX)
    prompts = random_prompts(3, 4)
    assert_reference(engine, prompts, engine.generate(prompts, 6))
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    assert k[1:20].any()  # the pool was written


def test_a_flipped_bit_of_an_mxfp4_block_scale_is_reported_at_its_slot():
    """The E8M0 block scale leads its head's row: the 16 bytes partial mode reads hold it."""
    engine = mxfp4_engine("mha")
    runtime = guarded(engine, real_data="partial", sweep_interval=0)
    prompt = [21, 22, 23, 24, 25, 26]
    engine.generate([prompt], 1)
    slot = int(engine.cache_walk().slots[3])
    engine.pools.full.v_layers[1][slot, 1, 0] ^= 1 << 2  # head 1's first block scale: 4x or a quarter
    engine.generate([prompt + [27]], 1)
    runtime.drain()
    (v,) = runtime.log.violations
    assert (v.phase, v.group, v.half, v.slot, v.reasons) == ("HEAD", "FULL", "V", slot, ("verify_real_kv_hash",))
