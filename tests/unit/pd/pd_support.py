"""Prefill/decode pairs for the PD tests: engines, handles, the fault they inject, idle checks.

Repeated-run loops use the torch reference kernels (bit-identical to the Triton ones, which the
kernel tests check); a few tests run the Triton kernels (interpreted on a CPU).
"""

from __future__ import annotations

import torch

from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig, PDPair
from pytest_kvcanary.handles.pd import PDHandle
from pytest_kvcanary.handles.sided import BASE_PROMPT

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A window longer than send_parallel_requests' prompts: decode's HEAD then reads every SWA slot sent.
LONG_WINDOW = 64
assert LONG_WINDOW > len(f"7 {1 << 30} {BASE_PROMPT}")


def post_forward(target_group: str) -> tuple[PerturbSpec, ...]:
    """The PD self-test fault: flip a bit of a slot the prefill forward just wrote and stamped."""
    return (PerturbSpec("real_kv_post_forward", side="prefill", target_group=target_group),)


def make_engine(attention: str, *, window: int = 16, seed: int = 0, device: str = DEVICE, **engine_kw) -> Engine:
    """The reference adapter's engine, with the window and pool sizes adjustable."""
    model = ModelConfig(attention=attention, window=window, full_every=2, seed=seed, max_context=256)
    engine_kw = {"num_slots": 1024, "swa_num_slots": 512, "max_running": 8, **engine_kw}
    return Engine(EngineConfig(model=model, device=device, **engine_kw))


def make_handle(attention: str, *, kernels: str = "torch", window: int = 16, sweep_interval: int = 0,
                real_data: str = "partial", **engine_kw) -> PDHandle:
    """Both sides alike; sweep_interval 0 by default, as in SGLang's PD tests (a prefill-side
    sweep would also see a damaged slot the prefill radix cache still holds)."""
    canary = CanaryConfig(sweep_interval=sweep_interval, real_data=real_data, kernels=kernels)
    pair = PDPair(*(make_engine(attention, window=window, **engine_kw) for _ in range(2)))
    return PDHandle(pair, canary)


def assert_idle_and_whole(engine: Engine) -> None:
    """No request holds anything; every slot is free or cached by exactly one tree node."""
    assert not engine.scheduler.has_work
    cached = engine.cache_walk().slots
    assert cached.unique().numel() == cached.numel(), "a slot is cached twice"
    assert cached.numel() + engine.pools.full.num_free == engine.pools.full.num_slots - 1, "a FULL slot leaked"
    swa = engine.pools.swa
    if swa is not None:
        mapped = swa.full_to_swa.cpu()
        assert (mapped != 0).sum() + swa.num_free == swa.num_slots - 1, "an SWA slot leaked"
        assert not mapped[engine.pools.full.free_slots].any(), "a free FULL slot keeps an SWA slot"
