"""Engine, model and device problems are usage errors found before any test runs: exit 4, one
line naming the option, the value and the problem, no traceback."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy  # noqa: F401  # loaded before any inline run (which would unload it: numpy loads once a process)
import pytest
import torch  # noqa: F401  # likewise: a start-up check of a run may import it

LLAMA = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 16, "vocab_size": 300}
CHECKPOINTS = [
    # (what the directory holds, engine, what the error says about it)
    ({"config.json": "{not json"}, "reference", "has a config.json that is not valid JSON (*)"),
    ({"config.json": json.dumps({**LLAMA, "model_type": "gpt2"}), "model.safetensors": ""}, "reference",
     "has model_type 'gpt2', which the engine does not support (llama, qwen2)"),
    ({"config.json": json.dumps(LLAMA)}, "reference", "has no weights (*.safetensors or pytorch_model*.bin)"),
    ({}, "reference", "has no config.json"),
    ({"config.json/": ""}, "reference", "has a config.json that is a directory, not a file"),
    ({"config.json": json.dumps({**LLAMA, "torch_dtype": "float33"}), "model.safetensors": ""}, "reference",
     "has a config.json the engine cannot read (config.json torch_dtype must name a torch dtype (float32, float16, "
     "bfloat16); got 'float33')"),
    ({"config.json": "[1, 2]"}, "transformers", "has a config.json that is not a JSON object"),
    ({"config.json": json.dumps({**LLAMA, "model_type": "no-such-type"}), "model.safetensors": ""}, "transformers",
     "has model_type 'no-such-type', which the engine does not support (the types it knows)"),
    ({"config.json": json.dumps(LLAMA)}, "transformers", "has no weights (*.safetensors or pytorch_model*.bin)"),
    ({}, "transformers", "has no config.json"),
    ({"config.json": json.dumps(LLAMA), "model.safetensors": "not a safetensors file"}, "reference",
     "has a model.safetensors that is not a readable safetensors file (Error while deserializing header: header "
     "too large)"),
    ({"config.json": json.dumps(LLAMA), "model.safetensors": "not a safetensors file"}, "transformers",
     "has a model.safetensors that is not a readable safetensors file (Error while deserializing header: header "
     "too large)"),
]


def _one_usage_error(result: pytest.RunResult, line: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [text for text in result.errlines if text.strip()] == [line]
    assert "RAN" not in result.stdout.str() and "Traceback" not in result.stderr.str()


@pytest.mark.parametrize("files, engine, problem", CHECKPOINTS,
                         ids=[f"{e}-{p.split(' (')[0].replace(' ', '-')}" for _, e, p in CHECKPOINTS])
def test_a_model_directory_the_engine_cannot_load(kvtester: pytest.Pytester, files: dict[str, str], engine: str,
                                                  problem: str) -> None:
    if importlib.util.find_spec(engine) is None and engine != "reference":
        pytest.skip(f"{engine} is not installed")
    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    ckpt = kvtester.mkdir("ckpt")
    for name, text in files.items():
        if name.endswith("/"):
            (ckpt / name).mkdir()
        else:
            (ckpt / name).write_text(text)
    result = kvtester.runpytest_subprocess("-s", "--kv-canary", f"--kv-canary-engine={engine}",
                                           "--kv-canary-model=ckpt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --kv-canary-model must be a checkpoint the {engine} engine can load: "
                                 f"the directory {problem}; got 'ckpt'"])
    _one_usage_error(result, result.errlines[0])


@pytest.mark.parametrize("engine", ["reference", "transformers"])
def test_a_checkpoint_whose_tensors_do_not_fit_its_config(kvtester: pytest.Pytester, engine: str) -> None:
    """A Llama checkpoint whose config.json says another MLP width: found from the safetensors
    headers before any test runs, not as a load error in every test."""
    if engine != "reference":
        pytest.importorskip(engine)
    from pytest_kvcanary.reference_engine.config import ModelConfig
    from pytest_kvcanary.reference_engine.model import CausalLM
    from pytest_kvcanary.reference_engine.weights import save_checkpoint

    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    ckpt = kvtester.mkdir("ckpt")
    save_checkpoint(CausalLM(ModelConfig(num_layers=2, hidden=32, intermediate=64, tie_embeddings=False)), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    result = kvtester.runpytest_subprocess("-s", "--kv-canary", f"--kv-canary-engine={engine}",
                                           "--kv-canary-model=ckpt")
    _one_usage_error(result, f"ERROR: --kv-canary-model must be a checkpoint the {engine} engine can load: the "
                             "directory has tensors that do not fit the model its config.json describes: "
                             "model.layers.0.mlp.down_proj.weight and 5 more shaped [32, 64] where the model has "
                             "[32, 48]; got 'ckpt'")


def test_a_checkpoint_transformers_cannot_build_a_causal_model_from(kvtester: pytest.Pytester) -> None:
    pytest.importorskip("transformers")
    import numpy as np
    from safetensors.numpy import save_file

    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    ckpt = kvtester.mkdir("ckpt")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "t5"}))
    save_file({"shared.weight": np.zeros((4, 2), np.float32)}, str(ckpt / "model.safetensors"))
    result = kvtester.runpytest_subprocess("-s", "--kv-canary", "--kv-canary-engine=transformers",
                                           "--kv-canary-model=ckpt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --kv-canary-model must be a checkpoint the transformers engine can load: the "
                                 "directory describes no causal language model transformers can build (ValueError: "
                                 "Unrecognized configuration class *T5Config* AutoModelForCausalLM.); got 'ckpt'"])
    _one_usage_error(result, result.errlines[0])


def test_an_unknown_engine(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("def test_a(kv_engine): print('RAN')")
    result = pytester.runpytest_subprocess("-s", "--kv-canary", "--kv-canary-engine=nosuchengine")
    _one_usage_error(result, "ERROR: --kv-canary-engine must name an engine: reference, transformers, vllm, or one "
                             "a pytest_kvcanary_make_engine hook implementation returns (none is registered); "
                             "got 'nosuchengine'")


def test_cuda_without_a_gpu(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    result = kvtester.runpytest_subprocess("-s", "--kv-canary", "--kv-canary-device=cuda")
    _one_usage_error(result, "ERROR: --kv-canary-device asks for a GPU, and none is visible; got 'cuda'")


def test_nothing_is_checked_when_the_canary_is_off(kvtester: pytest.Pytester) -> None:
    kvtester.makepyfile("def test_a(): pass")
    kvtester.mkdir("ckpt")
    kvtester.runpytest("--kv-canary-device=cuda", "--kv-canary-model=ckpt").assert_outcomes(passed=1)


def _llama_checkpoint(path: Path) -> Path:
    from pytest_kvcanary.reference_engine.config import ModelConfig
    from pytest_kvcanary.reference_engine.model import CausalLM
    from pytest_kvcanary.reference_engine.weights import save_checkpoint

    save_checkpoint(CausalLM(ModelConfig(num_layers=2, hidden=32, intermediate=64)), path)
    return path


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files at mode 000")
@pytest.mark.parametrize("name, problem", [
    ("config.json", "has a config.json that cannot be read (Permission denied)"),
    ("model.safetensors", "has a model.safetensors that cannot be read (Permission denied)"),
])
def test_an_unreadable_checkpoint_file_is_named_as_unreadable(kvtester: pytest.Pytester, name: str,
                                                              problem: str) -> None:
    """Not "No such file or directory" nor "not valid JSON": what is wrong is the file's mode."""
    kvtester.makepyfile("def test_a(kv_engine): print('RAN')")
    ckpt = _llama_checkpoint(kvtester.path / "ckpt")
    (ckpt / name).chmod(0)
    result = kvtester.runpytest_subprocess("-s", "--kv-canary", "--kv-canary-model=ckpt")
    _one_usage_error(result, f"ERROR: --kv-canary-model must be a checkpoint the reference engine can load: the "
                             f"directory {problem}; got 'ckpt'")


def test_mla_on_a_llama_checkpoint_skips(kvtester: pytest.Pytester) -> None:
    """The reference engine runs a Llama checkpoint as mha or swa: an mla test skips saying so,
    instead of a load error in every test; the mha test runs."""
    kvtester.makeconftest("")  # the real harness
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_attention("mla")
        def test_latent(kv_engine): pass

        def test_full(kv_engine): pass
    """)
    _llama_checkpoint(kvtester.path / "ckpt")
    result = kvtester.runpytest_subprocess("--kv-canary", "--kv-canary-device=cpu", "--kv-canary-model=ckpt", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * engine 'reference' runs the llama checkpoint '*ckpt' as mha or swa only: it "
                                 "has no mla (latent attention)*"])
    assert "Traceback" not in result.stdout.str()
