"""Invariants the reference engine enforces itself: the host tier's allocators know what they handed
out (a double free, or the free of a page never handed out, asserts, as the device pools do), a
slot's offset in its page is its position's (a misaligned write asserts), and a path loaded back
from host memory stays locked until the host tier acknowledges its copy (no eviction frees the
device pages a copy still writes, whatever stream the copies run on). Each test fails with its
check deleted."""

from __future__ import annotations

import random

import pytest
import torch

from pytest_kvcanary.reference_engine.kv_pool import ReqToTokenPool


def test_a_host_page_freed_twice_or_never_handed_out_asserts(make_engine):
    tier = make_engine("mha", page_size=4, num_slots=48, host_num_slots=64).host_tier
    pages = tier.alloc(2)
    tier.free(pages, "written back, then dropped")
    with pytest.raises(AssertionError, match="bad host free"):
        tier.free(pages, "dropped again")
    with pytest.raises(AssertionError, match="bad host free"):
        tier.free(torch.tensor([int(tier.free_pages[0])]), "never handed out")
    held = tier.alloc(2)
    with pytest.raises(AssertionError, match="bad host free"):
        tier.free(torch.cat([held[:1], held[:1]]), "one page twice in one free")
    tier.free(held, "each once")
    assert tier.free_pages.numel() == tier.num_pages


def test_a_host_state_slot_freed_twice_or_never_handed_out_asserts(make_engine):
    tier = make_engine("hybrid", page_size=4, num_slots=48, host_num_slots=64, num_state_slots=24).host_tier
    slot = tier.alloc_state()
    tier.free_state(slot, "checkpoint dropped")
    with pytest.raises(AssertionError, match="bad host state free"):
        tier.free_state(slot, "dropped again")
    with pytest.raises(AssertionError, match="bad host state free"):
        tier.free_state(tier.free_state_slots[-1], "never handed out")


def test_a_slot_misaligned_in_its_page_asserts():
    table = ReqToTokenPool(2, 64, torch.device("cpu"), page_size=4)
    table.write(0, 5, torch.tensor([9, 10, 11, 12]))  # positions 5..8: offsets 1, 2, 3, 0
    assert table.read(0, 5, 9).tolist() == [9, 10, 11, 12]
    with pytest.raises(AssertionError, match="slot misaligned in its page"):
        table.write(1, 1, torch.tensor([8]))  # position 1 at offset 0 of page 2
    with pytest.raises(AssertionError, match="slot misaligned in its page"):
        table.write(1, 4, torch.tensor([16, 18]))  # position 5 at offset 2


class _Copy:
    """A load-back's copy as the host tier tracks it, still in flight until `done`."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_loaded_back_path_stays_locked_until_its_copy_is_acknowledged(make_engine):
    """A prompt's pages go to host memory and come back; its one-token request finishes in the
    forward that loads them back. While that copy is in flight (held back here, as a copy stream of
    its own would), the path stays locked and no eviction frees its device pages; once the copy is
    acknowledged, they may go. (Mutation: unlocking before the copy starts, as the scheduler did.)"""
    engine = make_engine("mha", page_size=4, num_slots=48, max_running=2, host_num_slots=256)
    tier, cache = engine.host_tier, engine.radix_cache
    rng = random.Random(0)
    first = [rng.randrange(1, 256) for _ in range(20)]
    engine.generate([first], 1)
    for _ in range(3):  # other prompts push it out of the 11-page pool, into host memory
        engine.generate([[rng.randrange(1, 256) for _ in range(30)]], 1)
    node = next(n for n in cache.roots[0].children.values() if n.key[:4] == first[:4])
    assert node.value is None and node.host_value is not None, "the first prompt was not written back"

    copies: list[_Copy] = []
    load_back = tier.load_back

    def in_flight(host_slots, device_slots, on_done=None):
        load_back(host_slots, device_slots)
        copies.append(_Copy())
        if on_done is not None:
            tier._pending.append((copies[-1], on_done, 0))  # no jitter delay

    tier.load_back = in_flight
    req = engine.submit(first + [7], 1)
    engine.step()  # loads the pages back; the request finishes in this forward
    assert req.finished and copies and node.value is not None
    assert node.lock_ref > 0, "the loaded-back path was unlocked while its copy was in flight"
    loaded = node.value.clone()
    assert cache.evict(engine.pools.full.num_slots) >= 0 and torch.equal(node.value, loaded)

    copies[-1].done = True
    tier.acknowledge()
    assert node.lock_ref == 0
    cache.evict(engine.pools.full.num_slots)
    assert node.value is None, "an acknowledged path stays pinned"

