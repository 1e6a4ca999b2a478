"""make_transformers_engine: the pool groups of each attention kind, a local checkpoint, and the
usage errors that name what was wrong."""

from __future__ import annotations

import pytest

from pytest_kvcanary.canary.seam import UnsupportedAttention

from .support import INSTALL

pytest.importorskip("transformers", reason=INSTALL)

from kvcanary_kernels.records import GroupKind  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb import (  # noqa: E402
    ASYNC_BATCHING_VARIABLE, CUDA_GRAPHS_VARIABLE, make_transformers_engine, random_checkpoint,
)
from pytest_kvcanary.adapters.transformers_cb.model import SLIDING_WINDOW  # noqa: E402


def test_each_attention_kind_has_its_pool_groups():
    mha = make_transformers_engine("mha", "cpu", 0, None)
    assert [(g.kind, g.window) for g in mha.canary_groups()] == [(GroupKind.FULL, None)]
    swa = make_transformers_engine("swa", "cpu", 0, None)
    groups = swa.canary_groups()
    assert [(g.kind, g.window, g.mapping.ring) for g in groups] == [
        (GroupKind.FULL, None, 0), (GroupKind.SWA, SLIDING_WINDOW - 1, SLIDING_WINDOW)]
    assert [g.layers for g in swa.groups] == [(1, 3), (0, 2)]


def test_a_local_checkpoint_runs_as_the_default_does():
    prompts = ["a local checkpoint"]
    built = make_transformers_engine("mha", "cpu", 3, None).generate(prompts, 4)
    assert make_transformers_engine("mha", "cpu", 0, str(random_checkpoint("mha", 3))).generate(prompts, 4) == built


def test_usage_errors_name_the_setting_and_value(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--kv-canary-model must be a local Hugging Face checkpoint directory"):
        make_transformers_engine("mha", "cpu", 0, str(tmp_path))
    with pytest.raises(UnsupportedAttention, match=r"engine 'transformers' has no attention kind 'mla'; it runs mha, swa"):
        make_transformers_engine("mla", "cpu", 0, None)
    for variable, option in ((CUDA_GRAPHS_VARIABLE, "use_cuda_graph"), (ASYNC_BATCHING_VARIABLE, "use_async_batching")):
        monkeypatch.setenv(variable, "yes")
        with pytest.raises(ValueError, match=rf"{variable} must be one of 0, 1; got 'yes'"):
            make_transformers_engine("mha", "cpu", 0, None)
        monkeypatch.setenv(variable, "1")
        with pytest.raises(ValueError, match=rf"{option}=True needs a CUDA device; the model is on cpu"):
            make_transformers_engine("mha", "cpu", 0, None)
        monkeypatch.delenv(variable)
    engine = make_transformers_engine("mha", "cpu", 0, None)
    with pytest.raises(ValueError, match=r"= 520 exceeds max_context \(512\)"):
        engine.generate([[1] * 500], max_new_tokens=20)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1; got 0"):
        engine.generate(["x"], max_new_tokens=0)
    with pytest.raises(TypeError, match=r"a sequence of prompts"):
        engine.generate("x", max_new_tokens=1)
