"""The canary inside a CUDA graph: the reference engine captures before_forward + its padded decode
forward + after_forward and replays them; faults made between replays are still reported at the
right slot with the right reason, and the health check sees every replayed launch."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _engine_with_canary(make_engine, attention: str, decode_mode: str):
    engine = make_engine(attention, decode_mode=decode_mode, device="cuda")
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=3), engine)
    engine.set_forward_hooks(runtime)
    return engine, runtime


def _decode_until_captured(engine, prompts, max_new_tokens=12):
    reqs = [engine.submit(p, max_new_tokens) for p in prompts]
    while not any(step.graph is not None for step in engine._decode.steps):
        engine.step()
    engine.step()  # one replay
    return reqs


@pytest.mark.parametrize("attention", ["mha", "swa", "mla", "hybrid"])
def test_graph_decode_with_the_canary_equals_eager_and_stays_clean(attention, make_engine, random_prompts):
    prompts = random_prompts(5, 4)
    eager = make_engine(attention, device="cuda").generate(prompts, 10)
    engine, runtime = _engine_with_canary(make_engine, attention, "graph")
    assert engine.generate(prompts, 10) == eager
    assert any(step.graph is not None for step in engine._decode.steps)
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    assert runtime.stats().forwards == engine.forward_count


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_graph_decode_over_pages_and_a_host_tier_equals_eager_and_stays_clean(attention, make_engine, random_prompts):
    """Pages of 16 tokens (the graphs expand the block table position by position) and, for mha,
    a host tier whose copies run on a stream of their own under memory pressure."""
    prompts = random_prompts(5, 8)
    options = {"page_size": 16, "num_slots": 128, "swa_num_slots": 128, "max_running": 4}
    if attention == "mha":
        options["host_num_slots"] = 1024
    eager = make_engine(attention, device="cuda", **options).generate(prompts, 12)
    engine = make_engine(attention, decode_mode="graph", device="cuda", **options)
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=3), engine)
    engine.set_forward_hooks(runtime)
    assert engine.generate(prompts, 12) == eager
    assert engine.generate(prompts, 12) == eager  # hits on what went to host memory meanwhile
    assert any(step.graph is not None for step in engine._decode.steps)
    if attention == "mha":
        assert engine.host_tier.num_written_back > 0 and engine.host_tier.num_loaded_back > 0
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []


def test_faults_between_replays_are_reported_at_the_right_slot(make_engine):
    engine, runtime = _engine_with_canary(make_engine, "mha", "graph")
    reqs = _decode_until_captured(engine, [list(b"graph replay one"), list(b"graph replay two")])
    runtime.drain()
    assert runtime.log.violations == []
    table = engine.req_to_token_pool.table

    victim = reqs[0]
    slot = int(table[victim.row, 3])
    engine.pools.full.k_layers[0].view(torch.uint8)[slot, 0, 0] ^= 1  # byte 0 of the slot in layer 0
    step = runtime.forwards
    engine.step()
    hits = {(v.phase, v.half, v.reasons, v.slot, v.position, v.row, v.step) for v in runtime.drain()}
    assert ("HEAD", "K", ("verify_real_kv_hash",), slot, 3, victim.row, step) in hits

    other = reqs[1]
    saved = table[other.row, 2].clone()
    table[other.row, 2] = table[victim.row, 5]  # a wrong mapping entry, made between replays
    step = runtime.forwards
    engine.step()
    table[other.row, 2] = saved
    new = runtime.drain()
    assert any(v.phase == "HEAD" and v.row == other.row and v.position == 2 and v.step == step
               and v.reason == "verify_position" for v in new)
    assert runtime.health_problems() == []
