"""Write-through on vLLM: the adapter reports what each layer's cache write was handed, so a store
that lands one slot early in a fresh prefill is reported at TAIL of that very forward, at the slots
it wrote, in K and V, and the same prefill without the fault is clean. A forward whose slot mapping is empty
reports nothing (no vLLM needed for that one)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvcanary_kernels.records import GroupKind, Half
from pytest_kvcanary.adapters.vllm.write_through import WriteThrough, rows_by_slot

from .support import INSTALL, ViewRecorder, make_engine, make_handle, unsupported


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm", reason=INSTALL)
    return make_engine("mha")


def test_an_empty_slot_mapping_reports_no_rows():
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    layer = SimpleNamespace(impl=SimpleNamespace(do_kv_cache_update=lambda *args: None))
    through = WriteThrough(lambda kind, index, k, v: written.append((k, v)))
    through.wrap(layer, GroupKind.FULL, 0, {Half.K: 1, Half.V: 1})
    through.start_forward(torch.tensor([0, 1]))
    nothing = torch.empty(0, 2, 16)
    layer.impl.do_kv_cache_update(layer, nothing, nothing, torch.empty(0), torch.empty(0, dtype=torch.int32))
    assert written == []


def test_slots_another_row_wrote_find_that_rows_tokens():
    """A row counting slots another row of the step computes takes write-through rows from the
    tokens vLLM stored there; a slot no token was stored in gives none."""
    slot_mapping = torch.tensor([70, 71, 72, 40, 41], dtype=torch.int32)
    assert rows_by_slot(slot_mapping, torch.tensor([71, 72, 40])).tolist() == [1, 2, 3]
    assert rows_by_slot(slot_mapping, torch.tensor([71, 73])) is None
    assert rows_by_slot(slot_mapping[:0], torch.tensor([71])) is None


def test_a_half_kept_in_parts_per_head_is_reported_part_by_part():
    """vLLM's amx path keeps V in 16-dimension parts per head (a view each): each part is reported
    as its own layer of that half, in view order, and K per head."""
    written: list[tuple[int, str, torch.Tensor]] = []

    def report(kind, index, k, v):
        assert (k is None) != (v is None)
        written.append((index, "K" if v is None else "V", k if v is None else v))

    layer = SimpleNamespace(impl=SimpleNamespace(do_kv_cache_update=lambda *args: None))
    through = WriteThrough(report)
    through.wrap(layer, GroupKind.FULL, 2, {Half.K: 1, Half.V: 2})  # the second layer of 2 heads
    through.start_forward(torch.tensor([0, 1]))
    key, value = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    layer.impl.do_kv_cache_update(layer, key, value, torch.empty(0), torch.tensor([40, 41]))
    assert [(i, half) for i, half, _ in written] == [(2, "K"), (4, "V"), (5, "V"), (3, "K"), (6, "V"), (7, "V")]
    rows = {(i, half): t for i, half, t in written}
    assert torch.equal(rows[5, "V"], value[:, 0, 16:]) and torch.equal(rows[3, "K"], key[:, 1])


def prefill(engine, real_data: str):
    handle = make_handle(engine, real_data=real_data, sweep_interval=0)
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(70)]  # blocks 32 + 32 + 6
    views = ViewRecorder(engine)
    handle.generate([prompt], 1)
    slots = views.written[0]
    return handle, slots


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_store_one_slot_early_is_reported_at_tail(engine, real_data, monkeypatch):
    from vllm import _custom_ops as ops

    store = ops.cpu_attn_reshape_and_cache

    def one_slot_early(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        if slot_mapping.numel() > 1:  # a prefill
            slot_mapping = slot_mapping - 1
        return store(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs)

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", one_slot_early)
    handle, slots = prefill(engine, real_data)
    monkeypatch.undo()
    tail = [v for v in handle.violations() if v.phase == "TAIL" and v.step == 0]
    assert tail, handle.violations()
    assert all(v.reasons[0] == "write_real_kv_hash" and v.slot in slots for v in tail), tail
    assert {v.half for v in tail} == {"K", "V"}, "K (dimension-major in vLLM's CPU cache) is checked too"


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_the_same_prefill_without_the_fault_is_clean(engine, real_data):
    handle, slots = prefill(engine, real_data)
    assert slots and handle.violations() == []


class OneSlotEarly:
    """vLLM's CPU MLA cache write, storing a prefill's latent rows one slot early while `on`; it
    keeps, per layer, the cache and a copy written by vLLM's own write at the right slots."""

    def __init__(self) -> None:
        self.on = False
        self.writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the cache, what it should hold)

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        store = CPUMLAImpl.do_kv_cache_update

        def one_slot_early(impl, kv_c_normed, k_pe, kv_cache, slot_mapping, *args):
            if not (self.on and slot_mapping.numel() > 1):  # a prefill only
                return store(impl, kv_c_normed, k_pe, kv_cache, slot_mapping, *args)
            meant = kv_cache.clone()
            store(impl, kv_c_normed, k_pe, meant, slot_mapping, *args)
            self.writes.append((kv_cache, meant))
            return store(impl, kv_c_normed, k_pe, kv_cache, slot_mapping - 1, *args)

        monkeypatch.setattr(CPUMLAImpl, "do_kv_cache_update", one_slot_early)


@pytest.fixture(scope="module")
def mla():
    """An MLA engine whose layers' cache write is OneSlotEarly (off until a test turns it on)."""
    pytest.importorskip("vllm", reason=INSTALL)
    if reason := unsupported("mla"):
        pytest.skip(reason)
    fault = OneSlotEarly()
    with pytest.MonkeyPatch.context() as mp:
        fault.patch(mp)
        yield make_engine("mla"), fault


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_mla_store_one_slot_early_is_reported_at_tail(mla, real_data):
    engine, fault = mla
    fault.on, fault.writes = True, []
    try:
        handle, slots = prefill(engine, real_data)
    finally:
        fault.on = False
    # The damage, by bytes: written slots holding other than vLLM's own write at the right slots.
    assert len(fault.writes) == len(engine.canary_groups()[0].k_layers)
    damaged = set()
    for cache, meant in fault.writes:
        rows, want = cache.flatten(0, -2), meant.flatten(0, -2)
        damaged |= {s for s in slots if not torch.equal(rows[s], want[s])}
    assert damaged == set(slots)
    tail = [v for v in handle.violations() if v.phase == "TAIL" and v.step == 0]
    assert {v.slot for v in tail} == damaged, handle.violations()
    assert all(v.half == "K" and v.reasons[0] == "write_real_kv_hash" for v in tail), tail


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_mla_the_same_prefill_without_the_fault_is_clean(mla, real_data):
    handle, slots = prefill(mla[0], real_data)
    assert slots and handle.violations() == []
