"""Write-through on transformers: each layer's computed K/V reaches the canary at the paged cache's
update, so a store to the wrong slot in a fresh prefill (the full-attention store one slot early,
the transformers #37574 class) is reported at TAIL of that forward at every slot it damaged, and
nothing is reported without the fault."""

from __future__ import annotations

import pytest
import torch

from .support import INSTALL, make_handle

pytest.importorskip("transformers", reason=INSTALL)

# The fault is patched into the full-attention allocator of transformers' sector layout (5.18+).
full_attention = pytest.importorskip("transformers.generation.continuous_batching.cache_allocators.full_attention",
                                     reason="the early-store fault patches transformers >= 5.18's cache allocator")

PROMPT = [7 + i for i in range(40)]  # 40 tokens: one fresh prefill over three pages of 16


@pytest.fixture
def early_store(monkeypatch):
    """Make the full-attention store of a prefill without cache reads write every token one slot
    early; record (layer, canary slots the forward meant, the K it computed, the K those slots
    hold). The allocator's token rows are block * block_physical_stride + offset (layer 0's K)."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    update = full_attention.FullAttentionCacheAllocator.update

    def shifted(self, key_states, value_states, layer_idx, read_index, write_index):
        if read_index.numel() != 0:
            return update(self, key_states, value_states, layer_idx, read_index, write_index)
        out = update(self, key_states, value_states, layer_idx, read_index, write_index - 1)
        k_cache, _ = self._kv_token_views[layer_idx]
        page, stride = self.tokens_per_page, self.block_physical_stride
        slots = write_index // stride * page + write_index % page
        seen.append((layer_idx, slots, key_states.clone(), k_cache[write_index].clone()))
        return out

    monkeypatch.setattr(full_attention.FullAttentionCacheAllocator, "update", shifted)
    return seen


def tail_write_violations(handle) -> list:
    handle.side.runtime.drain()
    return [v for v in handle.violations() if v.phase == "TAIL" and "write_real_kv_hash" in v.reasons]


def test_store_one_slot_early_is_reported_at_tail_of_the_prefill(early_store):
    handle = make_handle("mha")
    handle.generate([PROMPT], max_new_tokens=1)
    layer, slots, computed, held = early_store[0]
    assert layer == 0
    assert not torch.equal(computed, held)  # the damage itself, by bytes: the slots hold other K
    found = tail_write_violations(handle)
    assert found, handle.violations()[:3]
    assert {v.step for v in found} == {0}  # the prefill itself
    assert {v.slot for v in found} == set(slots.tolist())
    assert {v.position for v in found} == set(range(len(PROMPT)))


def test_clean_prefill_reports_nothing():
    handle = make_handle("mha")
    handle.generate([PROMPT, PROMPT[:21]], max_new_tokens=4)
    handle.side.runtime.drain()
    assert handle.violations() == []


def test_without_write_through_the_early_store_is_stamped_as_correct(early_store):
    handle = make_handle("mha", write_through=False)
    handle.generate([PROMPT], max_new_tokens=1)
    assert early_store and tail_write_violations(handle) == []
