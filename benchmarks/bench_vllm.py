"""What the canary costs a vLLM decode step on vLLM's CUDA build, with PIECEWISE CUDA graphs.

    python benchmarks/bench_vllm.py                         # batches 1 and 32, graphs on, 5 runs
    python benchmarks/bench_vllm.py --graphs off --batches 1 8 32 --runs 7 --new 64

The engine is the adapter's (the seeded random ``mha`` model, FLASH_ATTN unless
KVCANARY_VLLM_ATTENTION_BACKEND says otherwise), in one process, canary off (no forward hooks) and
on (the runtime with the Triton kernels, real_data as given, the sweep every 8 forwards)
alternately, each run after a warm-up generation. A decode step's time is (the wall time of B
requests generating NEW tokens - the same requests generating 1) / (NEW - 1), with fresh prompts
each time (no prefix hits). Per batch: the median over runs, off and on, the cost (on - off) and
its spread (min..max over runs). The canary-on runs must report no violation.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--graphs", choices=["on", "off"], default="on")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--real-data", default="partial", choices=["none", "partial", "all"])
    args = parser.parse_args()

    from pytest_kvcanary.adapters.vllm.checkpoint import random_checkpoint
    from pytest_kvcanary.adapters.vllm.engine import VllmEngine, VllmSettings
    from pytest_kvcanary.config import CanaryConfig
    from pytest_kvcanary.handles.single import EngineHandle

    most = max(args.batches)
    per_request = -(-(args.prompt + args.new) // 32)
    settings = VllmSettings(device="cuda", cuda_graphs=args.graphs == "on", max_num_seqs=most,
                            max_num_batched_tokens=max(512, most * args.prompt),
                            num_blocks=2 * most * per_request + 2)
    engine = VllmEngine(random_checkpoint("mha", 0), 0, settings)
    handle = EngineHandle(engine, CanaryConfig(mode="log", real_data=args.real_data, sweep_interval=8))
    handle.reset(0, ())
    hooks = engine._hooks
    rng = random.Random(0)

    def timed(batch: int, new: int) -> float:
        prompts = [[rng.randrange(256) for _ in range(args.prompt)] for _ in range(batch)]
        start = time.perf_counter()
        engine.generate(prompts, new)
        return time.perf_counter() - start

    def step(batch: int) -> float:
        return (timed(batch, args.new) - timed(batch, 1)) / (args.new - 1)

    print(f"vLLM decode step, graph mode {engine.graph_mode}, layout {engine.layout}, real_data {args.real_data}")
    print("batch  off ms  on ms  cost ms  cost spread ms")
    for batch in args.batches:
        off, on = [], []
        for _ in range(args.runs):
            engine.set_forward_hooks(None)
            step(batch)
            off.append(step(batch))
            # the prefix cache flushed: blocks computed with the canary off carry no records, and
            # the sweep would report each of them (and the log's draining would be timed)
            handle.reset(0, ())
            engine.set_forward_hooks(hooks)
            step(batch)
            on.append(step(batch))
            violations = handle.violations()
            assert not violations, f"the canary reported {len(violations)} violations on a clean run: {violations[:3]}"
        costs = [b - a for a, b in zip(off, on)]
        print(f"{batch:5d}  {statistics.median(off) * 1e3:6.3f}  {statistics.median(on) * 1e3:5.3f}  "
              f"{statistics.median(costs) * 1e3:7.3f}  {min(costs) * 1e3:.3f}..{max(costs) * 1e3:.3f}")


if __name__ == "__main__":
    main()
