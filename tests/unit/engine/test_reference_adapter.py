"""The reference adapter's factory: each attention kind, random weights or a local checkpoint."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.reference_engine import ModelConfig
from pytest_kvcanary.reference_engine.model import CausalLM
from pytest_kvcanary.reference_engine.weights import save_checkpoint


@pytest.mark.parametrize("attention, halves", [("mha", [2]), ("swa", [2, 2]), ("mla", [1])])
def test_each_attention_kind_builds(attention, halves):
    engine = make_reference_engine(attention, "cpu", seed=3)
    assert engine.config.model.attention == attention and engine.config.model.seed == 3
    assert [1 + bool(g.v_layers) for g in engine.canary_groups()] == halves


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_speculative_decoding_adds_the_draft_group(attention):
    engine = make_reference_engine(attention, "cpu", seed=0, speculative_k=3)
    assert engine.config.speculative_k == 3 and engine.drafter is not None
    assert [g.kind.name for g in engine.canary_groups()] == ["FULL", "DRAFT"]


def test_a_checkpoint_replaces_the_random_weights(tmp_path):
    source = CausalLM(ModelConfig(max_context=128, seed=11))
    save_checkpoint(source, tmp_path)
    engine = make_reference_engine("swa", "cpu", seed=0, model=str(tmp_path))
    assert engine.config.checkpoint == str(tmp_path) and engine.config.model.attention == "swa"
    weights = dict(engine.model.named_parameters())
    assert all(torch.equal(p, weights[name]) for name, p in source.named_parameters())


def test_latent_models_are_not_written_as_llama_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="attention must be mha or swa; got 'mla'"):
        save_checkpoint(CausalLM(ModelConfig(attention="mla")), tmp_path)
