"""The canary runs inside the model's forward through a pre-hook and a hook on the model: only in
a forward the engine runs (a model call of a test's own, a cacheless reference, is left alone),
on the input ids transformers staged for that forward (a forward fed other ones is refused, as
the view would not be what it consumed), and the hooks leave the model with the engine."""

from __future__ import annotations

import gc

import pytest

from .support import DEVICE, INSTALL, make_handle, reference_kv

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb import TransformersEngine, load, random_checkpoint  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb.versions import UnsupportedModel  # noqa: E402

PROMPT = [40 + i for i in range(19)]


def test_only_the_engines_forwards_run_the_canary():
    handle = make_handle("mha")
    runtime = handle.side.runtime
    handle.generate([PROMPT], max_new_tokens=3)
    assert int(runtime.ring.step) == handle.engine._forward.steps == 3  # TAIL once per forward of the engine
    reference_kv(handle.engine.model, PROMPT)  # the model called directly
    assert int(runtime.ring.step) == 3
    runtime.drain()
    assert handle.violations() == []


def test_a_forward_fed_other_input_ids_than_transformers_staged_is_refused():
    handle = make_handle("mha")
    engine = handle.engine
    compute = engine._forward._compute  # transformers' own compute_batch, inside the engine's wrapper

    def embedding_a_copy(model, batch_data):
        batch_data["input_ids"] = batch_data["input_ids"].clone()
        compute(model, batch_data)

    engine._forward._compute = embedding_a_copy
    with pytest.raises(UnsupportedModel, match="input ids transformers staged"):
        handle.generate([PROMPT], max_new_tokens=2)


def test_the_hooks_leave_the_model_with_the_engine():
    model, tokenizer = load(random_checkpoint("mha", 0), DEVICE)
    engine = TransformersEngine(model, tokenizer)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    del engine
    gc.collect()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_closed_engine_refuses_a_canary_and_requests():
    """close() (a handle's close calls it) takes the hooks off the model: a canary attached after
    would see no forward, so attaching one, or running requests, raises instead."""
    handle = make_handle("mha")
    engine, runtime = handle.engine, handle.side.runtime
    handle.close()
    assert not engine.model._forward_pre_hooks and not engine.model._forward_hooks
    with pytest.raises(RuntimeError, match="set_forward_hooks on a closed TransformersEngine"):
        engine.set_forward_hooks(runtime)
    with pytest.raises(RuntimeError, match="generate on a closed TransformersEngine"):
        engine.generate([PROMPT], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="serve on a closed TransformersEngine"):
        engine.serve([])
    engine.set_forward_hooks(None)  # detaching stays allowed


def test_the_last_decoder_layer_is_the_one_tail_forks_after():
    from torch import nn

    from pytest_kvcanary.adapters.transformers_cb.forward import last_decoder_layer

    for attention in ("mha", "swa"):
        model, _ = load(random_checkpoint(attention, 0), DEVICE)
        layers = model.get_decoder().layers
        assert len(layers) > 1 and last_decoder_layer(model) is layers[-1]
    assert last_decoder_layer(nn.Linear(2, 2)) is None  # no decoder: TAIL stays at the model's end
