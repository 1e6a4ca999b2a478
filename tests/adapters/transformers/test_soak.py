"""Canary baseline on transformers: over a thousand requests with shared prefixes, exact duplicates
in one batch and a cache too small for what they want, the canary (every forward, a sweep every 2)
reports nothing, while the engine's own bookkeeping shows prefix hits, block de-duplication,
eviction and offloaded (soft-reset) requests all happened. Every freed block is announced before
any live request could still read it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from .support import INSTALL, make_handle, prompts_with_shared_prefixes, stems

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb.versions import (  # noqa: E402
    CAUSE_DEDUPLICATED, CAUSE_EVICTED, CAUSE_RELEASED,
)

REQUESTS = 1024
PER_WAVE = 16


def test_a_thousand_requests_under_cache_pressure_raise_nothing():
    # 16 blocks of 16 tokens: room for three or four requests of up to 80 tokens beside eight
    # wanting to run, so cached blocks are evicted and running requests offloaded.
    handle = make_handle("mha", num_blocks=16, max_batch_tokens=128)
    engine = handle.engine
    cache = engine.processor.cache
    causes: Counter[str] = Counter()

    def on_free(kind, slots, cause):
        blocks = set((slots // engine.page_size).tolist())
        live = {b for state in engine.processor.scheduler.active_requests.values()
                for b in engine.layout.block_ids(engine.groups[0], state.request_id)}
        assert not blocks & live, f"freed blocks {sorted(blocks & live)} still in a live request's table ({cause})"
        causes[cause] += 1

    engine.add_free_listener(on_free)
    prefix_hits = Counter()
    search = cache.search_prefix_match

    def counted_search(request_id, prompt_ids):
        matched = search(request_id, prompt_ids)
        prefix_hits[matched > 0] += 1
        return matched

    cache.search_prefix_match = counted_search
    offloaded = 0
    scheduler, offloading = engine.processor.scheduler, engine.processor.offloading_manager
    offload = offloading.offload_requests

    def counted_offload():
        nonlocal offloaded
        running = len(scheduler.active_requests)
        result = offload()
        offloaded += running - len(scheduler.active_requests)
        return result

    offloading.offload_requests = counted_offload

    rng = random.Random(0)
    shared = stems(rng, count=6)
    served = 0
    while served < REQUESTS:
        prompts = prompts_with_shared_prefixes(rng, PER_WAVE, shared)
        max_new_tokens = rng.randrange(1, 17)
        outputs = handle.generate(prompts, max_new_tokens=max_new_tokens)
        assert all(0 < len(out) <= max_new_tokens for out in outputs)
        served += len(prompts)

    handle.side.runtime.drain()
    assert handle.violations() == []
    stats = handle.stats()["single"]
    assert stats["health"] == "ok" and stats["sweeps"] > 0 and stats["protected_tokens"] > 0
    assert prefix_hits[True] > 100, prefix_hits
    assert causes[CAUSE_DEDUPLICATED] > 10, causes
    assert causes[CAUSE_EVICTED] > 10, causes
    assert offloaded > 10
    assert causes[CAUSE_RELEASED] > REQUESTS // 2, causes
