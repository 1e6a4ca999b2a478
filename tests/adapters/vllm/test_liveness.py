"""The vLLM adapter's liveness count (the soak's gate reads it): a request vLLM's scheduler admits
with a cached prefix is one prefix hit, and only such a request, as vLLM's own prefix-cache
counters agree."""

from __future__ import annotations

import random

import pytest

from .support import INSTALL, PrefixCacheCounter

pytest.importorskip("vllm", reason=INSTALL)


def test_a_prompt_served_again_is_one_prefix_hit(engine, monkeypatch):
    vllm_counts = PrefixCacheCounter(engine, monkeypatch)
    engine.reset()
    rng = random.Random(4)
    prompt = [rng.randrange(1, 256) for _ in range(3 * engine.block_size + 5)]
    before = engine.liveness()["prefix hits"]
    engine.generate([prompt], 2)
    assert engine.liveness()["prefix hits"] == before and vllm_counts.hits == 0
    engine.generate([prompt], 2)  # its first 3 blocks are cached now
    assert engine.liveness()["prefix hits"] == before + 1 and vllm_counts.hits > 0
