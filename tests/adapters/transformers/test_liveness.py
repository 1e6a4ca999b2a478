"""The transformers adapter's prefix cache as the stock tests see it: declared only where
transformers shares prefixes (not for a model with sliding-window layers), and its hits counted
(`liveness`, the soak's gate) once a request reuses a cached prefix."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from pytest_kvcanary.canary.seam import capabilities_of  # noqa: E402

from .support import make_engine  # noqa: E402


def test_only_a_model_that_shares_prefixes_declares_a_prefix_cache():
    assert capabilities_of(make_engine("mha", page_size=16)).prefix_cache
    swa = make_engine("swa", page_size=16)
    assert not capabilities_of(swa).prefix_cache and swa.cache_walk() is None


def test_a_prompt_served_again_is_one_prefix_hit():
    engine = make_engine("mha", page_size=16)
    rng = random.Random(2)
    prompt = [rng.randrange(1, 256) for _ in range(3 * 16 + 5)]
    engine.generate([prompt], 2)
    assert engine.liveness() == {"prefix hits": 0}
    engine.generate([prompt], 2)  # its first 3 blocks are cached now
    assert engine.liveness() == {"prefix hits": 1}
