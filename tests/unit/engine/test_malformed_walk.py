"""A malformed prefix-cache walk (the radix cache's own state corrupted) is reported with its own
reason by the sweep: in log mode the engine keeps running and its outputs stay right; in raise mode
it raises the canary's error with the violations attached."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from pytest_kvcanary.canary.seam import CacheWalk
from pytest_kvcanary.canary.log import KvCanaryViolationError
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine

KERNELS = "triton" if torch.cuda.is_available() else "torch"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 20, 21], [30, 31, 32]]


def _duplicate(walk: CacheWalk, space: int) -> CacheWalk:
    """The A -> B -> A pattern: the first entry's slot listed again, as a stale node's."""
    return CacheWalk(*(None if t is None else torch.cat([t, t[:1]]) for t in walk))


def _out_of_range(walk: CacheWalk, space: int) -> CacheWalk:
    slots = walk.slots.clone()
    slots[-1] = space + 3
    return walk._replace(slots=slots)


def _too_large(walk: CacheWalk, space: int) -> CacheWalk:
    """More entries than the pool has slots (each slot listed again and again)."""
    reps = space // walk.slots.numel() + 1
    return CacheWalk(*(None if t is None else t.repeat(reps) for t in walk))


# corruption -> (how, the reasons it is reported with)
CORRUPTIONS: dict[str, tuple[Callable[[CacheWalk, int], CacheWalk], set[str]]] = {
    "duplicate": (_duplicate, {"walk_duplicate_slot"}),
    "out_of_range": (_out_of_range, {"walk_slot_out_of_range"}),
    "too_large": (_too_large, {"walk_too_large", "walk_duplicate_slot"}),
}


def _corrupt_walk(monkeypatch, engine: Engine, corruption: str) -> None:
    corrupt, _ = CORRUPTIONS[corruption]
    walk = engine.radix_cache.walk
    space = engine.pools.full.num_slots
    monkeypatch.setattr(engine.radix_cache, "walk", lambda: corrupt(walk(), space))


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_log_mode_reports_a_malformed_walk_and_the_engine_keeps_running(make_engine, assert_reference,
                                                                        monkeypatch, corruption):
    engine = make_engine()
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=1, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    engine.generate(PROMPTS[:1], max_new_tokens=2)  # something cached before the walk goes bad
    _corrupt_walk(monkeypatch, engine, corruption)
    outputs = engine.generate(PROMPTS, max_new_tokens=4)
    assert_reference(engine, PROMPTS, outputs)
    runtime.drain()
    reasons = {v.reason for v in runtime.log.violations}
    assert reasons == CORRUPTIONS[corruption][1], [v.describe() for v in runtime.log.violations]
    assert all(v.phase == "SWEEP" for v in runtime.log.violations)
    assert runtime.health_problems() == []


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_raise_mode_raises_the_canarys_error_with_the_walk_violations(make_engine, monkeypatch, corruption):
    engine = make_engine()
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=1, drain_interval=1, mode="raise",
                                         kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    engine.generate(PROMPTS[:1], max_new_tokens=2)
    _corrupt_walk(monkeypatch, engine, corruption)
    with pytest.raises(KvCanaryViolationError) as raised:
        engine.generate(PROMPTS, max_new_tokens=4)
    assert {v.reason for v in raised.value.violations} == CORRUPTIONS[corruption][1]
