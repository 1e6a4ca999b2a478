"""CUDA graphs on transformers (GPU only): transformers replays its captured forward and the
canary replays its own captured HEAD and RECHECK+TAIL around it; a run is clean, and K bytes
damaged between two decode steps are reported by the next forward's replayed HEAD at that slot."""

from __future__ import annotations

import pytest
import torch

from .support import INSTALL, make_engine

pytest.importorskip("transformers", reason=INSTALL)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

from kvcanary_kernels.records import GroupKind  # noqa: E402
from pytest_kvcanary.config import CanaryConfig  # noqa: E402
from pytest_kvcanary.handles.single import EngineHandle  # noqa: E402

PROMPTS = [[11 + i for i in range(37)], [90 + i for i in range(21)]]


def graph_handle() -> EngineHandle:
    engine = make_engine("mha", use_cuda_graph=True, canary_graphs=True)
    handle = EngineHandle(engine, CanaryConfig(real_data="all", sweep_interval=2, kernels="triton"))
    handle.reset(0, ())
    return handle


def test_replayed_canary_is_clean_and_matches_eager_outputs():
    handle = graph_handle()
    outputs = handle.generate(PROMPTS, max_new_tokens=8)
    handle.side.runtime.drain()
    assert handle.violations() == []
    assert handle.engine._graphs[0].head is not None and handle.engine._graphs[0].tail is not None
    eager = make_engine("mha").generate(PROMPTS, max_new_tokens=8)
    assert outputs == eager


def test_damage_between_decode_steps_is_reported_by_the_replayed_head():
    handle = graph_handle()
    engine = handle.engine
    step = engine.processor._generation_step
    full = next(g for g in engine.groups if g.kind is GroupKind.FULL)
    damaged: list[int] = []

    def damaging_step(model):
        if engine._steps == 4 and not damaged:  # a decode step, canary graphs captured by now
            block = int(engine._tables[GroupKind.FULL][0, 0])
            full.k_layers[0][block, 3] += 1.0
            damaged.append(block * full.page_size + 3)
        step(model)

    engine.processor._generation_step = damaging_step
    handle.generate(PROMPTS, max_new_tokens=8)
    handle.side.runtime.drain()
    assert damaged and engine._graphs[0].head is not None
    found = [v for v in handle.violations() if v.phase == "HEAD" and v.slot == damaged[0]]
    assert found and found[0].step == 4 and "verify_real_kv_hash" in found[0].reasons, handle.violations()[:3]
