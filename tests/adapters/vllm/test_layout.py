"""Layout discovery on synthetic caches of vLLM's layouts (CUDA ones included: no vLLM needed):
slot_bytes finds, for every slot, exactly the bytes the layout gives it, reports whether the
fingerprint reads every view (one run per slot, or a feature-major block read element by
element), and the fingerprint over its views changes with a byte of that slot, and only that slot,
in every real_data mode."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from kvcanary_kernels import fingerprint_ref, layer_source, mix_torch, source_hash_rows
from kvcanary_kernels.records import Half
from pytest_kvcanary.adapters.vllm.layout import Order, cpu_attn_half, half_views, probe, slot_bytes

from .support import INSTALL

BLOCKS, BS, HEADS, D = 6, 32, 3, 16


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
    "cpu_attn_dim_pairs": ((BLOCKS, HEADS, BS, 2 * D), cpu_attn(Order.DIM_PAIRS),
                           lambda c, b, t: c.view(BLOCKS, HEADS, 2, BS // 16, D // 2, 16, 2)[b, :, 0, t // 16, :, t % 16],
                           True),
    "cpu_attn_token_pairs": ((BLOCKS, HEADS, BS, 2 * D), lambda c: cpu_attn_half(c, Half.V, Order.TOKEN_PAIRS),
                             lambda c, b, t: c.view(BLOCKS, HEADS, 2, D // 16, BS // 2, 16, 2)[b, :, 1, :, t // 2, :, t % 2],
                             True),
    "dimension_pairs": ((BLOCKS, HEADS, D // 2, BS, 2), lambda c: c.permute(0, 3, 1, 2, 4),
                        lambda c, b, t: c[b, :, :, t], True),
    # not read: every other row of a block
    "every_other_row": ((BLOCKS, 2 * BS, D), lambda c: c[:, ::2], lambda c, b, t: c[b, 2 * t], False),
}


def _slot(view: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Slot (b, t) of a `slot_bytes` view, one slot axis or a tile axis and a slot-in-tile axis."""
    if math.prod(view.shape[1:3]) == BS and view.shape[1] != BS:
        return view[b, t // view.shape[2], t % view.shape[2]].flatten()
    return view[b, t].flatten()


def _slot_axes(name: str) -> int:
    return 2 if name in ("cpu_attn_dim_pairs", "cpu_attn_token_pairs") else 1


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_slot_gets_exactly_its_bytes(name):
    shape, half, elements, readable = LAYOUTS[name]
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    found = slot_bytes(half(cache), _slot_axes(name))
    assert found.readable is readable
    for view in found.views:
        assert view.shape[0] == BLOCKS and view.data_ptr() >= cache.data_ptr()
    for b in range(BLOCKS):
        for t in range(BS):
            assert torch.equal(torch.cat([_slot(v, b, t) for v in found.views]), elements(cache, b, t).flatten())


@pytest.mark.parametrize("real_data", ["partial", "all"])
@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout[3]])
def test_fingerprint_follows_each_slots_bytes(name, real_data):
    shape, half, elements, _ = LAYOUTS[name]
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sources = [layer_source(v, BS, real_data) for v in slot_bytes(half(cache), _slot_axes(name)).views]
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


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_vllms_amx_cache_write_is_found_and_read_in_both_halves(real_data):
    """vLLM's amx cache write (it only moves data, so it runs on any x86 CPU) packs K in 16-token
    tiles of dimension pairs and V in token pairs: the probe finds both orders through vLLM's own
    write, every slot's features come back from the views, and the fingerprint of a slot is the
    hash of what was written to it (what write-through compares)."""
    pytest.importorskip("vllm", reason=INSTALL)
    from vllm import _custom_ops as ops

    heads, bs, d = 2, 32, 32

    def update(layer, key, value, kv_cache, slot_mapping):
        blocks, h, b, _ = kv_cache.shape
        k_cache, v_cache = kv_cache.view(blocks, h, 2 * b, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, "amx")

    layer = SimpleNamespace(impl=SimpleNamespace(do_kv_cache_update=update))
    cache = torch.zeros(4, heads, bs, 2 * d, dtype=torch.bfloat16)
    orders = probe(layer, cache)
    assert orders == {Half.K: Order.DIM_PAIRS, Half.V: Order.TOKEN_PAIRS}
    views = half_views([cache], orders)
    assert views[Half.K].readable and len(views[Half.K].views) == heads  # a view per head
    assert views[Half.V].readable and len(views[Half.V].views) == heads * d // 16  # per head and 16 dimensions
    gen = torch.Generator().manual_seed(2)
    written = {half: torch.randn(bs, heads, d, generator=gen).to(torch.bfloat16) for half in Half}
    update(layer, written[Half.K], written[Half.V], cache, torch.arange(bs) + 2 * bs)  # block 2
    slots = torch.arange(2 * bs, 3 * bs)
    for half, rows in written.items():
        features = rows.reshape(bs, len(views[half].views), -1)  # each view's part of a token's K or V
        for i, view in enumerate(views[half].views):
            assert all(torch.equal(_slot(view, 2, t), features[t, i]) for t in range(bs))
            source = layer_source(view, bs, real_data)
            offset, stride = source.row_read()
            out = torch.empty(bs, dtype=torch.int64)
            source_hash_rows(features[:, i].contiguous(), source.read_bytes, out, sample_offset=offset,
                             sample_stride=stride)
            assert torch.equal(fingerprint_ref([source], slots), mix_torch(out)), (half, i)
