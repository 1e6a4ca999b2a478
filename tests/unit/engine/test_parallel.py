"""The reference engine split over ranks computes what one process does.

Pipeline stages run the same operations in the same order: logits are bit-identical. Tensor
parallel sums each attention output projection and MLP down projection over the ranks (an
all-reduce) instead of in one matmul, so float32 logits differ in the last bits; within 1e-5 here,
and the greedy outputs are the same. Every rank's canary stays silent and healthy, and each rank's
pools hold its own shard.
"""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.parallel.shard import ReferenceShards
from pytest_kvcanary.reference_engine.parallel.topology import Topology
from pytest_kvcanary.handles.parallel import ParallelHandle
from pytest_kvcanary.handles.rank import RankContext, RankSpec

TOLERANCE = {1: 0.0, 2: 1e-5}  # by tp


def _config(attention: str, **engine: object) -> EngineConfig:
    model = ModelConfig(attention=attention, window=4, max_context=64, num_layers=4, seed=3)
    return EngineConfig(model=model, max_batch_tokens=64, **engine)


def rank_view(context: RankContext) -> tuple[list[int], int, list[float]]:
    """A rank's pool row shape, its FULL layers, and the logits of a fixed sequence with no cache."""
    engine = context.engines["single"]
    ids = torch.arange(1, 20, device=engine.device)
    logits = engine.model.logits_without_cache(ids)
    return list(engine.pools.full.k_layers[0].shape[1:]), len(engine.pools.full.k_layers), logits.flatten().tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks (gloo); the GPU runs are the examples'")
@pytest.mark.parametrize("tp, pp, attention", [(2, 1, "mla"), (1, 2, "swa"), (2, 2, "mha")])
def test_ranks_compute_what_one_process_does(tp, pp, attention, random_prompts):
    config = _config(attention, num_slots=56, max_running=4)  # small pools: eviction and retraction
    prompts = random_prompts(tp + pp, 7)
    single = Engine(config)
    expected = single.generate(prompts, 10)
    assert single.scheduler.num_retracted and single.radix_cache.num_evicted
    spec = RankSpec("single", ReferenceShards(config), CanaryConfig(kernels="torch", real_data="all", sweep_interval=2),
                    Topology(tp, pp), ("cpu",) * (tp * pp))
    handle = ParallelHandle(spec)
    try:
        handle.reset(0, ())
        assert handle.generate(prompts, 10) == expected
        assert handle.violations() == [] and handle.healthy()
        assert {s["sweeps"] > 0 for s in handle.stats().values()} == {True}
        views = handle.call(rank_view)
    finally:
        handle.close()
    reference = single.model.logits_without_cache(torch.arange(1, 20)).flatten()
    row = list(single.pools.full.k_layers[0].shape[1:])
    if attention != "mla":  # a latent row is replicated
        row[0] //= tp
    for shape, layers, logits in views:
        assert shape == row and layers == len(single.pools.full.k_layers) // pp
        assert torch.allclose(torch.tensor(logits), reference, rtol=0, atol=TOLERANCE[tp])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_graph_decode_on_two_gpus(random_prompts):
    """NCCL ranks replaying their decode steps, the canary and the digests' all-gather inside each
    step's CUDA graph: the outputs of one process, every kernel launch counted, nothing reported."""
    config = _config("mha", device="cuda:0", decode_mode="graph")
    prompts = random_prompts(5, 6)
    expected = Engine(config).generate(prompts, 12)
    handle = ParallelHandle(RankSpec("single", ReferenceShards(config), CanaryConfig(sweep_interval=3), Topology(tp=2),
                                     ("cuda:0", "cuda:1")))
    try:
        handle.reset(0, ())
        assert handle.generate(prompts, 12) == expected
        assert handle.violations() == [] and handle.healthy()
        assert {s["device"] for s in handle.stats().values()} == {"cuda:0", "cuda:1"}
    finally:
        handle.close()


@pytest.mark.parametrize("topology, engine, message", [
    (Topology(tp=4), {}, r"tp=4 must divide model.num_kv_heads \(2\)"),
    (Topology(tp=3), {}, r"tp=3 must divide model.num_heads \(4\)"),
    (Topology(pp=3), {}, r"pp=3 must divide model.num_layers \(4\)"),
    (Topology(pp=4), {"attention": "swa"}, r"pp=4 must leave each stage a multiple of model.full_every \(2\)"),
    (Topology(tp=2), {"speculative_k": 2}, "speculative_k must be 0 on a parallel engine"),
])
def test_a_model_that_does_not_split_that_way_is_refused(topology, engine, message):
    attention = engine.pop("attention", "mha")
    with pytest.raises(ValueError, match=message):
        topology.check(_config(attention, **engine))


def test_bad_topologies_and_specs_are_refused():
    with pytest.raises(ValueError, match="tp must be an integer >= 1; got 0"):
        Topology(tp=0)
    with pytest.raises(ValueError, match=r"devices must name one device per rank \(2\)"):
        RankSpec("single", ReferenceShards(_config("mha")), CanaryConfig(), Topology(tp=2), ("cpu",))
    with pytest.raises(ValueError, match="kind must be one of single, pd; got 'pair'"):
        RankSpec("pair", ReferenceShards(_config("mha")), CanaryConfig(), Topology(tp=2), ("cpu", "cpu"))
