"""A request's context (cache salt / adapter id) changes its KV, and KV is shared within a context only."""

from __future__ import annotations

import pytest
import torch


def _reference(engine, prompt, out, context_key):
    ids = torch.tensor(prompt + out[:-1], device=engine.device)
    return engine.model.logits_without_cache(ids, context_key).argmax(-1)[len(prompt) - 1:].tolist()


@pytest.mark.parametrize("decode_mode", ["eager", "padded"])
def test_same_tokens_in_other_contexts_get_their_own_kv(make_engine, decode_mode):
    engine = make_engine("mha", decode_mode=decode_mode)
    prompt = list(b"one prompt, three contexts")
    first = engine.generate([prompt] * 3, 6, context_keys=[0, 7, 9])
    again = engine.generate([prompt] * 3, 6, context_keys=[9, 0, 7])  # each hits its own context's cache
    assert [again[1], again[2], again[0]] == first
    for out, key in zip(first, [0, 7, 9]):
        assert out == _reference(engine, prompt, out, key)
    assert len({tuple(o) for o in first}) > 1, "the adapter offset must change what the model computes"
    walk = engine.cache_walk()
    assert set(walk.context_keys.tolist()) == {0, 7, 9}
    per_context = {k: set(walk.slots[walk.context_keys == k].tolist()) for k in (0, 7, 9)}
    assert not per_context[0] & per_context[7] and not per_context[7] & per_context[9]


def test_a_bad_context_key_names_the_argument(make_engine):
    engine = make_engine("mha")
    with pytest.raises(ValueError, match=r"context_key must be an integer in \[0, 2\*\*62\); got -1"):
        engine.submit([1, 2], 2, context_key=-1)
    with pytest.raises(ValueError, match=r"context_keys must hold one key per prompt \(2\); got 1"):
        engine.generate([[1], [2]], 2, context_keys=[3])
