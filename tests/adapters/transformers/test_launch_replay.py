"""On CUDA the runtime replays an eager forward's HEAD and TAIL, and the adapter its staging of the
view, from CUDA graphs once their buffers repeat (launch_replay.py): a replayed staging leaves the
view and block tables as launching it again does, transformers' forwards run that way, stay clean,
and faults injected while they do are each named at their slot by the replayed HEAD."""

from __future__ import annotations

import random

import pytest
import torch

from .support import INSTALL, make_handle

pytest.importorskip("transformers", reason=INSTALL)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

from pytest_kvcanary.canary.runtime import view_tensors  # noqa: E402
from pytest_kvcanary.config import PerturbSpec  # noqa: E402


def waves(handle, seed: int) -> None:
    """Three waves of four distinct prompts of one length: the waves' forwards repeat their index
    buffers' shapes, so the adapter's staging is replayed from the third wave on."""
    rng = random.Random(seed)
    length = rng.randrange(17, 40)
    for wave in range(3):
        prompts = [[256 + 4 * wave + i] + [rng.randrange(256) for _ in range(length)] for i in range(4)]
        handle.generate(prompts, max_new_tokens=6)
    handle.side.runtime.drain()


def replays(handle) -> tuple[int, int]:
    """(the runtime's replays, the adapter's staging replays) so far."""
    return handle.side.runtime._replay.replays, handle.engine._forward.view_staging.replays


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_a_replayed_staging_leaves_the_view_as_launching_it_again_does(monkeypatch, attention):
    handle = make_handle(attention)
    engine = handle.engine
    staging, compared = engine._forward.view_staging, []

    def run_then_launch_again(key, launch):
        replayed = key in staging._graphs
        staging_run(key, launch)
        if replayed:
            replayed_state = staged()
            launch()
            for name, (a, b) in enumerate(zip(replayed_state, staged())):
                assert torch.equal(a, b), (name, key)
            compared.append(key)

    def staged() -> list[torch.Tensor]:
        """The view's tensors and the block tables' lane rows (not their scratch row, where padded
        rows' entries land in no fixed order)."""
        return [t.clone() for t in view_tensors(engine._forward.view) if t is not None] + \
            [table[:-1].clone() for table in engine._forward.tables.values()]

    staging_run = staging.run
    monkeypatch.setattr(staging, "run", run_then_launch_again)
    waves(handle, 0)
    assert compared and handle.violations() == []


def test_replayed_launches_stay_clean_and_name_each_fault_at_its_slot():
    handle = make_handle("mha")
    waves(handle, 0)
    assert min(replays(handle)) > 0 and handle.violations() == []
    for seed in range(3):
        handle.reset(seed, (PerturbSpec("real_kv_used", warmup_steps=4),))
        before = replays(handle)
        waves(handle, seed)
        assert all(now > then for now, then in zip(replays(handle), before))
        injections = handle.injections()
        assert injections, f"seed {seed}: nothing injected"
        for inj in injections:
            assert inj.status == "detected", inj.describe()
            assert inj.detected_by.phase == "HEAD" and inj.detected_by.slot == inj.slot, inj.describe()
        assert {v.slot for v in handle.violations()} <= {inj.slot for inj in injections}
