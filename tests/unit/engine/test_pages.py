"""The reference engine with KV pages of several tokens: pools allocate whole pages, the radix cache
matches, inserts and evicts whole pages, and greedy outputs equal a no-cache recomputation with the
canary clean (its mapping a block table of pages), with prefix reuse, windows shorter and longer
than a page, eviction, retraction and speculative decoding."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import EngineConfig
from pytest_kvcanary.reference_engine.radix_cache import RadixCache

KERNELS = "triton" if torch.cuda.is_available() else "torch"


def attach(engine) -> CanaryRuntime:
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    return runtime


def tight(page_size: int) -> dict:
    """Pools of about 56 FULL and 40 SWA slots (whole pages, page 0 reserved) and 4 rows."""
    return {"num_slots": -(-56 // page_size) * page_size + page_size,
            "swa_num_slots": -(-40 // page_size) * page_size + page_size, "max_running": 4}


@pytest.mark.parametrize(("attention", "page_size"), [("mha", 4), ("mha", 16), ("swa", 2), ("swa", 16), ("mla", 4)],
                         ids=["mha-4", "mha-16", "swa-2 (window 4)", "swa-16 (window 4)", "mla-4"])
@pytest.mark.parametrize("memory", ["roomy", "tight"])
def test_greedy_outputs_equal_the_no_cache_recomputation_with_the_canary_clean(
        attention, page_size, memory, make_engine, random_prompts, assert_reference, shadow_canary, check_invariants):
    engine = make_engine(attention, page_size=page_size, **(tight(page_size) if memory == "tight" else {}))
    runtime = attach(engine)
    shadow = shadow_canary(engine)  # replaces the runtime's hooks: both see every forward below
    engine.set_forward_hooks(_Both(shadow, runtime))
    prompts = random_prompts(2, 6)
    outputs = engine.generate(prompts, 14)
    assert_reference(engine, prompts, outputs)
    check_invariants(engine)
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == [] and runtime.sweeps > 0
    assert runtime.groups[0].mapping.page_size == page_size
    if page_size <= 4:  # the prompts share stems of 10 tokens: whole pages of them are reused
        assert any(v.prefix_lens.max() > 0 for v in shadow.views), "no prefix reuse"
    if memory == "tight":
        assert engine.scheduler.num_retracted > 0 and engine.radix_cache.num_evicted > 0
        if attention == "swa":
            assert engine.radix_cache.num_swa_evicted > 0


class _Both:
    """Two sets of forward hooks, called in turn."""

    def __init__(self, *hooks) -> None:
        self.hooks = hooks

    def before_forward(self, view):
        for h in self.hooks:
            h.before_forward(view)

    def kv_stored(self, *args):
        for h in self.hooks:
            h.kv_stored(*args)

    def after_forward(self, view):
        for h in self.hooks:
            h.after_forward(view)

    def end_forward(self, *args):
        for h in self.hooks:
            h.end_forward(*args)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_with_pages_retracts_and_re_prefills_exactly(k, make_engine, random_prompts,
                                                                          assert_reference, check_invariants):
    """Rejected proposals roll back whole pages past the last kept position only; a retracted
    request frees its pages, draft KV included, and is prefilled again (draft included)."""
    engine = make_engine("mha", page_size=4, speculative_k=k, **tight(4))
    runtime = attach(engine)
    prompts = random_prompts(3, 6)
    outputs = engine.generate(prompts, 14)
    assert_reference(engine, prompts, outputs)
    check_invariants(engine)
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    assert engine.scheduler.num_retracted > 0 and 0 < engine.drafter.accepted < engine.drafter.proposed


def test_the_radix_cache_matches_and_splits_whole_pages(make_engine):
    engine = make_engine("mha", page_size=4)
    cache: RadixCache = engine.radix_cache
    slots = torch.arange(4, 16)  # pages 1-3
    assert cache.insert(list(range(12)), slots).prefix_len == 0
    assert cache.match_prefix(list(range(3))).slots.numel() == 0  # less than a page
    assert cache.match_prefix(list(range(11))).slots.tolist() == slots[:8].tolist()  # 11 tokens: 2 pages
    # A key that differs inside page 2 shares page 1 only: the node splits after 4 tokens, and its
    # children are filed under their first pages.
    res = cache.insert([0, 1, 2, 3, 4, 99, 6, 7], torch.arange(20, 28))
    assert res.prefix_len == 4
    (top,) = cache.root().children.values()
    assert top.key == [0, 1, 2, 3] and top.value.tolist() == slots[:4].tolist()
    assert sorted(top.children) == [(4, 5, 6, 7), (4, 99, 6, 7)]
    assert cache.match_prefix(list(range(4))).slots.tolist() == slots[:4].tolist()  # exactly one page
    with pytest.raises(AssertionError, match="partial page"):
        cache.insert(list(range(6)), torch.arange(4, 10))


def test_a_finished_request_caches_whole_pages_and_frees_its_partial_last_page(make_engine, check_invariants):
    engine = make_engine("mha", page_size=4)
    free = engine.pools.full.num_free
    prompt = list(range(1, 11))
    (out,) = engine.generate([prompt], 3)  # 12 KV tokens: 3 whole pages cached
    assert engine.cache_walk().slots.numel() == 12 and engine.pools.full.num_free == free - 12
    engine.generate([(prompt + out)[:9]], 1)  # 9 KV tokens: 2 cached pages reused, a page for the 9th, freed
    assert engine.cache_walk().slots.numel() == 12 and engine.pools.full.num_free == free - 12
    check_invariants(engine)


def test_page_size_config_errors():
    with pytest.raises(ValueError, match="page_size must be an integer >= 1; got 0"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match=r"num_slots must be a multiple of page_size \(16\) holding at least two "
                                         r"pages \(page 0 is reserved\); got 1000"):
        EngineConfig(page_size=16, num_slots=1000)
    with pytest.raises(ValueError, match="num_slots must be a multiple of page_size"):
        EngineConfig(page_size=16, num_slots=16)
