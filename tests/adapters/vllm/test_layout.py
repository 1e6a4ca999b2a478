"""Layout discovery on synthetic caches of vLLM's layouts (CUDA ones included: no vLLM needed):
slot_bytes finds, for every slot, exactly the bytes the layout gives it, reports whether the
fingerprint reads every view (one run per slot, or a feature-major block read element by
element), and the fingerprint over its views changes with a byte of that slot, and only that slot,
in every real_data mode."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvcanary_kernels import fingerprint_ref, layer_source
from kvcanary_kernels.records import Half
from pytest_kvcanary.adapters.vllm.layout import Order, cpu_attn_half, slot_bytes

BLOCKS, BS, HEADS, D = 6, 16, 3, 16


def cpu_attn(order: Order) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda cache: cpu_attn_half(cache, Half.K, order)


# name -> (cache shape, half view of the cache, a view of the elements of slot (b, t) by the
# layout's own definition, whether the fingerprint reads every view)
LAYOUTS = {
    "flash_attn": ((2, BLOCKS, BS, HEADS, D), lambda c: c[0], lambda c, b, t: c[0, b, t], True),
    "flashinfer_nhd": ((BLOCKS, 2, BS, HEADS, D), lambda c: c[:, 1], lambda c, b, t: c[b, 1, t], True),
    "flashinfer_hnd": ((BLOCKS, 2, HEADS, BS, D), lambda c: c[:, 0].transpose(1, 2),
                       lambda c, b, t: c[b, 0, :, t], True),
    "mla": ((BLOCKS, BS, 4 * D), lambda c: c, lambda c, b, t: c[b, t], True),
    "cpu_attn_token": ((BLOCKS, HEADS, BS, 2 * D), cpu_attn(Order.TOKEN),
                       lambda c, b, t: c.view(BLOCKS, HEADS, 2 * BS, D)[b, :, t], True),
    "cpu_attn_dim": ((BLOCKS, HEADS, BS, 2 * D), cpu_attn(Order.DIM),
                     lambda c, b, t: c.view(BLOCKS, HEADS, 2 * D, BS)[b, :, :D, t], True),
    # not read: runs of dimension pairs (4 bytes, under a 16-byte sample), every other row
    "pairs": ((BLOCKS, HEADS, D // 2, BS, 2), lambda c: c.permute(0, 3, 1, 2, 4),
              lambda c, b, t: c[b, :, :, t], False),
    "every_other_row": ((BLOCKS, 2 * BS, D), lambda c: c[:, ::2], lambda c, b, t: c[b, 2 * t], False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_slot_gets_exactly_its_bytes(name):
    shape, half, elements, readable = LAYOUTS[name]
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    found = slot_bytes(half(cache))
    assert found.readable is readable
    for view in found.views:
        assert view.shape[:2] == (BLOCKS, BS) and view.data_ptr() >= cache.data_ptr()
    for b in range(BLOCKS):
        for t in range(BS):
            assert torch.equal(torch.cat([v[b, t] for v in found.views]), elements(cache, b, t).flatten())


@pytest.mark.parametrize("real_data", ["partial", "all"])
@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout[3]])
def test_fingerprint_follows_each_slots_bytes(name, real_data):
    shape, half, elements, _ = LAYOUTS[name]
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sources = [layer_source(v, BS, real_data) for v in slot_bytes(half(cache)).views]
    slots = torch.arange(BLOCKS * BS, dtype=torch.int64)
    before = fingerprint_ref(sources, slots)
    b, t = 3, 5
    # Flip the first element of the slot as the layout defines it: every mode reads it.
    slot = elements(cache, b, t)
    first = (slot.data_ptr() - cache.data_ptr()) // cache.element_size()
    cache.view(-1).view(torch.int16)[first] ^= 1
    after = fingerprint_ref(sources, slots)
    changed = (before != after).nonzero().flatten().tolist()
    assert changed == [b * BS + t]
