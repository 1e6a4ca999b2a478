"""benchmarks/bench_reference.py's side-by-side runs (the gate's reference rows): the canary is
attached to one engine only, it sees every step timed on that engine and stays attached from run to
run, and each run times both engines' steps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pytest_kvcanary.config import CanaryConfig

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "bench_reference.py"
spec = importlib.util.spec_from_file_location("bench_reference_script", SCRIPT)
bench = sys.modules["bench_reference_script"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_side_by_side_runs_time_both_engines_with_the_canary_on_one():
    args = bench.parse_args(["--smoke"])
    engines = bench.SideBySide(bench.engine_config(args, 2), CanaryConfig(real_data="partial", kernels="torch"))
    runtime = engines.on.handle.side.runtime
    counted = []
    end_forward = runtime.end_forward

    def counting(*a, **k):
        counted.append(runtime.forwards)
        return end_forward(*a, **k)

    runtime.end_forward = counting
    try:
        for run in range(2):
            counted.clear()
            off, on = engines.pair(2, args.prompt, args.warmup, args.steps, seed=run)
            assert off > 0 and on > 0
            # The canary's engine: every forward of the run, the prefill's, the warm-up's and the timed.
            assert len(counted) == runtime.forwards >= args.warmup + args.steps
            assert engines.off._hooks is None and engines.on.engine._hooks is runtime
    finally:
        engines.close()
