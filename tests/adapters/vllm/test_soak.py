"""A soak: hundreds of requests with shared prefixes through a small block pool (prefix-cache
hits, evictions, preemptions), the canary on with every byte it can read fingerprinted and a
sweep every 2 forwards: not one violation. That each pressure happened is asserted from vLLM's
own counters and from the blocks the adapter saw vLLM hand out again."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from .support import INSTALL, PrefixCacheCounter, make_engine, make_handle, prompts_with_shared_prefixes, stems

pytest.importorskip("vllm", reason=INSTALL)

REQUESTS = 320


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_soak_with_shared_prefixes_and_eviction_stays_clean(attention, monkeypatch):
    # 23 blocks of 32 tokens for up to 8 requests; with vLLM's hybrid KV cache manager (swa) the
    # pool also holds the sliding-window blocks, and must hold one request's of both kinds.
    engine = make_engine(attention, num_blocks=24 if attention == "mha" else 34)
    handle = make_handle(engine)
    frees: Counter[str] = Counter()
    engine.add_free_listener(lambda group, slots, cause: frees.update([cause]))
    hits = PrefixCacheCounter(engine, monkeypatch)
    preemptions = 0
    finished = engine.book.finished

    def counting(request, block_ids):  # vLLM's own count of each request's preemptions
        nonlocal preemptions
        preemptions += request.num_preemptions
        finished(request, block_ids)

    monkeypatch.setattr(engine.book, "finished", counting)
    rng = random.Random(0)
    shared = stems(rng)
    sent = batches = 0
    while sent < REQUESTS:
        prompts = prompts_with_shared_prefixes(rng, rng.randrange(4, 13), shared)
        # One batch decodes long enough that its running requests outgrow the pool.
        outputs = handle.generate(prompts, 48 if batches == 7 else rng.randrange(2, 7))
        assert all(len(o) == len(outputs[0]) for o in outputs)
        sent += len(prompts)
        batches += 1
    assert handle.violations() == []
    stats = handle.stats()["single"]
    assert stats["health"] == "ok" and stats["sweeps"] > 0 and stats["protected_tokens"] > REQUESTS * 40
    assert hits.hits > 0, "vLLM hit its prefix cache"
    assert frees["block reallocated"] > 0, "vLLM evicted cached blocks to reuse them"
    assert preemptions > 0, "vLLM preempted running requests"
    assert frees["request finished"] > 0 and frees["request preempted"] > 0
