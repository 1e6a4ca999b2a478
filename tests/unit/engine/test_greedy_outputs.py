"""Greedy outputs with paged KV + radix cache equal a no-cache recomputation, under memory
pressure (eviction, retraction) and with a shadow canary checking every slot each forward reads."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("attention", ["mha", "swa", "mla"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_with_roomy_pools(attention, seed, make_engine, random_prompts, assert_reference,
                                            shadow_canary):
    engine = make_engine(attention, seed=seed)
    canary = shadow_canary(engine)
    prompts = random_prompts(seed, 6)
    outputs = engine.generate(prompts, 12)
    assert_reference(engine, prompts, outputs)
    assert engine.scheduler.num_retracted == 0 and engine.radix_cache.num_evicted == 0
    assert any(v.prefix_lens.max() > 0 and v.extend_lens.max() > 1 for v in canary.views), "no prefix reuse"
    assert len({t for out in outputs for t in out}) > 10, "outputs too uniform to tell KV errors apart"


@pytest.mark.parametrize("attention", ["mha", "swa", "mla"])
def test_matches_reference_under_memory_pressure(attention, make_engine, random_prompts, assert_reference,
                                                 shadow_canary, check_invariants):
    engine = make_engine(attention, num_slots=56, swa_num_slots=40, max_running=4)
    shadow_canary(engine)
    prompts = random_prompts(2, 8)
    outputs = engine.generate(prompts, 16)
    check_invariants(engine)
    assert_reference(engine, prompts, outputs)
    assert engine.scheduler.num_retracted > 0, "no retraction happened"
    assert engine.radix_cache.num_evicted > 0, "no eviction happened"
    if attention == "swa":
        assert engine.radix_cache.num_swa_evicted > 0, "no SWA eviction happened"


def test_continuous_batching_and_reset(make_engine, random_prompts, assert_reference, check_invariants):
    engine = make_engine("swa", max_running=3)
    prompts = random_prompts(3, 5)
    reqs = [engine.submit(p, 6 + i) for i, p in enumerate(prompts)]
    finished = []
    while engine.scheduler.has_work:
        finished += engine.step()
        check_invariants(engine)
        assert len(engine.running) <= 3
    assert sorted(r.rid for r in finished) == [r.rid for r in reqs]
    assert_reference(engine, prompts, [r.output_ids for r in reqs])
    assert engine.step() == []

    engine.submit(prompts[0], 4)
    engine.step()
    engine.reset()
    assert not engine.scheduler.has_work and not engine.cache_walk().slots.numel()
    assert engine.pools.full.num_free == engine.pools.full.num_slots - 1
    assert engine.pools.swa.num_free == engine.pools.swa.num_slots - 1
    assert engine.generate([prompts[0]], 6) == [reqs[0].output_ids]


def test_duplicate_prompts_in_one_batch_are_deduplicated(make_engine, assert_reference, shadow_canary,
                                                         check_invariants):
    engine = make_engine("mha")
    canary = shadow_canary(engine)
    prompt = list(b"the same prompt, twice")
    a, b = engine.submit(prompt, 5), engine.submit(prompt, 5)
    engine.step()
    view = canary.views[0]
    assert view.rows.tolist() == [a.row, b.row] and view.extend_lens.tolist() == [len(prompt)] * 2
    a_slots, b_slots = canary.written[0].split(len(prompt))
    table = engine.req_to_token_pool
    assert table.read(a.row, 0, len(prompt)).tolist() == a_slots.tolist()
    assert table.read(b.row, 0, len(prompt)).tolist() == a_slots.tolist(), "B's row not rewritten to A's slots"
    assert set(b_slots.tolist()) <= set(engine.pools.full.free_slots.tolist()), "B's duplicates not freed"
    assert b.prefix_len == a.prefix_len == len(prompt) and b.last_node is a.last_node
    assert a.last_node.lock_ref == 2
    check_invariants(engine)
    while engine.scheduler.has_work:
        engine.step()
    assert a.output_ids == b.output_ids
    assert_reference(engine, [prompt], [a.output_ids])
