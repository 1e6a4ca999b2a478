"""bench_transformers.py's prefill breakdown times each side's prefill forwards by phase and
reports what the canary adds: HEAD and TAIL's host time shows up, in their phases."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "bench_transformers.py"
spec = importlib.util.spec_from_file_location("bench_transformers_script", SCRIPT)
bench = sys.modules["bench_transformers_script"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_a_prefill_breakdown_puts_the_canarys_host_time_in_head_and_tail():
    model, tokenizer = bench.random_model("cpu", "tinyllama", smoke=True)
    engine = bench.prefill_engine(model, tokenizer, 2, 24)
    try:
        off, on, added = bench.measure_prefill(engine, 2, 24, "partial", "torch", 1, breakdown=True)
        assert off > 0 and on > 0 and added["forwards"] >= 1
        assert added["head"] > 0 and added["tail"] > 0  # no canary on the off side: its phases are empty
        assert bench.measure_prefill(engine, 2, 24, "partial", "torch", 0)[2] == {}
    finally:
        engine.close()
