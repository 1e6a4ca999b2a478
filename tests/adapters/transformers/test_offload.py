"""transformers' CPU offloading guarded as a host tier: a starved request's blocks copied to the CPU
swap pool and back give the outputs recomputing them gives, the canary's records travel with them
(dropped, the restored blocks are reported), and a byte changed in the pool is reported by the first
forward that reads the restored block."""

from __future__ import annotations

import random

import pytest
import torch

from .support import INSTALL, KERNELS, make_engine, prompts_with_shared_prefixes, stems

transformers = pytest.importorskip("transformers", reason=INSTALL)
pytestmark = pytest.mark.skipif(tuple(map(int, transformers.__version__.split(".")[:2])) < (5, 18),
                                reason="transformers 5.17 keeps no CPU swap pool (the adapter refuses cpu_offload_space)")

from pytest_kvcanary.canary.host_records import HostRecords  # noqa: E402
from pytest_kvcanary.config import CanaryConfig, PerturbSpec  # noqa: E402
from pytest_kvcanary.handles.single import EngineHandle  # noqa: E402

# 16 blocks of 16 tokens for 16 requests a wave: transformers offloads running requests.
TIGHT = {"num_blocks": 16, "max_batch_tokens": 128}


class Copies:
    """A host-tier listener counting the slots copied each way, and the slots restored into."""

    def __init__(self) -> None:
        self.to_cpu = self.to_device = 0
        self.restored: set[int] = set()

    def written_back(self, kind, slots, host_slots) -> None:
        self.to_cpu += slots.numel()

    def loaded_back(self, kind, host_slots, slots) -> None:
        self.to_device += slots.numel()
        self.restored |= set(slots.tolist())

    def host_freed(self, kind, host_slots, cause) -> None:
        pass


def offloading_engine(monkeypatch: pytest.MonkeyPatch):
    """An engine with a CPU swap pool. transformers pins the pool; a CPU-only torch cannot pin, so
    there the pool is allocated unpinned (the copies are synchronous then)."""
    with monkeypatch.context() as m:
        if not torch.cuda.is_available():
            empty = torch.empty
            m.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
        return make_engine("mha", **TIGHT, cpu_offload_space=0.01)


def waves(handle, seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = stems(rng, count=6)
    outputs = []
    for _ in range(n):
        outputs += handle.generate(prompts_with_shared_prefixes(rng, 16, shared), max_new_tokens=8)
    return outputs


def test_blocks_copied_to_cpu_and_back_give_the_recomputed_outputs_with_the_canary_clean(monkeypatch):
    engine = offloading_engine(monkeypatch)
    copies = Copies()
    engine.host_tier.add_listener(copies)
    handle = EngineHandle(engine, CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS))
    handle.reset(0, ())
    recomputing = EngineHandle(make_engine("mha", **TIGHT), CanaryConfig(kernels=KERNELS))
    recomputing.reset(0, ())
    assert waves(handle, 0) == waves(recomputing, 0)
    assert copies.to_cpu > 0 and copies.to_device > 0
    handle.side.runtime.drain()
    assert handle.violations() == [] and handle.healthy()


def test_without_the_records_travelling_back_the_restored_blocks_are_reported(monkeypatch):
    monkeypatch.setattr(HostRecords, "loaded_back", lambda self, kind, host_slots, slots: None)
    engine = offloading_engine(monkeypatch)
    copies = Copies()
    engine.host_tier.add_listener(copies)
    handle = EngineHandle(engine, CanaryConfig(real_data="all", sweep_interval=0, kernels=KERNELS))
    handle.reset(0, ())
    waves(handle, 0)
    head = [v for v in handle.violations() if v.phase == "HEAD"]
    # At the restored slots (and a chain break where a restored run ends inside a request's prefix).
    assert {v.slot for v in head} & copies.restored
    assert {v.slot for v in head if v.reasons != ("verify_chain_hash",)} <= copies.restored


def test_a_byte_changed_in_the_cpu_pool_is_reported_by_the_first_forward_after_the_restore(monkeypatch):
    engine = offloading_engine(monkeypatch)
    handle = EngineHandle(engine, CanaryConfig(real_data="all", sweep_interval=0, kernels=KERNELS))
    detected = 0
    for seed in range(3):
        handle.reset(seed, (PerturbSpec("real_kv_host", prob=0.5),))
        waves(handle, seed, n=2)
        for inj in handle.injections():
            restored = [p for p in inj.moved_to if p.side == "single"]
            assert inj.status == "detected" or not restored, inj.describe()
            if inj.status == "detected":
                v = inj.detected_by
                assert (v.phase, v.reasons) == ("HEAD", ("verify_real_kv_hash",)) and (v.side, v.slot) in {
                    (p.side, p.slot) for p in restored}
                detected += 1
    assert detected > 0
