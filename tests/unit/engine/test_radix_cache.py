"""RadixCache on its own: match / insert / split, locks, LRU eviction, SWA eviction, walk."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD
from pytest_kvcanary.reference_engine.config import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.kv_pool import KVPools, ReqToTokenPool, page_slots
from pytest_kvcanary.reference_engine.radix_cache import RadixCache


def _cache(attention: str = "mha") -> RadixCache:
    config = EngineConfig(model=ModelConfig(attention=attention, window=2, max_context=32), num_slots=32,
                          swa_num_slots=32, max_batch_tokens=32)
    pools = KVPools(config)
    return RadixCache(pools, ReqToTokenPool(2, 32, torch.device("cpu")), 2 if attention == "swa" else None)


def _put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert key with fresh slots, freeing the duplicates as a request would; returns its slots."""
    slots = cache.pools.alloc(len(key))
    res = cache.insert(key, slots)
    cache.pools.free(slots[:res.prefix_len], "test")
    return cache.match_prefix(key).slots


def test_match_insert_split():
    cache = _cache()
    abc = _put(cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == abc.tolist()
    m = cache.match_prefix([1, 2, 9])
    assert m.slots.tolist() == abc[:2].tolist() and m.node.key == [1, 2]  # split at the match
    res = cache.insert([1, 2, 7, 8], cache.pools.alloc(4))
    assert res.prefix_len == 2 and res.node.key == [7, 8] and res.node.parent is m.node
    assert cache.match_prefix([5]).slots.numel() == 0 and cache.match_prefix([5]).node is cache.root()


def test_evict_lru_leaves_and_respects_locks():
    cache = _cache()
    _put(cache, [1, 2, 3])
    _put(cache, [1, 2, 4])
    _put(cache, [5, 6])
    locked = cache.match_prefix([1, 2, 4]).node
    cache.lock(locked)
    cache.match_prefix([5, 6])  # most recently used now
    free = cache.pools.full.num_free
    assert cache.evict(0) == 0
    assert cache.evict(1) == 1  # the LRU unlocked leaf: [3]
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 2
    assert cache.evict(100) == 2  # [5, 6]; [1, 2] and [4] are locked
    assert cache.pools.full.num_free == free + 3 and cache.num_evicted == 3
    cache.unlock(locked)
    assert cache.evict(100) == 3 and not cache.root().children
    with pytest.raises(AssertionError):
        cache.unlock(locked)


def test_walk_lists_every_cached_slot_with_its_predecessor():
    cache = _cache()
    a = _put(cache, [1, 2, 3])
    b = _put(cache, [1, 2, 4, 5])
    cache.lock(cache.match_prefix([1, 2, 4, 5]).node)
    walk = cache.walk()
    rows = {s: (p, prev, t, lk) for s, p, prev, t, lk in zip(*(x.tolist() for x in walk[:5]))}
    assert sorted(rows) == sorted(set(a.tolist() + b.tolist()))
    assert rows[a[0].item()] == (0, PREV_CHAIN_HEAD, 1, True)
    assert rows[a[2].item()] == (2, a[1].item(), 3, False)
    assert rows[b[2].item()] == (2, b[1].item(), 4, True) and rows[b[3].item()] == (3, b[2].item(), 5, True)
    assert _cache().walk().slots.numel() == 0


def test_evict_swa_tombstones_and_match_needs_a_resident_window():
    cache = _cache("swa")
    slots = _put(cache, [1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2])  # split: [1, 2] | [3, 4, 5, 6]
    cache.match_prefix([1, 2, 3, 4])  # split: [3, 4] | [5, 6]; [5, 6] is now the LRU node
    swa = cache.pools.swa
    assert cache.evict_swa(1) == 2
    assert cache.num_swa_evicted == 2 and not swa.full_to_swa[slots[4:]].any()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.numel() == 4
    cache.lock(cache.match_prefix([1, 2]).node)
    assert cache.evict_swa(100) == 2  # [3, 4]; the locked [1, 2] stays resident
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.numel() == 2
    assert swa.full_to_swa[slots[:2]].all() and swa.num_free == swa.num_slots - 1 - 2
    assert cache.evict(100) == 4 and cache.pools.full.num_free == cache.pools.full.num_slots - 1 - 2


def test_insert_below_swa_from_makes_tombstones():
    cache = _cache("swa")
    slots = cache.pools.alloc(5)
    cache.pools.swa.unmap(slots[:3], "test")  # a request whose first 3 tokens slid out of the window
    res = cache.insert([1, 2, 3, 4, 5], slots, swa_from=3)
    assert res.prefix_len == 0 and res.node.key == [4, 5] and not res.node.tombstone
    assert res.node.parent.key == [1, 2, 3] and res.node.parent.tombstone
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.numel() == 5  # 2 = window resident tokens at the end
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 0


def _same_walk(a, b) -> bool:
    """Two walks list the same entries (in any order)."""
    def rows(walk) -> list[tuple]:
        return sorted(zip(*(column.tolist() for column in walk)))
    return rows(a) == rows(b)


@pytest.mark.parametrize("attention, engine_kw", [
    ("mha", {"num_slots": 48, "max_running": 2}),  # device evictions out of the tree
    ("mha", {"page_size": 4, "num_slots": 48, "max_running": 2, "host_num_slots": 64}),  # write-back, load-back
    ("hybrid", {"page_size": 4, "num_slots": 96, "max_running": 2, "num_state_slots": 8}),  # checkpoints
])
def test_walks_are_reused_until_the_cache_changes_and_are_never_stale(make_engine, attention, engine_kw):
    """The walks the canary plans from come back as the same objects while nothing changed (so
    it plans them once), and after every step equal walks taken afresh: every change of a node,
    its slots, a lock or a checkpoint is seen."""
    from tests.unit.engine.conftest import random_prompts
    engine = make_engine(attention, **engine_kw)
    cache = engine.radix_cache
    for prompt in random_prompts(3, 10, shared=9):
        engine.submit(prompt, 5)
    walks = []
    while engine.scheduler.has_work:
        engine.step()
        walks.append(cache.walk())
        assert _same_walk(walks[-1], cache._walk_nodes())
        if engine.states is not None:
            assert _same_walk(cache.checkpoint_walk(), cache._walk_checkpoints())
    assert any(a is b for a, b in zip(walks, walks[1:])), "no step left the cache as it was"


def test_each_change_of_the_trees_makes_a_fresh_walk(make_engine):
    """Every kind of change on its own, the walk taken just before it: the next walk is not the
    stale one (inserts, splits, locks, unlocks, evictions, load-backs, checkpoints dropped)."""
    engine = make_engine("mha", page_size=2, num_slots=64, host_num_slots=64)
    cache = engine.radix_cache

    def after(change) -> None:
        cache.walk()  # primed
        change()
        assert _same_walk(cache.walk(), cache._walk_nodes())

    slots = engine.pools.alloc(3)
    after(lambda: cache.insert([1, 2, 3, 4, 5, 6], page_slots(slots, 2)))  # a node added
    matched = []
    after(lambda: matched.append(cache.match_prefix([1, 2, 3, 4, 9, 9]).node))  # split at the match
    node = matched[0]
    after(lambda: cache.lock(node))
    after(lambda: cache.unlock(node))
    after(lambda: cache.evict(2))  # written back to host memory: off the device
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(match.host_node)
    after(lambda: cache.load_back(match, engine.pools.alloc(1)))
    engine.host_tier.wait()
    after(lambda: cache.evict(100))  # locked: stays
    cache.unlock(match.host_node)
    engine.host_tier.acknowledge()
    after(lambda: cache.evict(100))
    assert cache.walk().slots.numel() == 0
