"""On CUDA the runtime replays an eager forward's HEAD and TAIL from CUDA graphs once their buffers
repeat (canary/replay.py): transformers' forwards run that way, stay clean, and faults injected
while they do are each named at their slot by the replayed HEAD."""

from __future__ import annotations

import random

import pytest
import torch

from .support import INSTALL, make_handle

pytest.importorskip("transformers", reason=INSTALL)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

from pytest_kvcanary.config import PerturbSpec  # noqa: E402


def waves(handle, seed: int) -> None:
    rng = random.Random(seed)
    for wave in range(2):
        prompts = [[256 + 4 * wave + i] + [rng.randrange(256) for _ in range(rng.randrange(17, 40))] for i in range(4)]
        handle.generate(prompts, max_new_tokens=6)
    handle.side.runtime.drain()


def test_replayed_launches_stay_clean_and_name_each_fault_at_its_slot():
    handle = make_handle("mha")
    runtime = handle.side.runtime
    waves(handle, 0)
    assert runtime._replay.replays > 0 and handle.violations() == []
    for seed in range(3):
        handle.reset(seed, (PerturbSpec("real_kv_used", warmup_steps=4),))
        before = runtime._replay.replays
        waves(handle, seed)
        assert runtime._replay.replays > before
        injections = handle.injections()
        assert injections, f"seed {seed}: nothing injected"
        for inj in injections:
            assert inj.status == "detected", inj.describe()
            assert inj.detected_by.phase == "HEAD" and inj.detected_by.slot == inj.slot, inj.describe()
        assert {v.slot for v in handle.violations()} <= {inj.slot for inj in injections}
