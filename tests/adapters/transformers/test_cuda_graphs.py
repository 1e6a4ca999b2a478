"""CUDA graphs on transformers (GPU only): with canary_graphs the canary's HEAD, RECHECK and TAIL
run inside the model's forward, so transformers captures them in its own graphs and replays them
with the forward; a run is clean, generates what eager batching does, and every forward ran TAIL
on the device once while Python called it only for the forwards transformers ran eagerly or
captured; K bytes damaged between two decode steps are reported by the next forward's replayed
HEAD at that slot. An engine dropped with the canary attached does not abort the next engine's
capture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .support import INSTALL, make_engine, python_tails

pytest.importorskip("transformers", reason=INSTALL)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

from kvcanary_kernels.records import GroupKind, Half  # noqa: E402
from pytest_kvcanary.config import CanaryConfig  # noqa: E402
from pytest_kvcanary.handles.single import EngineHandle  # noqa: E402

PROMPTS = [[11 + i for i in range(37)], [90 + i for i in range(21)]]


def graph_handle(**options) -> EngineHandle:
    engine = make_engine("mha", use_cuda_graph=True, canary_graphs=True, **options)
    handle = EngineHandle(engine, CanaryConfig(real_data="all", sweep_interval=2, kernels="triton"))
    handle.reset(0, ())
    return handle


def assert_replayed_inside_transformers_graphs(handle: EngineHandle, python_steps: list[int]) -> None:
    """Every forward advanced the device's step once (one TAIL each), most of them without Python
    calling TAIL (replayed from transformers' graphs, which it captured under these hooks)."""
    engine = handle.engine
    assert int(handle.side.runtime.ring.step) == engine._forward.steps
    replayed = set(range(engine._forward.steps)) - set(python_steps)
    assert len(replayed) >= engine._forward.steps // 2, python_steps
    assert all(io.graphs._storage for io in engine._io.device_ios)


@pytest.mark.parametrize("batching", ["sync", "async"])
def test_canary_inside_transformers_graphs_is_clean_and_matches_eager_outputs(batching):
    handle = graph_handle(use_async_batching=batching == "async")
    python_steps = python_tails(handle)
    outputs = handle.generate(PROMPTS, max_new_tokens=8)
    handle.side.runtime.drain()
    assert handle.violations() == []
    assert_replayed_inside_transformers_graphs(handle, python_steps)
    assert outputs == make_engine("mha").generate(PROMPTS, max_new_tokens=8)


def test_damage_between_decode_steps_is_reported_by_the_replayed_head():
    handle = graph_handle()
    engine = handle.engine
    python_steps = python_tails(handle)
    step = engine.processor._generation_step
    full = next(g for g in engine.groups if g.kind is GroupKind.FULL)
    damaged: list[int] = []

    def damaging_step(model):
        if engine._forward.steps == 4 and not damaged:  # a decode step replayed from transformers' graph
            block = int(engine._forward.tables[GroupKind.FULL][0, 0])
            full.k_layers[0][block, 3] += 1.0
            damaged.append(block * full.page_size + 3)
        step(model)

    engine.processor._generation_step = damaging_step
    handle.generate(PROMPTS, max_new_tokens=8)
    handle.side.runtime.drain()
    assert damaged and 4 not in python_steps
    assert_replayed_inside_transformers_graphs(handle, python_steps)
    found = [v for v in handle.violations() if v.phase == "HEAD" and v.slot == damaged[0]]
    assert found and found[0].step == 4 and "verify_real_kv_hash" in found[0].reasons, handle.violations()[:3]


def test_tail_is_captured_on_its_own_stream_and_rechecks_kv_damaged_after_the_last_layer():
    """TAIL is captured on the stream forked after the last decoder layer, and its RECHECK still
    comes after everything the forward did before the fork: K bytes of the layer RECHECK re-reads,
    damaged by a captured hook right after the last layer (slot 3 of every block, in every
    replay), are reported by RECHECK there."""
    handle = graph_handle()
    engine, runtime = handle.engine, handle.side.runtime
    forward = engine._forward
    after_forward, captured_on = runtime.after_forward, []

    def recording(view):
        if torch.cuda.is_current_stream_capturing():
            captured_on.append(torch.cuda.current_stream())
        after_forward(view)

    runtime.after_forward = recording
    handle.generate(PROMPTS, max_new_tokens=8)
    runtime.drain()
    assert handle.violations() == []
    assert captured_on and all(s == forward._tail_stream for s in captured_on)

    full = next(g for g in engine.groups if g.kind is GroupKind.FULL)
    last_source = runtime.group(GroupKind.FULL).halves[Half.K].source_layers[-1]  # what RECHECK re-reads

    def damaging(layer, args, output):  # captured before _fork_tail's hook: every replay damages
        if torch.cuda.is_current_stream_capturing():
            full.k_layers[last_source][:, 3] += 1.0

    hook = forward._last_layer.register_forward_hook(damaging, prepend=True)
    engine._io.drop_graphs()
    try:
        handle.generate(PROMPTS, max_new_tokens=8)
    finally:
        hook.remove()
    runtime.drain()
    rechecked = [v for v in handle.violations() if v.phase == "RECHECK"]
    assert rechecked and all(v.slot % full.page_size == 3 for v in rechecked), handle.violations()[:3]
    assert all("verify_real_kv_hash" in v.reasons for v in rechecked)


def test_changing_the_hooks_drops_the_graphs_captured_under_the_old_ones():
    handle = graph_handle()
    engine = handle.engine
    handle.generate(PROMPTS, max_new_tokens=4)
    old = dict(engine._io.device_ios[0].graphs._storage)
    assert old
    engine.set_forward_hooks(None)  # the canary off: transformers captures its forward alone again
    assert not engine._io.device_ios[0].graphs._storage
    before = int(handle.side.runtime.ring.step)
    engine.generate(PROMPTS, max_new_tokens=4)
    assert int(handle.side.runtime.ring.step) == before  # no canary work replayed with the canary off


# The canary's CUDA graphs (its sweep's) freed by a garbage collection that runs while transformers
# computes a forward in its graph pool (the eager pass before a capture) abort the process: PyTorch
# asserts that no capture is underway when a graph's pool is released. A collection there is forced.
DROPPED_ENGINE_THEN_A_COLLECTION_IN_THE_WARMUP = """
import gc
from tests.adapters.transformers.support import make_engine, make_handle
prompts = [[11 + i for i in range(37)]]
dropped = make_handle("mha", use_cuda_graph=True)
dropped.generate(prompts * 3, max_new_tokens=8)
assert dropped.side.runtime._sweep_graph is not None
del dropped  # cyclic garbage: left to the collector
engine = make_engine("mha", use_cuda_graph=True)
runner = engine.processor.model_runner
forward = runner._forward_process_and_sample

def collecting(*args):
    gc.collect()
    return forward(*args)

runner._forward_process_and_sample = collecting
assert len(engine.generate(prompts, max_new_tokens=4)[0]) == 4
"""


def test_an_engine_dropped_with_the_canary_does_not_abort_the_next_engines_capture():
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, "-c", DROPPED_ENGINE_THEN_A_COLLECTION_IN_THE_WARMUP], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
