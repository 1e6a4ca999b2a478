"""The engine as a GuardedEngine: pool groups and their mappings, capacities, the cache walk, and
the forward hooks."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD, GroupKind
from pytest_kvcanary.canary.seam import ForwardHooks, missing_methods


@pytest.mark.parametrize("attention", ["mha", "swa", "mla"])
def test_canary_groups_cover_the_pools(attention, make_engine):
    engine = make_engine(attention, num_slots=64, swa_num_slots=32)
    assert missing_methods(engine) == []
    groups = engine.canary_groups()
    assert [g.kind for g in groups] == ([GroupKind.FULL, GroupKind.SWA] if attention == "swa" else [GroupKind.FULL])
    full = groups[0]
    table = engine.req_to_token_pool.table
    assert full.num_slots == 64 and full.page_size == 1 and full.window is None
    assert full.mapping.table is table and full.mapping.kind == "token_table"
    assert table.shape == (engine.config.max_running, engine.config.model.max_context)
    assert all(k is p for k, p in zip(full.k_layers, engine.pools.full.k_layers))
    assert sum(len(g.k_layers) for g in groups) == engine.config.model.num_layers
    if attention == "mla":  # one latent half
        model = engine.config.model
        assert full.v_layers == [] and full.k_layers[0].shape == (64, model.kv_lora_rank + model.qk_rope_head_dim)
    if attention == "swa":
        swa = groups[1]
        assert swa.num_slots == 32 and swa.window == engine.config.model.window
        assert swa.mapping.table is table
        assert swa.mapping.full_to_group is engine.pools.swa.full_to_swa and swa.mapping.full_to_group.shape == (64,)
        assert swa.k_layers[0].shape == (32, engine.config.model.num_kv_heads, engine.config.model.head_dim)
    caps = engine.canary_capacities()
    assert (caps.max_batch, caps.max_tokens, caps.max_context) == (engine.config.max_running,
                                                                   engine.config.max_batch_tokens,
                                                                   engine.config.model.max_context)


def test_cache_walk_chains_cached_tokens(make_engine):
    engine = make_engine("mha")
    prompts = [list(b"shared prefix A"), list(b"shared prefix B")]
    outputs = engine.generate(prompts, 3)
    walk = engine.cache_walk()
    record = {s: (p, prev, t) for s, p, prev, t in zip(*(x.tolist() for x in walk[:4]))}
    assert len(record) == walk.slots.numel() == len(b"shared prefix ") + 2 * (1 + 2)
    assert not walk.locked.any()
    for p, out in zip(prompts, outputs):
        tokens = (p + out)[:-1]
        path = engine.radix_cache.match_prefix(tokens).slots.tolist()
        assert [record[s] for s in path] == [(i, path[i - 1] if i else PREV_CHAIN_HEAD, t) for i, t in enumerate(tokens)]


def test_hooks_detach(make_engine, shadow_canary):
    engine = make_engine("mha")
    canary = shadow_canary(engine)
    engine.generate([list(b"hello")], 2)
    assert len(canary.views) == 2 and engine.forward_count == 2
    engine.set_forward_hooks(None)
    engine.generate([list(b"hello")], 2)
    assert len(canary.views) == 2 and engine.forward_count == 4


def test_hooks_see_the_damage_corruption_does(make_engine, assert_reference):
    """A hook that scribbles over one prefix slot's K/V must change the greedy outputs: the
    reference comparison above would notice KV errors."""

    class Scribble(ForwardHooks):
        def before_forward(self, view):
            if view.prefix_lens.tolist() == [8]:  # the first decode step
                slot = engine.req_to_token_pool.table[view.rows[0], 3]
                for k in engine.pools.full.k_layers + engine.pools.full.v_layers:
                    k[slot] = torch.randn_like(k[slot]) * 10

    engine = make_engine("mha")
    prompt = list(b"scribble")
    clean = engine.generate([prompt], 8)
    engine.reset()
    engine.set_forward_hooks(Scribble())
    dirty = engine.generate([prompt], 8)
    assert dirty[0][0] == clean[0][0] and dirty != clean
    with pytest.raises(AssertionError):
        assert_reference(engine, [prompt], dirty)


@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_a_raising_hook_leaves_the_engine_usable(when, make_engine, random_prompts, assert_reference,
                                                 check_invariants):
    """A canary in raise mode raises from a hook: the batch is undone, nothing leaks, and the
    engine can go on (or be reset)."""

    class RaiseOnSeventh(ForwardHooks):
        calls = 0

        def before_forward(self, view):
            self.hook("before_forward")

        def after_forward(self, view):
            self.hook("after_forward")

        def hook(self, name):
            if name == when:
                self.calls += 1
                if self.calls == 7:
                    raise RuntimeError("violation")

    engine = make_engine("swa")
    prompts = random_prompts(4, 4)
    reqs = [engine.submit(p, 8) for p in prompts]
    engine.set_forward_hooks(RaiseOnSeventh())
    with pytest.raises(RuntimeError, match="violation"):
        while engine.scheduler.has_work:
            engine.step()
    check_invariants(engine)
    assert not engine.running and len(engine.scheduler.waiting) > 0
    while engine.scheduler.has_work:
        engine.step()
    assert_reference(engine, prompts, [r.output_ids for r in reqs])
    engine.submit(prompts[0], 4)
    engine.step()
    engine.reset()
    assert engine.pools.full.num_free == engine.pools.full.num_slots - 1
    assert engine.pools.swa.num_free == engine.pools.swa.num_slots - 1
