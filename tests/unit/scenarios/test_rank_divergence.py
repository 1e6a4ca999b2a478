"""A rank of a tensor-parallel engine whose radix cache frees a slot its peers keep.

The bug: on rank 1 only, the radix cache's dedup of a request whose prompt shares a cached prefix
frees one slot past the duplicates: the request's first slot past the shared prefix, which the
tree has just taken over (and the request itself still reads). Nothing on rank 1 is wrong yet;
rank 1's free list just holds a slot too many. Forwards later, rank 1 hands that slot to another
request, which writes its own KV there, while rank 0 writes the same token to another slot. Later
still, a request that reuses the damaged prefix reads another token's KV on rank 1's heads, and
the outputs, summed over both ranks, go wrong.

Proved without the canary: the slots each rank's forwards wrote (recorded in the ranks) first
differ at one forward, and the last request's outputs differ from the same workload on a
single-process engine. The canary's first report is rank 1's rank_divergence at that very
forward (rank 1's own checks see the damage only afterwards), and a later sweep names the slots
whose cache entries differ between the ranks. Without the bug, the ranks agree and nothing fires.
"""

from __future__ import annotations

import types
from dataclasses import replace
from typing import Any

import pytest
import torch

from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.parallel.shard import ReferenceShards
from pytest_kvcanary.reference_engine.parallel.topology import Topology
from pytest_kvcanary.reference_engine.radix_cache import InsertResult, RadixCache
from pytest_kvcanary.reference_engine.request import Request
from pytest_kvcanary.handles.parallel import ParallelHandle
from pytest_kvcanary.handles.rank import RankContext, RankSpec

from scenario_support import DEVICE, KERNELS

ENGINE = EngineConfig(model=ModelConfig(window=8, max_context=64, seed=0), num_slots=48, max_batch_tokens=64)
STEM = list(range(100, 108))
# (prompts, max_new_tokens) sent one after another. 1: two prompts sharing STEM (the second's
# dedup frees its STEM copies, and on the buggy rank one slot more); 2: a duplicated prompt (its
# copies freed on both ranks); 3: a request that needs those freed slots.
BATCHES = [([STEM + [1, 2, 3, 4], STEM + [5, 6, 7, 8]], 2), ([list(range(200, 210))] * 2, 3), ([list(range(300, 306))], 2)]


def workload(engine: Any) -> list[list[list[int]]]:
    """BATCHES, then the second prompt of batch 1 again with its first output: a request whose
    cached prefix includes the slot the buggy rank freed."""
    outputs = [engine.generate(prompts, n) for prompts, n in BATCHES]
    reread = BATCHES[0][0][1] + outputs[0][1][:1]
    return outputs + [engine.generate([reread], 4)]


def record(context: RankContext) -> None:
    """In each rank: note the slots every forward writes, and every cache walk by step."""
    engine = context.engines["single"]
    engine.written, engine.walks = [], {}
    forward, walk = engine._forward, engine.cache_walk

    def logged_forward(batch: Any) -> Any:
        engine.written.append(batch.out_cache_loc.tolist())
        return forward(batch)

    def logged_walk() -> Any:
        found = walk()
        engine.walks[engine._steps] = set(zip(*(c.tolist() for c in found[:4])))
        return found

    engine._forward, engine.cache_walk = logged_forward, logged_walk


def recorded(context: RankContext) -> tuple[list[list[int]], dict[int, set[tuple[int, ...]]]]:
    engine = context.engines["single"]
    return engine.written, engine.walks


def _insert_req_frees_one_past_the_duplicates(self: RadixCache, req: Request) -> InsertResult:
    """RadixCache._insert_req with the bug: the dedup's free goes one slot past the duplicates."""
    slots = self.req_to_token.read(req.row, 0, req.kv_len)
    res = self.insert(req.token_ids[:req.kv_len], slots, swa_from=max(req.swa_from, req.prefix_len),
                      context=req.context_key)
    if res.prefix_len > req.prefix_len:
        self.pools.free(slots[req.prefix_len:res.prefix_len + 1], "radix dedup freed the duplicate's slot")
    return res


def break_rank_1(context: RankContext) -> None:
    if context.rank == 1:
        cache = context.engines["single"].radix_cache
        cache._insert_req = types.MethodType(_insert_req_frees_one_past_the_duplicates, cache)


@pytest.fixture(scope="module")
def single_process_outputs() -> list[list[list[int]]]:
    return workload(Engine(replace(ENGINE, device=DEVICE)))


@pytest.fixture
def tp2() -> Any:
    """A tp=2 engine on the CPU, the canary on each rank (sweeping after every forward), recording."""
    spec = RankSpec("single", ReferenceShards(ENGINE), CanaryConfig(kernels=KERNELS, real_data="all", sweep_interval=1),
                    Topology(tp=2), ("cpu", "cpu") if DEVICE == "cpu" else ("cuda:0", "cuda:1"), setup=record)
    handle = ParallelHandle(spec)
    handle.reset(0, ())
    yield handle
    handle.close()


def _first_difference(a: list[Any], b: list[Any]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_slot_freed_on_one_rank_is_named_at_the_forward_the_ranks_diverge(tp2, single_process_outputs):
    tp2.call(break_rank_1)
    outputs = workload(tp2)
    (written_0, walks_0), (written_1, walks_1) = tp2.call(recorded)
    diverged = _first_difference(written_0, written_1)
    assert diverged is not None, "the ranks wrote the same slots: the bug did not bite"
    assert outputs[:-1] == single_process_outputs[:-1] and outputs[-1] != single_process_outputs[-1], \
        "the request reading the damaged prefix should go wrong, and only it"

    violations = tp2.violations()
    first = min(v.step for v in violations)
    assert first == diverged
    assert {(v.rank, v.phase, v.reasons, v.peer) for v in violations if v.step == first} == {
        (1, "TAIL", ("rank_divergence",), 0)}
    assert all(v.rank == 1 for v in violations), "rank 0 holds the reference: it reports nothing"

    sweeps = [v for v in violations if v.phase == "SWEEP" and v.reasons == ("rank_divergence",)]
    assert sweeps, "no sweep named the slots the ranks' caches hold differently"
    step = min(v.step for v in sweeps)
    differing = {entry[0] for entry in walks_0[step] ^ walks_1[step]}
    assert {v.slot for v in sweeps if v.step == step} == differing


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_without_the_bug_the_ranks_agree(tp2, single_process_outputs):
    assert workload(tp2) == single_process_outputs
    (written_0, walks_0), (written_1, walks_1) = tp2.call(recorded)
    assert written_0 == written_1 and walks_0 == walks_1
    assert tp2.violations() == []
    assert all(stats["forwards"] == len(written_0) for stats in tp2.stats().values())
