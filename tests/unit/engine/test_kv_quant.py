"""The KV codecs against element-by-element references on fresh random rows: FP8 stores x / scale
clamped to the format's range; FP4 (NVFP4's layout) stores per 16 values an e4m3 block scale and
the values' e2m1 codes, two a byte, and reads back code x block scale x scale."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.reference_engine.kv_quant import E2M1, FP4_BLOCK, fp4_row_bytes, make_codec


def _rows(seed: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(7, heads, dim, generator=g) * torch.rand(7, heads, 1, generator=g) * 8
    rows[0, 0, :FP4_BLOCK] = 0  # an all-zero block
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


def _fp4_reference(row: torch.Tensor, scale: float) -> tuple[list[int], list[int]]:
    """One head's row: its block scales' bytes and its values' 4-bit codes, value by value."""
    scales, codes = [], []
    for block in (row / scale).split(FP4_BLOCK):
        unit = (block.abs().max() / 6).to(torch.float8_e4m3fn)
        scales.append(int(unit.view(torch.uint8)))
        for value in block.tolist():
            q = value / float(unit.float()) if float(unit.float()) > 0 else value
            magnitude = min(range(8), key=lambda c: (abs(E2M1[c] - min(abs(q), 6.0)), c))
            codes.append(magnitude | (8 if q < 0 and magnitude else 0))
    return scales, codes


@pytest.mark.parametrize("heads,dim", [(2, 16), (1, 48), (3, 64)])
def test_fp4_packs_block_scales_then_two_codes_a_byte(heads, dim):
    rows, scale = _rows(heads + dim, heads, dim)
    codec = make_codec("fp4_e2m1", torch.float32, dim)
    stored = codec.store(rows, scale)
    blocks, width = dim // FP4_BLOCK, fp4_row_bytes(dim)
    assert stored.dtype == torch.uint8 and stored.shape == (7, heads, width) and width % 16 == 0
    loaded = codec.load(stored, scale)
    for t in range(7):
        for h in range(heads):
            scales, codes = _fp4_reference(rows[t, h], float(scale[h]))
            row = stored[t, h].tolist()
            assert row[:blocks] == scales
            assert row[blocks:blocks + dim // 2] == [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2])]
            assert row[blocks + dim // 2:] == [0] * (width - blocks - dim // 2)
            units = torch.tensor(scales, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            values = [E2M1[c & 7] * (-1 if c & 8 else 1) * float(units[i // FP4_BLOCK]) for i, c in enumerate(codes)]
            assert torch.equal(loaded[t, h], torch.tensor(values) * scale[h])
    assert torch.equal(codec.store(loaded, scale), stored)  # what reads back stores the same bytes
