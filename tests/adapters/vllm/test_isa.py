"""The attention_isa setting: vLLM's CPU attention runs the path it names, whatever the CPU would
pick, and the canary guards each path vLLM can be made to run (real_data partial and all). On a CPU
with AMX, vLLM would pick its amx path, whose layout keeps no half one run per token; the default
(readable) runs vec there."""

from __future__ import annotations

import random

import pytest
import torch

from pytest_kvcanary.adapters.vllm.isa import CHOICES, ENV, chosen

from .support import INSTALL, make_engine, make_handle, prompts_with_shared_prefixes, stems, unsupported

pytest.importorskip("vllm", reason=INSTALL)

PATHS = ["vec", "vec16", pytest.param("amx", marks=pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="vLLM's amx path needs a CPU with AMX tiles"))]


@pytest.mark.parametrize("setting,vllm_choice,expected", [
    ("readable", "amx", "vec"), ("readable", "vec", "vec"), ("readable", "vec16", "vec16"),
    ("vllm", "amx", "amx"), ("vllm", "vec", "vec"), ("vec", "vec16", "vec"), ("vec16", "vec", "vec16"),
])
def test_setting_decides_the_path(setting, vllm_choice, expected):
    assert chosen(setting, vllm_choice) == expected


def test_a_bad_value_names_the_setting_and_its_values(monkeypatch):
    from pytest_kvcanary.adapters.vllm.engine import VllmSettings

    with pytest.raises(ValueError, match="attention_isa") as info:
        VllmSettings(attention_isa="avx2")
    assert all(c in str(info.value) for c in CHOICES)
    monkeypatch.setenv(ENV, "vec16")
    assert VllmSettings().attention_isa == "vec16"
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=ENV):
        VllmSettings()


def layer_paths(engine) -> set[str]:
    from pytest_kvcanary.adapters.vllm.versions import layer_isa

    layers = engine.llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return {layer_isa(layers[name]) for name in engine._kv_caches}


def run_clean_and_faulty(engine, real_data: str) -> None:
    """A clean workload with prefix-cache hits has no violation; a byte flipped in a slot a
    forward reads is reported at that slot."""
    from pytest_kvcanary.config import PerturbSpec

    handle = make_handle(engine, real_data=real_data)
    rng = random.Random(0)
    handle.generate(prompts_with_shared_prefixes(rng, 4, stems(rng, count=2)), 4)
    assert handle.violations() == []
    assert handle.stats()["single"]["protected_tokens"] > 0
    handle = make_handle(engine, (PerturbSpec("real_kv_used", warmup_steps=2),), real_data=real_data)
    first = [[rng.randrange(256) for _ in range(rng.randrange(40, 90))] for _ in range(3)]
    handle.generate(first, 4)
    handle.generate([p + [rng.randrange(256) for _ in range(10)] for p in first], 4)
    detected = [i for i in handle.injections() if i.status == "detected"]
    assert detected, handle.injections()
    assert all((i.detected_by.slot, i.detected_by.half) == (i.slot, i.half) for i in detected)


@pytest.fixture(scope="module", params=PATHS)
def path_engine(request):
    return request.param, make_engine(attention_isa=request.param)


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_each_path_is_guarded(path_engine, real_data):
    path, engine = path_engine
    assert layer_paths(engine) == {path}
    run_clean_and_faulty(engine, real_data)


def test_readable_runs_vec_where_vllm_would_run_amx(monkeypatch):
    """vLLM's chooser as on a CPU with AMX tiles (its amx path, which this CPU may lack):
    readable runs vec, and vLLM's chooser is back in place once the LLM is built."""
    from vllm.v1.attention.backends import cpu_attn

    def on_amx_cpu(*args, **kwargs) -> str:
        return "amx"

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", on_amx_cpu)
    engine = make_engine(attention_isa="readable")
    assert layer_paths(engine) == {"vec"}
    assert cpu_attn._get_attn_isa is on_amx_cpu
    run_clean_and_faulty(engine, "partial")


def test_readable_runs_cpu_mla_where_vllm_would_run_amx_mla(monkeypatch):
    """vLLM's backend choice as on a CPU with AMX tiles (AMX_MLA for latent attention, which the
    adapter does not know and this CPU may not run): readable asks for CPU_MLA, which vLLM runs."""
    if reason := unsupported("mla"):
        pytest.skip(reason)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    engine = make_engine("mla", attention_isa="readable")
    layers = engine.llm.llm_engine.vllm_config.compilation_config.static_forward_context
    assert {layers[name].attn_backend.get_name() for name in engine._kv_caches} == {"CPU_MLA"}
    run_clean_and_faulty(engine, "partial")
