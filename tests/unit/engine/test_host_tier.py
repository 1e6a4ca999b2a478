"""The host-memory tier behind the radix cache: evicted pages are written back to host memory and
loaded back on a later hit, greedy outputs equal a no-cache recomputation, and the canary's records
travel with the bytes both ways, so the HEAD of the first forward that reads a loaded-back page
verifies it (a byte changed while the page was on the host is reported there, at the slot it landed
in)."""

from __future__ import annotations

import random

import pytest
import torch

from pytest_kvcanary.canary.host_records import HostRecords
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.radix_cache import CAUSE_EVICTED, CAUSE_HOST_DROPPED, CAUSE_HOST_EVICTED, CAUSE_WRITTEN_BACK

KERNELS = "triton" if torch.cuda.is_available() else "torch"


def attach(engine, **settings) -> CanaryRuntime:
    runtime = CanaryRuntime(CanaryConfig(**{"real_data": "all", "sweep_interval": 2, "kernels": KERNELS,
                                            **settings}), engine)
    engine.set_forward_hooks(runtime)
    return runtime


def tight(page_size: int, host_slots: int = 256) -> dict:
    """About 56 device slots (whole pages, page 0 reserved), 4 rows, a host tier of host_slots."""
    return {"page_size": page_size, "num_slots": -(-56 // page_size) * page_size + page_size, "max_running": 4,
            "host_num_slots": -(-host_slots // page_size) * page_size}


def a_b_a(engine, random_prompts) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts A, then prompts B (A's pages go to host memory), then A again: its pages are loaded
    back into device pages B's KV held. A and its last outputs."""
    a, b = random_prompts(2, 4), random_prompts(5, 4)
    engine.generate(a, 10)
    engine.generate(b, 10)
    return a, engine.generate(a, 10)


@pytest.mark.parametrize(("attention", "page_size", "k"), [("mha", 1, 0), ("mha", 16, 0), ("mha", 4, 3), ("mla", 4, 0)],
                         ids=["mha-1", "mha-16", "mha-4-speculative", "mla-4"])
def test_greedy_outputs_equal_the_no_cache_recomputation_with_the_canary_clean(
        attention, page_size, k, make_engine, random_prompts, assert_reference, check_invariants):
    engine = make_engine(attention, speculative_k=k, **tight(page_size))
    runtime = attach(engine)
    prompts, outputs = a_b_a(engine, random_prompts)
    assert_reference(engine, prompts, outputs)
    check_invariants(engine)
    tier = engine.host_tier
    assert tier.num_written_back > 0 and tier.num_loaded_back > 0
    assert engine.scheduler.num_retracted > 0
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    assert [p.kind.label for p in tier.pools] == [g.pool.kind.label for g in runtime.groups]  # draft pages too


def test_without_the_records_travelling_back_every_loaded_back_slot_is_reported(make_engine, random_prompts,
                                                                                 monkeypatch):
    """What keeps the run above clean is the records coming back with the bytes: dropped, the
    loaded-back slots keep the records of what was there before, and HEAD reports them."""
    monkeypatch.setattr(HostRecords, "loaded_back", lambda self, kind, host_slots, slots: None)
    engine = make_engine("mha", **tight(4))
    runtime = attach(engine, sweep_interval=0)
    loaded: list[set[int]] = []
    engine.host_tier.add_listener(type("Loads", (), {
        "written_back": lambda self, kind, f, h: None, "host_freed": lambda self, kind, h, c: None,
        "loaded_back": lambda self, kind, h, f: loaded.append(set(f.tolist()))})())
    a_b_a(engine, random_prompts)
    runtime.drain()
    found = runtime.log.violations
    assert loaded and found
    assert {v.slot for v in found if v.phase == "HEAD"} <= set().union(*loaded)


def test_a_byte_changed_on_the_host_is_reported_before_the_first_read_after_the_load_back(make_engine):
    engine = make_engine("mha", page_size=4, num_slots=48, max_running=2, host_num_slots=256)
    runtime = attach(engine, sweep_interval=0)
    rng = random.Random(0)
    first = [rng.randrange(1, 256) for _ in range(20)]
    engine.generate([first], 1)  # 20 KV tokens: 5 pages cached
    for i in range(3):  # other prompts push it out of the 11-page pool, into host memory
        engine.generate([[rng.randrange(1, 256) for _ in range(30)]], 1)
    node = next(n for n in engine.radix_cache.roots[0].children.values() if n.key[:4] == first[:4])
    assert node.value is None and node.host_value is not None, "the first prompt was not written back"
    host_slot = int(node.host_value[6])  # position 6
    engine.host_tier.pools[0].v_layers[2].view(torch.uint8)[host_slot, 0, 5] ^= 4
    runtime.drain()
    assert runtime.log.violations == []
    req = engine.submit(first + [7], 2)
    engine.step()  # loads the 5 pages back, then HEAD reads them
    slot = int(engine.req_to_token_pool.read(req.row, 6, 7)[0])
    runtime.drain()
    found = runtime.log.violations
    assert [(v.phase, v.half, v.reasons, v.slot, v.position, v.row) for v in found] == [
        ("HEAD", "V", ("verify_real_kv_hash",), slot, 6, req.row)]
    assert {v.step for v in found} == {engine.forward_count - 1}


def test_a_full_host_tier_drops_the_least_recently_used_copies(make_engine, check_invariants):
    """With room for one prompt's pages in host memory, each write-back drops the copy written back
    before it. A node more than host memory holds leaves the tree when evicted, and so do the host
    copies below it."""
    engine = make_engine("mha", page_size=4, num_slots=60, max_running=2, host_num_slots=24)
    host_causes: list[str] = []
    engine.host_tier.add_listener(type("Frees", (), {
        "written_back": lambda self, kind, f, h: None, "loaded_back": lambda self, kind, h, f: None,
        "host_freed": lambda self, kind, h, cause: host_causes.append(cause)})())
    causes: list[str] = []
    engine.add_free_listener(lambda group, slots, cause: causes.append(cause))
    rng = random.Random(1)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    for _ in range(4):  # 5 pages each, in a pool of 14: the one before goes to host memory
        engine.generate([prompt(20)], 1)
        check_invariants(engine)
    assert causes.count(CAUSE_WRITTEN_BACK) >= 2 and host_causes.count(CAUSE_HOST_EVICTED) >= 1
    big = prompt(32)  # 8 pages: more than the 6 host memory holds
    (out,) = engine.generate([big], 4)
    engine.generate([big + out[:3] + prompt(8)], 1)  # cached below it: 2 pages more
    engine.generate([prompt(40)], 1)  # evicts both: the 2 pages go to host memory, the 8 cannot
    check_invariants(engine)
    assert CAUSE_EVICTED in causes and host_causes[-1] == CAUSE_HOST_DROPPED
    assert not any(n.key[:4] == big[:4] for n in engine.radix_cache.roots[0].children.values())


def test_host_tier_config_errors():
    with pytest.raises(ValueError, match=r"host_num_slots must be a multiple of page_size \(4\); got 10"):
        EngineConfig(page_size=4, host_num_slots=10)
    with pytest.raises(ValueError, match="host_num_slots > 0 needs attention mha, mla or hybrid .*; got attention='swa'"):
        EngineConfig(model=ModelConfig(attention="swa"), host_num_slots=64)
    with pytest.raises(ValueError, match="host_num_slots must be an integer >= 0; got -1"):
        EngineConfig(host_num_slots=-1)
