"""Slot allocators, the SWA map and the req_to_token table."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.reference_engine.config import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.kv_pool import KVPool, KVPools, ReqToTokenPool


def test_alloc_free_never_hands_out_slot_zero():
    pool = KVPool(5, 2, ModelConfig(num_kv_heads=2, head_dim=16), torch.device("cpu"))
    assert pool.k_layers[0].shape == (5, 2, 16) and len(pool.v_layers) == 2
    slots = pool.alloc(4)
    assert sorted(slots.tolist()) == [1, 2, 3, 4] and pool.alloc(1) is None and pool.num_free == 0
    pool.free(slots[:2])
    assert pool.num_free == 2 and sorted(pool.alloc(2).tolist()) == sorted(slots[:2].tolist())
    pool.free(slots[2:3])
    for bad in (slots[2:3], torch.tensor([0]), slots[3:4].repeat(2)):
        with pytest.raises(AssertionError, match="bad free"):
            pool.free(bad)


def test_pools_keep_full_and_swa_in_step():
    config = EngineConfig(model=ModelConfig(attention="swa", num_layers=4, full_every=2), num_slots=10, swa_num_slots=4)
    pools = KVPools(config)
    assert config.model.layer_groups == (GroupKind.SWA, GroupKind.FULL) * 2
    assert len(pools.full.k_layers) == 2 and len(pools.swa.k_layers) == 2
    assert pools.layer(1).k is pools.full.k_layers[0] and pools.layer(1).slot_map is None
    assert pools.layer(2).k is pools.swa.k_layers[1] and pools.layer(2).slot_map is pools.swa.full_to_swa
    a = pools.alloc(3)
    swa_a = pools.swa.full_to_swa[a]
    assert swa_a.unique().numel() == 3 and (swa_a > 0).all()
    assert pools.alloc(2) is None and pools.full.num_free == 6, "a failed alloc must hold nothing"
    assert pools.swa.unmap(a[:2], "test") == 2 and not pools.swa.full_to_swa[a[:2]].any()
    b = pools.alloc(2)
    pools.swa.move(b[:1], a[:1])
    assert pools.swa.full_to_swa[a[0]] > 0 and pools.swa.full_to_swa[b[0]] == 0
    pools.free(torch.cat([a, b]), "test")
    assert pools.full.num_free == 9 and pools.swa.num_free == 3 and not pools.swa.full_to_swa.any()


def test_mla_pool_holds_one_latent_row_per_slot_and_layer():
    model = ModelConfig(attention="mla", num_layers=3, kv_lora_rank=24, qk_rope_head_dim=8)
    pools = KVPools(EngineConfig(model=model, num_slots=10))
    assert pools.swa is None and pools.full.v_layers == []
    assert [t.shape for t in pools.full.k_layers] == [(10, 32)] * 3
    layer = pools.layer(2)
    assert layer.v is None and layer.group is GroupKind.FULL and layer.index == 2
    assert layer.k.shape == (10, 1, 32) and layer.k.data_ptr() == pools.full.k_layers[2].data_ptr()
    slots = pools.alloc(2)
    layer.k[slots] = torch.ones(2, 1, 32)
    assert pools.full.k_layers[2][slots].eq(1).all(), "the one-head view writes the latent buffer"


def test_req_to_token_rows_and_reads_are_copies():
    table = ReqToTokenPool(2, 8, torch.device("cpu"))
    r0, r1 = table.alloc(), table.alloc()
    assert {r0, r1} == {0, 1} and table.alloc() is None
    table.write(r0, 2, torch.tensor([5, 6, 7]))
    got = table.read(r0, 2, 5)
    table.write(r0, 2, torch.tensor([1, 1, 1]))
    assert got.tolist() == [5, 6, 7]
    table.free(r0)
    with pytest.raises(AssertionError):
        table.free(r0)
    assert table.alloc() == r0


def test_rows_written_together_map_as_each_written_alone_and_misaligned_slots_assert():
    one, many = (ReqToTokenPool(3, 12, torch.device("cpu"), page_size=4) for _ in range(2))
    writes = [(0, 0, torch.tensor([8, 9, 10, 11, 20])), (2, 6, torch.tensor([14, 15, 28])), (1, 3, torch.tensor([]))]
    for row, start, slots in writes:
        one.write(row, start, slots.long())
    many.write_rows(*zip(*[(row, start, slots.long()) for row, start, slots in writes]))
    assert torch.equal(one.table, many.table) and many.read(2, 6, 9).tolist() == [14, 15, 28]
    with pytest.raises(AssertionError, match="misaligned"):
        many.write_rows([0, 1], [0, 1], [torch.tensor([4]), torch.tensor([4])])
