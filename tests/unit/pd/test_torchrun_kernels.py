"""A pair launched by torchrun whose ranks fall back to the CPU (fewer GPUs than local ranks) is
refused before it joins the world when its job asks for Triton kernels without Triton's
interpreter, naming the field and the ways out."""

from __future__ import annotations

import json

import pytest

from pytest_kvcanary.handles.pd_side import cpu_kernels_problem, torchrun_main


@pytest.mark.parametrize("kernels, device, env", [("torch", "cpu", {}), ("triton", "cuda:0", {}),
                                                  ("triton", "cpu", {"TRITON_INTERPRET": "1"})])
def test_kernels_a_rank_can_run_are_not_refused(kernels, device, env):
    assert cpu_kernels_problem(kernels, device, env) is None


def test_a_cpu_rank_asked_for_triton_kernels_without_the_interpreter_is_refused_before_joining(
        tmp_path, monkeypatch):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"spec": {"attention": "mha", "canary": {"kernels": "triton"}, "devices": ["cpu", "cpu"]},
                               "commands": []}))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match=r"rank 1 \(prefill\): spec.canary.kernels is 'triton' .*TRITON_INTERPRET=1"):
        torchrun_main([f"--job={job}", f"--out={tmp_path / 'out.jsonl'}"])
