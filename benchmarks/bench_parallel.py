"""What the canary costs a decode step of the tensor-parallel reference engine, replayed from CUDA
graphs on two GPUs (NCCL), with and without the cross-rank comparison.

    python benchmarks/bench_parallel.py                 # tp=2 on cuda:0 and cuda:1
    python benchmarks/bench_parallel.py --batch 8 --runs 7
    python benchmarks/bench_parallel.py --smoke         # tiny shapes on the CPU (gloo, padded decode): checks the script

The engine: the reference engine split over two ranks (one process each, handles/parallel.py),
a Llama-style model in bf16 (--hidden, --layers, ...; random weights), decode_mode "graph": each
decode step's padded batch, with the canary's before_forward and after_forward (the digest and its
all-gather included) captured in one CUDA graph per batch size and replayed. Per run, each rank
prefills `batch` prompts of `prompt` tokens, decodes a few warm-up steps (which capture the
graphs), then times `steps` decode steps (engine.step(): scheduling, the replay, the sampled
tokens read back, end_forward's sweeps and log polls), synchronising the device around each.

Variants, each `runs` times, interleaved: off (no hooks), per-rank (each rank's own canary only),
cross-rank (each rank's canary and the comparison of the ranks' stamps; what a test runs). Per
variant: the median over runs of each run's median step time on rank 0 (ms), the spread of those
run medians (min-max), and the cost over off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.engine import EngineConfig, ModelConfig
from pytest_kvcanary.engine.parallel.topology import Topology
from pytest_kvcanary.handles.parallel import ParallelHandle
from pytest_kvcanary.handles.rank import RankContext, RankSpec

VARIANTS = ("off", "per-rank", "cross-rank")


class DecodeRun:
    """A picklable call for every rank: one timed run of one variant (see the module docstring)."""

    def __init__(self, variant: str, batch: int, prompt: int, warmup: int, steps: int, seed: int) -> None:
        self.variant, self.batch, self.prompt, self.warmup, self.steps, self.seed = \
            variant, batch, prompt, warmup, steps, seed

    def __call__(self, context: RankContext) -> list[float]:
        engine = context.engines["single"]
        side = context.handle.sides[0]
        if not hasattr(engine, "rank_check"):
            engine.rank_check = engine._hooks  # the RankCheck the rank attached
        engine.set_forward_hooks({"off": None, "per-rank": side.runtime, "cross-rank": engine.rank_check}[self.variant])
        engine.reset()
        side.runtime.reset()
        vocab = engine.config.model.vocab_size
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(self.batch):
            engine.submit(torch.randint(1, vocab, (self.prompt,), generator=gen).tolist(),
                          self.warmup + self.steps + 2)
        while engine.scheduler.waiting:  # the prefill forwards
            engine.step()
        for _ in range(self.warmup):  # captures the graphs
            engine.step()
        times = []
        for _ in range(self.steps):
            synchronize(engine.device)
            start = time.perf_counter()
            engine.step()
            synchronize(engine.device)
            times.append(1e3 * (time.perf_counter() - start))
        assert len(engine.running) == self.batch, "a request finished or was retracted while timing"
        if self.variant != "off":
            side.runtime.drain()
            assert not side.runtime.log.violations and not side.runtime.health_problems()
        return times


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--real-data", default="partial")
    parser.add_argument("--sweep-interval", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        devices, dtype, decode_mode, kernels = ("cpu", "cpu"), torch.float32, "padded", "torch"
        args.batch, args.prompt, args.steps, args.warmup, args.runs = 2, 8, 2, 1, 1
        args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.intermediate = 64, 2, 4, 2, 16, 128
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("bench_parallel.py needs two CUDA devices (or --smoke)")
        devices, dtype, decode_mode, kernels = ("cuda:0", "cuda:1"), torch.bfloat16, "graph", "triton"
    context = args.prompt + args.warmup + args.steps + 2
    model = ModelConfig(vocab_size=32000, hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                        max_context=context, dtype=dtype, seed=0)
    engine = EngineConfig(model=model, num_slots=args.batch * context + 1, max_running=args.batch,
                          max_batch_tokens=max(context, 8192), device=devices[0], decode_mode=decode_mode)
    canary = CanaryConfig(real_data=args.real_data, sweep_interval=args.sweep_interval, kernels=kernels)
    handle = ParallelHandle(RankSpec("single", engine, canary, Topology(tp=2), devices))
    name = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    print(f"tp=2 on {', '.join(devices)} ({name}); decode_mode={decode_mode}; batch {args.batch}, prompt "
          f"{args.prompt}, {args.steps} timed steps x {args.runs} runs; hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads ({args.kv_heads} KV) x {args.head_dim}, {dtype}; real_data={args.real_data}, "
          f"sweep_interval={args.sweep_interval}")
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for run in range(args.runs):
            for variant in VARIANTS:
                times = handle.call(DecodeRun(variant, args.batch, args.prompt, args.warmup, args.steps, run))[0]
                medians[variant].append(statistics.median(times))
    finally:
        handle.close()
    off = statistics.median(medians["off"])
    print("| canary | ms per decode step (median of run medians) | spread over runs | cost over off |")
    print("|---|---:|---:|---:|")
    for variant in VARIANTS:
        m = statistics.median(medians[variant])
        print(f"| {variant} | {m:.3f} | {min(medians[variant]):.3f}-{max(medians[variant]):.3f} | "
              f"{m - off:+.3f} ms ({100 * (m - off) / off:+.1f}%) |")


if __name__ == "__main__":
    main()
