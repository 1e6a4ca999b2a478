"""The canary does not change what vLLM computes: greedy outputs with the canary attached (its
connector, the hooks, the sweeps) equal those of the same LLM without any connector, run in a
process of its own (a process that started a connector LLM routes every later LLM's forwards
through it)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from .support import INSTALL, attention_param, make_engine, make_handle, prompts_with_shared_prefixes, stems

pytest.importorskip("vllm", reason=INSTALL)

BATCHES = 3
MAX_NEW_TOKENS = 8
PLAIN_VLLM = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from pytest_kvcanary.adapters.vllm.engine import VllmSettings
    job = json.load(sys.stdin)
    llm = LLM(**VllmSettings(**job["settings"]).llm_arguments(job["model"], 0))
    params = SamplingParams(max_tokens=job["max_new_tokens"], temperature=0.0, ignore_eos=True)
    outputs = [[list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch],
                                                                    params, use_tqdm=False)]
               for batch in job["batches"]]
    print("OUTPUTS" + json.dumps(outputs))
"""


def plain_vllm(model: str, settings: dict, batches: list[list[list[int]]]) -> list[list[list[int]]]:
    job = json.dumps({"model": model, "settings": settings, "batches": batches, "max_new_tokens": MAX_NEW_TOKENS})
    done = subprocess.run([sys.executable, "-c", PLAIN_VLLM], input=job, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("OUTPUTS"))
    return json.loads(line[len("OUTPUTS"):])


@pytest.mark.parametrize("attention", [attention_param(a) for a in ("mha", "swa", "mla")])
def test_greedy_outputs_equal_vllm_without_the_canary(attention):
    # Without a connector vLLM splits the pool between its two groups on swa, so the two runs
    # schedule differently; in float32 that moves no greedy choice of the random model (in
    # bfloat16 a near tie flips on vLLM 0.26).
    settings = {"num_blocks": 48, "dtype": "float32"}
    engine = make_engine(attention, **settings)
    handle = make_handle(engine)
    rng = random.Random(0)
    shared = stems(rng, count=2)
    batches = [prompts_with_shared_prefixes(rng, 8, shared) for _ in range(BATCHES)]
    guarded = [handle.generate(batch, MAX_NEW_TOKENS) for batch in batches]
    assert handle.violations() == []
    assert handle.stats()["single"]["forwards"] > 0
    assert guarded == plain_vllm(engine.llm.llm_engine.model_config.model, settings, batches)
