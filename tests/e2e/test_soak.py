"""Canary baseline: hundreds of requests through the reference engine under memory pressure, the
canary checking every forward and sweeping every 4, report nothing and stay healthy; with faults
injected under the same pressure, each is detected or escaped for a reason the ledger names.

Pressure: prompts share prefixes from a few stems (exact duplicates among them), prompt and output
lengths vary, requests arrive while others decode, the pools are small enough that the radix cache
evicts and the scheduler retracts, and the window short enough that SWA slots slide out. On a CPU
the long soak runs the torch reference kernels (bit-identical to the Triton ones) and a shorter one
the Triton kernels under the interpreter; with CUDA both run the Triton kernels.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.handles.single import EngineHandle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LONG_SOAK_KERNELS = "triton" if DEVICE == "cuda" else "torch"
SWEEP_INTERVAL = 4


def pressure_engine(attention: str) -> Engine:
    """Room in the FULL pool for two of the longest requests (83 tokens), in the SWA pool for one;
    eight rows; a window of 8, so requests writing more than 8 tokens past their prompt slide."""
    model = ModelConfig(attention=attention, window=8, max_context=128, seed=0)
    return Engine(EngineConfig(model=model, num_slots=192, swa_num_slots=96, max_running=8, max_batch_tokens=128,
                               device=DEVICE))


def start(attention: str, kernels: str, real_data: str, perturbs: tuple[PerturbSpec, ...] = ()) -> EngineHandle:
    canary = CanaryConfig(real_data=real_data, sweep_interval=SWEEP_INTERVAL, kernels=kernels)
    handle = EngineHandle(pressure_engine(attention), canary)
    handle.reset(0, perturbs)
    return handle


def run_requests(engine: Engine, seed: int, n: int, longest_output: int = 16) -> Counter[str]:
    """n requests, a prompt each of one of 6 stems (4-27 tokens) and one of 24 tails (1-40
    tokens), 1 to longest_output new tokens; they arrive 1-6 at a time with 1-3 forwards in
    between, then the engine runs until all are done, each with as many tokens as it asked for.
    Returns how many times the engine freed slots, per cause."""
    causes: Counter[str] = Counter()
    engine.add_free_listener(lambda group, slots, cause: causes.update([cause]))
    rng = random.Random(seed)
    stems = [[rng.randrange(256) for _ in range(rng.randrange(4, 28))] for _ in range(6)]
    tails = [[rng.randrange(256) for _ in range(rng.randrange(1, 41))] for _ in range(24)]
    requests = []
    while len(requests) < n:
        for _ in range(min(n - len(requests), rng.randrange(1, 7))):
            requests.append(engine.submit(rng.choice(stems) + rng.choice(tails), rng.randrange(1, longest_output + 1)))
        for _ in range(rng.randrange(1, 4)):
            engine.step()
    while engine.scheduler.has_work:
        engine.step()
    assert all(len(r.output_ids) == r.max_new_tokens for r in requests)
    return causes


def assert_clean_under_pressure(handle: EngineHandle, attention: str, causes: Counter[str]) -> None:
    """No violation, a healthy canary, and the pressure was real: the radix cache evicted (SWA
    slots too on swa) and deduplicated, the scheduler retracted."""
    engine = handle.engine
    stats = handle.stats()["single"]
    assert handle.violations() == [] and handle.injections() == [], [v.describe() for v in handle.violations()]
    assert (stats["violations"], stats["rows"], stats["health"]) == (0, 0, "ok"), stats
    assert stats["sweeps"] == stats["forwards"] // SWEEP_INTERVAL and stats["protected_tokens"] > 0, stats
    assert engine.radix_cache.num_evicted > 0 and engine.scheduler.num_retracted > 0
    assert attention == "mha" or engine.radix_cache.num_swa_evicted > 0
    assert any("radix dedup" in cause for cause in causes), causes


@pytest.mark.parametrize("real_data", ["partial", "all"])
@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_200_requests_under_pressure_raise_no_violation(attention, real_data):
    handle = start(attention, LONG_SOAK_KERNELS, real_data)
    causes = run_requests(handle.engine, seed=0, n=200)
    assert_clean_under_pressure(handle, attention, causes)
    assert attention == "mha" or causes["slid out of the attention window"] > 0


@pytest.mark.parametrize(("attention", "real_data"), [
    ("mha", "partial"),
    # Over two minutes under Triton's interpreter: runs compiled in the GPU pass (benchmarks/gpu_run.sh).
    pytest.param("swa", "all", marks=pytest.mark.skipif(DEVICE != "cuda", reason="interpreter: runs in the GPU pass")),
])
def test_30_requests_under_pressure_raise_no_violation_with_triton_kernels(attention, real_data):
    handle = start(attention, "triton", real_data)
    causes = run_requests(handle.engine, seed=3, n=30, longest_output=4)  # some 20-30 forwards
    assert_clean_under_pressure(handle, attention, causes)


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_faults_under_pressure_are_detected_or_escape_with_their_cause(attention):
    """Damage the engine later frees: written slots (post forward) and idle cached ones."""
    groups = ("full",) if attention == "mha" else ("full", "swa")
    perturbs = tuple(PerturbSpec(mode, target_group=g, prob=0.5) for g in groups
                     for mode in ("real_kv_post_forward", "real_kv_unused_cache"))
    handle = start(attention, LONG_SOAK_KERNELS, "partial", perturbs)
    run_requests(handle.engine, seed=2, n=60)
    handle.side.runtime.sweep()  # all requests are done: what is not freed is cached, read now
    handle.side.runtime.drain()
    injections, violations = handle.injections(), handle.violations()
    assert {(i.mode, i.group) for i in injections} == {(s.mode, s.target_group) for s in perturbs}
    assert all(i.status == "detected" or (i.status == "escaped" and i.cause) for i in injections), \
        [i.describe() for i in injections if i.status != "detected"]
    assert all(any(i.matches(v) for i in injections) for v in violations), \
        [v.describe() for v in violations if not any(i.matches(v) for i in injections)]
    causes = {i.cause for i in injections}
    assert "evicted from the radix cache" in causes, causes
    assert attention == "mha" or "SWA slots evicted from the radix cache" in causes, causes
    assert handle.healthy()
