"""`swa` under vLLM's hybrid KV cache manager: the canary's connector declares hybrid support, so
vLLM keeps full-attention and sliding-window layers in KV cache groups of their own (one block
table each over one block pool) and drops a request's sliding-window blocks once they leave the
window. A workload that slides past the window stays clean; the blocks vLLM drops are announced
as freed; the prefix-cache walk names full-attention blocks only."""

from __future__ import annotations

import random

import pytest
import torch

from .support import (
    INSTALL, PrefixCacheCounter, count_same_step_hits, make_engine, make_handle, prompts_with_shared_prefixes, stems,
)

pytest.importorskip("vllm", reason=INSTALL)

from kvcanary_kernels.records import GroupKind  # noqa: E402
from pytest_kvcanary.adapters.vllm.window_map import last_pair_per_block  # noqa: E402
from pytest_kvcanary.config import PerturbSpec  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

WINDOW = 24  # the random swa checkpoint's sliding window


class SlidingTables:
    """A forward pre-hook of its own on vLLM's model: per request of each forward, the block at
    each index of its sliding-window block table on vLLM's scheduler side (its model runner's
    copy keeps dropped ids); `dropped`: the blocks an entry held before a later forward found the
    null block there."""

    def __init__(self, engine) -> None:
        self.runner = engine._runner
        self.single = engine.book.manager.coordinator.single_type_managers[engine.book.window_groups[0]]
        self.seen: dict[str, list[int]] = {}
        self.dropped: set[int] = set()
        self.handle = self.runner.model.register_forward_pre_hook(self._called)

    def _called(self, model, args) -> None:
        for rid in self.runner.input_batch.req_ids:
            now = [b.block_id for b in self.single.req_to_blocks.get(rid, ())]
            before = self.seen.get(rid, [])
            self.dropped.update(old for old, new in zip(before, now) if old and not new)
            self.seen[rid] = now

    def remove(self) -> None:
        self.handle.remove()


def sliding_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """n prompts of 60-150 tokens (several windows long), half of them sharing a stem."""
    stem = [rng.randrange(256) for _ in range(70)]
    return [(stem if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(60, 81))] for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    return make_engine("swa")


def test_vllm_runs_swa_with_its_hybrid_kv_cache_manager(engine):
    config = engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    groups = engine.book.manager.kv_cache_config.kv_cache_groups
    assert len(groups) == 2
    assert {type(g.kv_cache_spec) for g in groups} == {SlidingWindowSpec, FullAttentionSpec}
    window = engine.book.window_groups[0]
    assert isinstance(engine.book.manager.coordinator.single_type_managers[window], SlidingWindowManager)
    assert groups[window].kv_cache_spec.sliding_window == WINDOW
    full, swa = engine.canary_groups()
    assert (full.kind, swa.kind, swa.window) == (GroupKind.FULL, GroupKind.SWA, WINDOW - 1)
    assert swa.mapping.table is full.mapping.table and swa.mapping.full_to_group is not None


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_a_workload_that_slides_past_the_window_runs_clean(engine, real_data, monkeypatch):
    """Prompts several windows long (chunks past the window in one prefill), 40 decode steps past
    it, prompts sharing a stem (prefix hits keep only the window's blocks), twice (hits on the
    first round's cached blocks), the second round with repeats in one batch (hits on blocks the
    same step computes): vLLM drops sliding-window blocks, and nothing is reported."""
    handle = make_handle(engine, real_data=real_data)
    tables = SlidingTables(engine)
    counter = PrefixCacheCounter(engine, monkeypatch)
    monkeypatch.setattr(engine.book, "plan", engine.book.plan)  # restored after the test
    same_step_hits = count_same_step_hits(engine.book)
    rng = random.Random(1)
    try:
        prompts = sliding_prompts(rng, 6)
        handle.generate(prompts, 40)
        longer = [p + [rng.randrange(256) for _ in range(40)] for p in prompts[:3]]
        handle.generate([p for p in longer for _ in range(2)]
                        + prompts_with_shared_prefixes(rng, 2, stems(rng, count=1)), 30)
    finally:
        tables.remove()
    assert handle.violations() == []
    assert tables.dropped, "vLLM dropped sliding-window blocks that left the window"
    assert counter.hits > 0, "vLLM hit its prefix cache"
    assert same_step_hits[0] > 0, "requests hit blocks their own step computes"
    stats = handle.stats()["single"]
    assert stats["sweeps"] > 0 and stats["health"] == "ok"
    runtime = handle.side.runtime
    assert runtime.group(GroupKind.SWA).halves, "the SWA group is guarded"
    # The walk names full-attention blocks the prefix cache holds, and only those.
    walk = engine.cache_walk()
    pool, full_group = engine.book.pool, engine.book.full_group
    blocks = {int(s) // engine.block_size for s in walk.slots.tolist()}
    assert blocks and all(get_group_id(pool.blocks[b].block_hash) == full_group for b in blocks)


def test_block_table_entries_past_a_rows_last_block_are_not_mapped(engine, monkeypatch):
    """vLLM's model runner may leave, past a row's last block, the entries of the request that held
    the row before (vLLM 0.26 does). Put there, in both groups' tables, the row's own last
    full-attention block and a sliding-window block other than its own: the window map ignores
    them, and a sliding workload stays clean (mapped, they send that block's SWA records to the
    other block, and TAIL reports the forward's writes missing there)."""
    from pytest_kvcanary.adapters.vllm import forward_inputs

    read, planted = forward_inputs.read, [0]
    full, window, bs = engine.book.full_group, engine.book.window_groups[0], engine.block_size

    def with_stale_entries(runner, model_kwargs, group_layers):
        inputs = read(runner, model_kwargs, group_layers)
        tables = [table.clone() for table in inputs.block_tables]
        for b, end in enumerate((-(-inputs.seq_lens.to(torch.int64) // bs)).tolist()):
            if end < tables[full].shape[1]:
                own = int(tables[window][b, end - 1])
                tables[full][b, end] = tables[full][b, end - 1]
                tables[window][b, end] = own + 1 if own + 1 < engine.settings.num_blocks else 1
                planted[0] += 1
        return inputs._replace(block_tables=tuple(tables))

    monkeypatch.setattr(forward_inputs, "read", with_stale_entries)
    handle = make_handle(engine)
    handle.generate(sliding_prompts(random.Random(3), 4), 12)
    assert planted[0] > 0
    assert handle.violations() == []


def test_blocks_that_leave_the_window_are_announced_freed():
    """Without a prefix cache a block that left every window holds nothing anyone reads: the
    adapter hears vLLM's sliding-window manager drop it and announces its slots as freed (SWA
    group, cause named), exactly the blocks vLLM's own block tables dropped. A bit flipped in each
    such block as soon as it is announced is never reported and changes no output (vLLM reads it
    no more; a block handed out again is stamped afresh)."""
    engine = make_engine("swa", prefix_caching=False)
    handle = make_handle(engine)
    swa = engine.canary_groups()[1]
    bs = swa.page_size
    announced: set[int] = set()

    def heard(kind, slots, cause) -> None:
        if kind is not GroupKind.SWA or cause != "left the sliding window":
            return
        window_slots = swa.mapping.full_to_group[slots]
        announced.update((window_slots // bs).tolist())
        for layer in swa.k_layers:
            layer.view(torch.int16)[window_slots // bs, window_slots % bs, 0] ^= 1

    prompts = sliding_prompts(random.Random(2), 5)
    before = handle.generate(prompts, 40)
    handle.reset(0, ())
    engine.add_free_listener(heard)
    tables = SlidingTables(engine)
    try:
        after = handle.generate(prompts, 40)
    finally:
        tables.remove()
    assert tables.dropped and announced == tables.dropped
    assert handle.violations() == []
    assert after == before


def test_a_fault_in_a_block_that_left_the_window_escapes_with_that_cause():
    """Without a prefix cache, a flip right after the stamp lands in a prefill's early positions
    that no later token reads: vLLM drops their block once it leaves the window, and the fault
    ledger says so (escaped, cause named) instead of leaving the fault latent; every other flip
    is caught."""
    engine = make_engine("swa", prefix_caching=False)
    causes = set()
    for seed in range(3):
        handle = make_handle(engine, (PerturbSpec("real_kv_post_forward", target_group="swa"),), seed)
        handle.generate(sliding_prompts(random.Random(seed), 4), 8)
        for inj in handle.injections():
            assert inj.status in ("detected", "escaped"), inj
            causes.add(inj.cause)
    assert "left the sliding window" in causes


def test_the_window_map_takes_one_pair_per_full_block_the_last_naming_it():
    # The prefix cache's pair for a full-attention block, then a running row's for the same block
    # (it reads there): one index_put_ gets each full block once, so no device picks for it.
    assert last_pair_per_block(torch.tensor([[7, 3], [2, 9], [7, 5], [4, 4], [2, 1]]), 10).tolist() == \
        [[7, 5], [4, 4], [2, 1]]
    rng = random.Random(0)
    for _ in range(20):
        pairs = [(rng.randrange(12), rng.randrange(40)) for _ in range(rng.randrange(1, 30))]
        kept = last_pair_per_block(torch.tensor(pairs), 12).tolist()
        assert [f for f, _ in kept] == sorted({f for f, _ in pairs}, key=lambda f: max(i for i, p in enumerate(pairs)
                                                                                          if p[0] == f))
        assert dict(map(tuple, kept)) == dict(pairs)  # the last pair naming each full block
