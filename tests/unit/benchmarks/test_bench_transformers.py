"""bench_transformers.py's prefill breakdown times each side's prefill forwards by phase and
reports what the canary adds: HEAD and TAIL's host time shows up, in their phases, on every run of
one engine (the canary is detached between runs, not closed with the engine)."""

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


def test_a_prefill_breakdown_puts_the_canarys_host_time_in_head_and_tail_on_every_run():
    model, tokenizer = bench.random_model("cpu", "tinyllama", smoke=True)
    engine = bench.prefill_engine(model, tokenizer, 2, 24)
    try:
        for run in (1, 0, 1):  # on first, off first, then on first after an on side detached
            off, on, added = bench.measure_prefill(engine, 2, 24, "partial", "torch", run, breakdown=True)
            assert off > 0 and on > 0 and added["forwards"] >= 1
            assert added["head"] > 0 and added["tail"] > 0, (run, added)  # the off side's phases are empty
        assert bench.measure_prefill(engine, 2, 24, "partial", "torch", 0)[2] == {}
    finally:
        engine.close()


def test_with_canary_refuses_work_the_canary_did_not_see():
    model, tokenizer = bench.random_model("cpu", "tinyllama", smoke=True)
    engine = bench.prefill_engine(model, tokenizer, 2, 24)
    try:
        with pytest.raises(AssertionError, match="saw none of the forwards"):
            bench.with_canary(engine, "partial", "torch", lambda handle: None)
        assert engine._forward.hooks is None  # detached either way
    finally:
        engine.close()


def test_kernel_times_are_the_steps_past_the_short_generation_on_minus_off():
    short, long = {"a": [1.0, 1.0], "b": [2.0]}, {"a": [1.0] * 6, "c": [4.0, 4.0]}
    assert bench.per_step(short, long, 2) == {"a": (2.0, 2.0), "b": (-1.0, -0.5), "c": (4.0, 1.0)}
    assert bench.added({"a": (1.0, 1.0)}, {"a": (3.0, 1.0), "k": (2.0, 1.0)}) == {"a": (2.0, 0.0), "k": (2.0, 1.0)}


def test_kernel_times_of_a_decode_step_include_the_canarys_work():
    """On a CPU the profiler's ops stand in for kernels: the canary's HEAD and TAIL add ops to every
    decode step on its side, and none when it is detached."""
    model, tokenizer = bench.random_model("cpu", "tinyllama", smoke=True)
    engine = bench.decode_engine(model, tokenizer, 2, 24, 16, False, "sync")
    try:
        off = bench.kernel_steps(engine, 2, 24, 16)
        on = bench.with_canary(engine, "partial", "torch", lambda _: bench.kernel_steps(engine, 2, 24, 16))
        again = bench.kernel_steps(engine, 2, 24, 16)
        launches = lambda by_kernel: sum(n for _, n in by_kernel.values())  # noqa: E731
        assert launches(bench.added(off, on)) > 50  # a step's HEAD, RECHECK and TAIL in torch ops
        assert abs(launches(bench.added(off, again))) < 1
    finally:
        engine.close()


def test_the_step_timer_passes_keyword_arguments_to_what_it_times():
    """transformers 5.17's defect notes are called with every_row= inside the forward: timed, they
    still run and their time lands in their own phase."""
    model, tokenizer = bench.random_model("cpu", "tinyllama", smoke=True)
    engine = bench.decode_engine(model, tokenizer, 2, 24, 16, False, "sync")
    timer = bench.StepTimer(engine, 2)
    try:
        engine._forward.staging.hashed_writes.note([], 0, every_row=True)
        assert timer._phases["defect notes"] > 0
    finally:
        timer.close()
        engine.close()
