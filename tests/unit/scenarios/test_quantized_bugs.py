"""The two scale bug classes of quantized KV SGLang had, put back into the reference engine's real
code paths:

- SGLang #24198 (garbage only on a radix prefix hit, #19603): the path that builds a forward's
  dequantization scales leaves the layers' scales out when the forward reads a cached prefix, so
  attention stores and reads that forward's KV through 1.0 while every other forward is right.
- SGLang #20705 (scales silently falling back to 1.0): a weight reload (as an online weight update
  does) from a checkpoint that holds no k_scale / v_scale resets, in the loader, the scales
  attention reads to their default, 1.0, while the KV cached under the loaded scales stays in the
  radix cache.

Each test proves the damage without the canary (the request's greedy outputs against a no-cache
recomputation through the right scales), checks that the canary's first reports are `verify_scale`
of group SCALES at HEAD of the first forward handed 1.0, at every layer (slot) and KV head
(position) of both halves, and that the same run without the patch is clean.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvcanary_kernels.inputs import ScaleInputs
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig, Request, weights
from pytest_kvcanary.reference_engine.attention import DenseKV

from scenario_support import DEVICE, Report, attach_canary, first_reports, tokens

ONE = 0x3F800000  # 1.0's float32 bits
SCALE = ("verify_scale",)


def quantized_engine(kv_dtype: str) -> Engine:
    """The scenarios' 4-layer model with its KV in kv_dtype, one scale per KV head and layer."""
    model = ModelConfig(max_context=64, seed=0, kv_dtype=kv_dtype, kv_scale="head")
    return Engine(EngineConfig(model=model, max_batch_tokens=64, device=DEVICE))


def every_scale(engine: Engine, phase: str = "HEAD") -> set[Report]:
    """A verify_scale report at each layer (slot) and KV head (position) of both halves."""
    layers, heads = engine.model.kv_scales.k.shape
    return {(phase, half, "SCALES", SCALE, layer, head, -1)
            for half in "KV" for layer in range(layers) for head in range(heads)}


@torch.no_grad()
def off_the_right_scales(engine: Engine, req: Request, scales: ScaleInputs) -> bool:
    """True when some greedy output of req is not the argmax of a no-cache forward over its prompt
    and outputs, with K and V stored and read through `scales` (the right ones). Independent of the
    canary and of the engine's current scales."""
    model = engine.model
    ids = torch.tensor(req.prompt_ids + req.output_ids[:-1], device=engine.device)
    positions = torch.arange(ids.numel(), device=engine.device)
    hidden = model(ids, positions, DenseKV(positions, model.kv_codec, scales), torch.zeros_like(positions))
    return model.compute_logits(hidden).argmax(-1)[len(req.prompt_ids) - 1:].tolist() != req.output_ids


def run_to_end(engine: Engine, *reqs: Request) -> None:
    while not all(r.finished for r in reqs):
        engine.step()


# ---- SGLang #24198: a prefix hit's forward is handed no scales -------------------------------


def prefix_hit_after_fresh_traffic(engine: Engine) -> tuple[Request, int]:
    """Two fresh prompts prefill and decode together (no prefix cached: right scales); then a prompt
    extending the first one's 20 tokens arrives: its prefill reads them from the radix cache. Returns
    that request, run to its end, and the forward index of its prefill."""
    shared = tokens(300, 20)
    run_to_end(engine, engine.submit(shared, 4), engine.submit(tokens(301, 13), 4))
    hit = engine.submit(shared + tokens(302, 3), 6)
    at = engine.forward_count
    run_to_end(engine, hit)
    assert engine.scheduler.num_prefix_hits == 1
    return hit, at


def leave_the_scales_out_on_a_prefix_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: the forward's view (whose scales attention stores and dequantizes through) carries
    scales of 1.0 when a prefill row reads a cached prefix."""
    view_of = Engine._view

    def view(self: Engine, batch):
        built = view_of(self, batch)
        if batch.is_prefill and max(batch.prefix_lens) > 0:
            built = dataclasses.replace(built, scales=ScaleInputs(*(torch.ones_like(s) for s in built.scales)))
        return built

    monkeypatch.setattr(Engine, "_view", view)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp4_e2m1"])
def test_a_prefix_hit_dequantized_with_scale_one_is_named_at_its_head(monkeypatch, kv_dtype):
    leave_the_scales_out_on_a_prefix_hit(monkeypatch)
    engine = quantized_engine(kv_dtype)
    runtime = attach_canary(engine)
    right = ScaleInputs(*(s.clone() for s in engine.model.kv_scales))
    hit, at = prefix_hit_after_fresh_traffic(engine)
    assert off_the_right_scales(engine, hit, right), "no damage to see"
    step, first = first_reports(runtime)
    assert (step, first) == (at, every_scale(engine))
    assert {v.stored for v in runtime.log.violations} == {ONE}


# ---- SGLang #20705: a reload falls back to scales of 1.0 ------------------------------------


def reload_then_hit(engine: Engine, checkpoint: Path) -> tuple[Request, int]:
    """A prompt runs to its end (its KV cached under the loaded scales); the weights are reloaded from
    a checkpoint of the same model (which, like most, stores no KV scales); then the prompt comes
    back extended and its prefill reads the cached KV. Returns that request and the forward index of
    its prefill."""
    shared = tokens(310, 20)
    run_to_end(engine, engine.submit(shared, 4))
    weights.load_weights(engine.model, checkpoint)
    again = engine.submit(shared + tokens(311, 3), 6)
    at = engine.forward_count
    run_to_end(engine, again)
    assert engine.scheduler.num_prefix_hits == 1
    return again, at


def fall_back_to_one_without_checkpoint_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: the loader, finding no k_scale / v_scale in the checkpoint, sets the model's scales
    (the buffers every forward's view hands attention) to their default, 1.0."""
    load = weights.load_weights

    def load_weights(model, path) -> None:
        load(model, path)
        for scales in model.kv_scales:
            if scales is not None:
                scales.fill_(1.0)

    monkeypatch.setattr(weights, "load_weights", load_weights)


@pytest.mark.parametrize("kv_dtype", ["fp8_e5m2", "fp4_e2m1"])
def test_scales_that_fall_back_to_one_at_a_reload_are_named_at_the_next_head(monkeypatch, tmp_path, kv_dtype):
    fall_back_to_one_without_checkpoint_scales(monkeypatch)
    engine = quantized_engine(kv_dtype)
    weights.save_checkpoint(engine.model, tmp_path)
    runtime = attach_canary(engine)
    right = ScaleInputs(*(s.clone() for s in engine.model.kv_scales))
    again, at = reload_then_hit(engine, tmp_path)
    assert torch.equal(engine.model.kv_scales.k, torch.ones_like(right.k))
    assert off_the_right_scales(engine, again, right), "no damage to see"
    step, first = first_reports(runtime)
    assert (step, first) == (at, every_scale(engine))
    runtime.sweep()  # the pool holds 1.0 too: the sweep names every scale as well
    runtime.drain()
    assert {(v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.row)
            for v in runtime.log.violations if v.phase == "SWEEP"} == every_scale(engine, "SWEEP")


# ---- the same runs without the bugs ---------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("scenario", ["prefix_hit", "reload"])
def test_the_scale_workloads_without_the_bugs_are_clean(tmp_path, kv_dtype, scenario):
    engine = quantized_engine(kv_dtype)
    weights.save_checkpoint(engine.model, tmp_path)
    runtime = attach_canary(engine)
    right = ScaleInputs(*(s.clone() for s in engine.model.kv_scales))
    req, _ = prefix_hit_after_fresh_traffic(engine) if scenario == "prefix_hit" else reload_then_hit(engine, tmp_path)
    assert not off_the_right_scales(engine, req, right)
    runtime.sweep()
    assert first_reports(runtime) == (None, set()) and runtime.health_problems() == []
