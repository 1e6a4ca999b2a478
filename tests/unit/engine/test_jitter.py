"""Seeded timing jitter (`EngineConfig.jitter_seed`): the host tier acknowledges finished load-backs
late and out of order, a pair's transfers wait and overtake one another; outputs stay exact, the
canary stays silent, and a seed replays the same choices after a reset."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.jitter import MAX_SPIN_CYCLES, Jitter
from pytest_kvcanary.reference_engine.pd import PDPair

from test_host_tier import a_b_a, tight

KERNELS = "triton" if torch.cuda.is_available() else "torch"


def _late_acknowledgements(engine) -> list[int]:
    """Per step, the load-backs still waiting for their acknowledgement after it."""
    tier, waiting = engine.host_tier, []
    step = engine.step

    def counted():
        done = step()
        waiting.append(len(tier._pending))
        return done

    engine.step = counted
    return waiting


def test_late_acknowledgements_keep_outputs_exact_and_the_canary_silent(make_engine, random_prompts, assert_reference,
                                                                        check_invariants):
    engine = make_engine("mha", jitter_seed=3, **tight(4))
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    waiting = _late_acknowledgements(engine)
    prompts, outputs = a_b_a(engine, random_prompts)
    assert_reference(engine, prompts, outputs)
    check_invariants(engine)
    assert engine.host_tier.num_loaded_back > 0 and max(waiting) > 0, "no acknowledgement came late"
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []


def test_without_jitter_every_finished_load_back_is_acknowledged_at_once(make_engine, random_prompts):
    engine = make_engine("mha", **tight(4))
    waiting = _late_acknowledgements(engine)
    a_b_a(engine, random_prompts)
    assert engine.host_tier.num_loaded_back > 0 and set(waiting) == {0}


def test_a_seed_replays_its_choices_after_a_reset(make_engine, random_prompts):
    engine = make_engine("mha", jitter_seed=5, **tight(4))
    waiting = _late_acknowledgements(engine)
    a_b_a(engine, random_prompts)
    first = list(waiting)
    engine.reset()
    waiting.clear()
    a_b_a(engine, random_prompts)
    assert waiting == first


def test_a_pair_s_transfers_wait_and_overtake_with_outputs_unchanged(make_engine, random_prompts):
    prompts = random_prompts(7, 6)

    def run(seed):
        pair = PDPair(make_engine("mha", jitter_seed=seed, max_running=3), make_engine("mha", max_running=3))
        order = []
        transfer = pair._transfer

        def recorded(req):
            moved = transfer(req)
            if moved is not None:
                order.append(req.rid)
            return moved

        pair._transfer = recorded
        return pair.generate(prompts, 6), order

    plain, in_order = run(None)
    shaken, shaken_order = run(11)
    assert shaken == plain
    assert in_order == sorted(in_order) and shaken_order != sorted(shaken_order), "no transfer overtook another"


def _recorded_spins(monkeypatch) -> list[int]:
    slept = []
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    return slept


def test_spins_are_seeded_and_leave_the_other_choices_as_they_were(monkeypatch):
    slept = _recorded_spins(monkeypatch)
    alone = Jitter(7)
    delays = [alone.delay() for _ in range(20)]
    mixed = Jitter(7)
    spins = []
    for _ in range(20):
        spins.append(mixed.spin())
        assert mixed.delay() == delays[len(spins) - 1]
    assert 0 in spins and max(spins) > 0 and max(spins) <= MAX_SPIN_CYCLES
    assert slept == [c for c in spins if c], "a spin of 0 cycles queues nothing"
    mixed.restart()
    assert [mixed.spin() for _ in range(20)] == spins
    assert Jitter(None).spin() == 0 and len(slept) == len([c for c in spins if c]) * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream's spins need CUDA")
def test_copies_spun_late_on_the_copy_stream_keep_outputs_exact_and_the_canary_silent(
        make_engine, random_prompts, assert_reference, check_invariants, monkeypatch):
    sleep, spins = torch.cuda._sleep, []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (spins.append(cycles), sleep(cycles)))
    engine = make_engine("mha", jitter_seed=11, **tight(4))
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    prompts, outputs = a_b_a(engine, random_prompts)
    assert_reference(engine, prompts, outputs)
    check_invariants(engine)
    assert engine.host_tier.num_loaded_back > 0 and len(spins) > 0
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []


def test_spin_at_spins_on_a_gpu_only_and_draws_nothing_on_a_cpu(monkeypatch):
    slept = _recorded_spins(monkeypatch)
    on_gpu, on_both = Jitter(7), Jitter(7)
    spins = [on_gpu.spin_at(torch.device("cuda")) for _ in range(10)]
    mixed = []
    for _ in range(10):
        assert on_both.spin_at(torch.device("cpu")) == 0
        mixed.append(on_both.spin_at(torch.device("cuda:0")))
    assert mixed == spins and max(spins) > 0, "a CPU's spin point drew a spin"
    assert slept == [c for c in spins if c] * 2


@pytest.mark.parametrize("decode_mode, async_scheduling", [("eager", False), ("padded", False), ("eager", True)])
def test_a_forward_spins_before_and_after_each_of_the_canary_s_phases(decode_mode, async_scheduling, make_engine,
                                                                       random_prompts, monkeypatch):
    engine = make_engine("mha", jitter_seed=2, decode_mode=decode_mode, async_scheduling=async_scheduling)
    runtime = CanaryRuntime(CanaryConfig(sweep_interval=0, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    events = []
    monkeypatch.setattr(engine.jitter, "spin_at", lambda device: events.append("spin") or 0)
    for name, phase in (("before_forward", "HEAD"), ("after_forward", "TAIL")):
        hook = getattr(runtime, name)
        monkeypatch.setattr(runtime, name, lambda view, hook=hook, phase=phase: (events.append(phase), hook(view))[1])
    engine.generate(random_prompts(3, 6), max_new_tokens=4)
    forward = ["spin", "HEAD", "spin", "spin", "TAIL", "spin"]
    assert events == forward * engine.forward_count and engine.forward_count > 1
    runtime.drain()
    assert runtime.log.violations == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a forward's spins need CUDA")
@pytest.mark.parametrize("decode_mode", ["eager", "graph"])
def test_forwards_spun_late_under_async_scheduling_keep_outputs_exact_and_the_canary_silent(
        decode_mode, make_engine, random_prompts, assert_reference, check_invariants, monkeypatch):
    sleep, spins = torch.cuda._sleep, []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (spins.append(cycles), sleep(cycles)))
    engine = make_engine("mha", jitter_seed=13, decode_mode=decode_mode, async_scheduling=True, **tight(4))
    runtime = CanaryRuntime(CanaryConfig(real_data="partial", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    prompts, outputs = a_b_a(engine, random_prompts)
    assert_reference(engine, prompts, outputs)
    check_invariants(engine)
    assert len(spins) > 0
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []


def test_a_negative_seed_is_refused_by_name():
    with pytest.raises(ValueError, match="jitter_seed must be an integer >= 0; got -1"):
        EngineConfig(model=ModelConfig(), jitter_seed=-1)
