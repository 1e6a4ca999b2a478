"""What the canary costs a decode step of the reference engine replayed from CUDA graphs: on one
GPU, and tensor-parallel on two (NCCL) with and without the cross-rank comparison.

    python benchmarks/bench_reference.py                        # tp=1 on cuda:0, batch 1 and 32
    python benchmarks/bench_reference.py --tp 2 --batches 1 32  # tp=2 on cuda:0 and cuda:1
    python benchmarks/bench_reference.py --batches 8 --runs 7
    python benchmarks/bench_reference.py --attention hybrid     # every 4th layer attention, the rest recurrent
    python benchmarks/bench_reference.py --kv-dtype fp8_e4m3    # KV stored in FP8 with per-layer scales
    python benchmarks/bench_reference.py --breakdown            # also each variant's device time per kernel
    python benchmarks/bench_reference.py --smoke [--tp 2]       # tiny shapes on the CPU (padded decode): checks the script

The engine: the embedded reference engine (tp=1: in this process; tp=2: split over two rank
processes, handles/parallel.py) with a Llama-style model in bf16 (--hidden, --layers, ...; random
weights, 1B-class by default; --attention hybrid: every --full-every-th layer full attention, the others
a recurrent mixer of --heads state heads x --state-dim, whose states the canary's state group guards),
decode_mode "graph": each decode step's padded batch, with the
canary's before_forward and after_forward (tp=2: the digest and its all-gather included) captured
in one CUDA graph per batch size and replayed. Per run, the engine prefills `batch` prompts of
`prompt` tokens, decodes a few warm-up steps (which capture the graphs), then times `steps` decode
steps (engine.step(): scheduling, the replay, the sampled tokens read back, end_forward's sweeps
and log polls), synchronising the device around each.

Variants, each `runs` times, interleaved: off (no hooks), canary (the engine's canary; tp=2: each
rank's own), cross-rank (tp=2 only: each rank's canary and the comparison of the ranks' stamps,
what a parallel test runs). Per variant: the median over runs of each run's median step time
(tp=2: on rank 0) and the spread of those run medians (min-max); the cost over off, paired: each
run against the off run just before it (the host's pace drifts between runs by more than the
canary costs a step), the median of those differences, their spread and a 95% interval of that
median (a seeded bootstrap over the runs); the same paired cost of each run's mean step (a median
step is one without a sweep or a poll; the mean pays for them, as throughput does); and the host
time the canary's end_forward takes, on average over a run's steps (sweeps and polls included).

--breakdown (tp=1 on a GPU): after the timed runs, three more runs of each variant: one under
torch.profiler (the device time of every kernel, copy and fill a step, the graph's included; the
canary's kernels by device time a step, with launches a step), one with timing events around each
CUDA graph replay (the graphs' device time a step, the gaps between their nodes included, which
the profiler would inflate), one with the host's part of each step timed (HostPhases: scheduling,
the token table, the graph's buffers, the replay's launch, the wait for the tokens, process,
end_forward, the rest); their costs over off. Device
time is the part of a step the canary's launches add to; it is far steadier than a step's wall
time, whose host part drifts between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from typing import Any

import torch

from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.decode_graphs import DecodeStep
from pytest_kvcanary.reference_engine.parallel.shard import ReferenceShards
from pytest_kvcanary.reference_engine.parallel.topology import Topology
from pytest_kvcanary.handles.parallel import ParallelHandle
from pytest_kvcanary.handles.rank import RankContext, RankSpec
from pytest_kvcanary.handles.single import EngineHandle


class DecodeRun:
    """A picklable call for every rank (or the one engine): one timed run of one variant (see the
    module docstring). Returns (step ms, end_forward us) per timed step."""

    def __init__(self, variant: str, batch: int, prompt: int, warmup: int, steps: int, seed: int,
                 breakdown: str | None = None) -> None:
        self.variant, self.batch, self.prompt, self.warmup, self.steps, self.seed = \
            variant, batch, prompt, warmup, steps, seed
        self.breakdown = breakdown  # None, "kernels" (under torch.profiler), "graphs" (timing events) or "host"
        self.kernels: dict[str, tuple[float, float]] = {}  # breakdown "kernels": kernel_times of the timed steps
        self.graph_us = 0.0  # breakdown "graphs": the device time of the CUDA graphs replayed, a step
        self.phases: dict[str, list[float]] = {}  # breakdown "host": HostPhases.per_step of the timed steps

    def __call__(self, context: RankContext) -> list[tuple[float, float]]:
        engine = context.engines["single"]
        side = context.handle.sides[0]
        if not hasattr(engine, "attached_hooks"):
            engine.attached_hooks = engine._hooks  # the runtime, or on a rank the RankCheck around it
        hooks = {"off": None, "canary": side.runtime, "cross-rank": engine.attached_hooks}[self.variant]
        timed = EndForwardTimer(hooks)
        engine.set_forward_hooks(None if hooks is None else timed)
        engine.reset()
        side.runtime.reset()
        start_run(engine, self.batch, self.prompt, self.warmup, self.steps, self.seed)
        times = []
        profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    if self.breakdown == "kernels" else contextlib.nullcontext())
        replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        phases = HostPhases(engine) if self.breakdown == "host" else None
        with profiler, (timed_replays(replays) if self.breakdown == "graphs" else contextlib.nullcontext()), \
                (phases or contextlib.nullcontext()):
            for _ in range(self.steps):
                timed.seconds = 0.0
                times.append((timed_step(engine), 1e6 * timed.seconds))
                if phases is not None:
                    phases.end_step(times[-1][0] * 1e3, times[-1][1])
        if phases is not None:
            self.phases = phases.per_step
        if self.breakdown == "kernels":
            self.kernels = kernel_times(profiler, self.steps)
        if self.breakdown == "graphs":
            self.graph_us = 1e3 * sum(start.elapsed_time(end) for start, end in replays) / self.steps
        assert len(engine.running) == self.batch, "a request finished or was retracted while timing"
        if hooks is not None:
            side.runtime.drain()
            assert not side.runtime.log.violations and not side.runtime.health_problems()
        return times


class EndForwardTimer:
    """Forward hooks passing every call on to `hooks`, adding up the host seconds end_forward takes."""

    def __init__(self, hooks: Any) -> None:
        self.hooks, self.seconds = hooks, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hooks, name)

    def end_forward(self, *args: Any) -> None:
        start = time.perf_counter()
        self.hooks.end_forward(*args)
        self.seconds += time.perf_counter() - start


@contextlib.contextmanager
def timed_replays(replays: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> Any:
    """Every CUDA graph replay in the block between two timing events on its stream, appended to
    replays: their elapsed times are the graphs' device time, the gaps between their nodes included."""
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        replays.append((start, end))

    torch.cuda.CUDAGraph.replay = timed
    try:
        yield
    finally:
        torch.cuda.CUDAGraph.replay = replay


class HostPhases:
    """Host microseconds of each part of a timed step (breakdown "host"), by wrapping the engine's
    calls for the block: schedule, the rows' token table, the graph's buffers refilled, the replay's
    launch, the wait for the sampled tokens (the device's time, less what overlapped the launch),
    process, end_forward, and what is left of the step. per_step: each part's time, step by step."""

    PARTS = ("schedule", "note rows", "fill", "replay launch", "wait for tokens", "process", "end_forward", "rest")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.per_step: dict[str, list[float]] = {part: [] for part in self.PARTS}
        self._step: dict[str, float] = dict.fromkeys(self.PARTS + ("decode run",), 0.0)
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, part: str) -> None:
        call = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._step[part] += 1e6 * (time.perf_counter() - start)

        self._undo.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def __enter__(self) -> "HostPhases":
        decode = self.engine._decode
        for owner, name, part in ((self.engine.scheduler, "schedule", "schedule"),
                                  (self.engine, "_note_rows", "note rows"),
                                  (self.engine.scheduler, "process", "process"),
                                  (decode, "run", "decode run"),
                                  (DecodeStep, "fill", "fill"),
                                  (torch.cuda.CUDAGraph, "replay", "replay launch")):
            self._wrap(owner, name, part)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def end_step(self, step_us: float, end_forward_us: float) -> None:
        """Close a timed step of step_us (end_forward_us of it in end_forward)."""
        s = self._step
        s["end_forward"] = end_forward_us
        s["wait for tokens"] = s.pop("decode run", 0.0) - s["fill"] - s["replay launch"]
        s["rest"] = step_us - sum(s[part] for part in self.PARTS if part != "rest")
        for part in self.PARTS:
            self.per_step[part].append(s[part])
        self._step = dict.fromkeys(self.PARTS + ("decode run",), 0.0)


def kernel_times(profiler: Any, steps: int) -> dict[str, tuple[float, float]]:
    """Per device activity name (kernel, copy, fill): device microseconds and occurrences a step."""
    return {event.key: (event.self_device_time_total / steps, event.count / steps)
            for event in profiler.key_averages() if event.self_device_time_total > 0}


def print_breakdown(batch: int, runs: dict[tuple[str, str], DecodeRun]) -> None:
    """Device time a step, off and on (the kernels', and the replayed graphs' with the gaps between
    their nodes, each from a run of its own), and what the canary adds, kernel by kernel (largest
    first)."""
    off, on = runs["off", "kernels"].kernels, runs["canary", "kernels"].kernels
    off_run, on_run = runs["off", "graphs"], runs["canary", "graphs"]
    total_off, total_on = (sum(us for us, _ in k.values()) for k in (off, on))
    print(f"\nbatch {batch}: kernel time a step: off {total_off:.1f} us, canary {total_on:.1f} us "
          f"({total_on - total_off:+.1f} us, {100 * (total_on - total_off) / total_off:+.1f}%); graph time a step: "
          f"off {off_run.graph_us:.1f} us, canary {on_run.graph_us:.1f} us ({on_run.graph_us - off_run.graph_us:+.1f} us, "
          f"{100 * (on_run.graph_us - off_run.graph_us) / off_run.graph_us:+.1f}%)")
    added = sorted(((on[name][0] - off.get(name, (0.0, 0.0))[0], on[name][1] - off.get(name, (0.0, 0.0))[1], name)
                    for name in on), reverse=True)
    print("| added us a step | added launches a step | kernel |\n|---:|---:|---|")
    for us, launches, name in added[:15]:
        if us > 0.05:
            print(f"| {us:.1f} | {launches:.2f} | {name[:90]} |")
    if runs.get(("off", "host")) is not None:
        print("| host part of a step | off: median us (mean) | canary: median us (mean) | median added |\n"
              "|---|---:|---:|---:|")
        off_parts, on_parts = runs["off", "host"].phases, runs["canary", "host"].phases
        for part in HostPhases.PARTS:
            a, b = off_parts[part], on_parts[part]
            print(f"| {part} | {statistics.median(a):.1f} ({statistics.mean(a):.1f}) | "
                  f"{statistics.median(b):.1f} ({statistics.mean(b):.1f}) | "
                  f"{statistics.median(b) - statistics.median(a):+.1f} |")
    print(flush=True)


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% interval of the median of `values`, by a seeded bootstrap: what a paired cost's
    median can be read as, given its spread over runs."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def interval_text(values: list[float]) -> str:
    low, high = median_interval(values)
    return f"{low:+.1f}..{high:+.1f}%"


def start_run(engine: Engine, batch: int, prompt: int, warmup: int, steps: int, seed: int) -> None:
    """On an engine just reset: `batch` prompts of `prompt` random tokens (seeded) submitted for
    warmup + steps + 2 new tokens each, prefilled, and `warmup` decode steps run (they capture the
    decode graphs the engine holds none of)."""
    vocab = engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        engine.submit(torch.randint(1, vocab, (prompt,), generator=gen).tolist(), warmup + steps + 2)
    while engine.scheduler.waiting:  # the prefill forwards
        engine.step()
    for _ in range(warmup):
        engine.step()


def timed_step(engine: Engine) -> float:
    """One engine.step(), the device synchronised before and after: its wall ms."""
    synchronize(engine.device)
    start = time.perf_counter()
    engine.step()
    synchronize(engine.device)
    return 1e3 * (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OneEngine:
    """tp=1: the engine and its handle in this process, called like the ranks of a ParallelHandle."""

    def __init__(self, engine: EngineConfig, canary: CanaryConfig) -> None:
        self.engine = Engine(engine)
        self.handle = EngineHandle(self.engine, canary)
        self.handle.reset(0, ())
        self.context = RankContext(0, 0, self.handle, {"single": self.engine})

    def call(self, run: DecodeRun) -> list[Any]:
        return [run(self.context)]

    def close(self) -> None:
        self.handle.close()


class SideBySide:
    """tp=1: two engines of one configuration in this process, the canary off on one and on the
    other (attached once: each keeps its decode graphs from run to run). A run (``pair``) starts both
    alike and times their decode steps in turn, which one goes first alternating step by step, so
    a change in the host's pace lands on both sides of the pair."""

    def __init__(self, engine: EngineConfig, canary: CanaryConfig) -> None:
        self.off = Engine(engine)
        self.on = OneEngine(engine, canary)

    def pair(self, batch: int, prompt: int, warmup: int, steps: int, seed: int) -> tuple[float, float]:
        """One run: (off, on) median ms of a decode step over `steps` steps each; the canary must
        report nothing and count every launch it owes."""
        engines, runtime = (self.off, self.on.engine), self.on.handle.side.runtime
        for engine in engines:
            engine.reset()
        runtime.reset()
        for engine in engines:
            start_run(engine, batch, prompt, warmup, steps, seed)
        times: tuple[list[float], list[float]] = ([], [])
        for step in range(steps):
            for side in ((0, 1) if (step + seed) % 2 == 0 else (1, 0)):
                times[side].append(timed_step(engines[side]))
        assert all(len(engine.running) == batch for engine in engines), "a request finished or was retracted"
        runtime.drain()
        assert not runtime.log.violations and not runtime.health_problems(), runtime.health_problems()
        assert runtime.forwards >= steps, "the canary saw none of the steps it was timed on"
        return statistics.median(times[0]), statistics.median(times[1])

    def close(self) -> None:
        self.on.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argv: None for sys.argv), with what it implies: devices, dtype,
    decode_mode and kernels; --smoke's tiny shapes on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
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
    parser.add_argument("--attention", default="mha", choices=["mha", "hybrid"])
    parser.add_argument("--full-every", type=int, default=4, help="hybrid: every Nth layer is full attention")
    parser.add_argument("--state-dim", type=int, default=64, help="hybrid: a state head's key and value size")
    parser.add_argument("--kv-dtype", default="auto", help="what the KV pools store (ModelConfig.kv_dtype: auto, "
                        "float32, float16, bfloat16, fp8_e4m3, fp8_e5m2, fp4_e2m1)")
    parser.add_argument("--real-data", nargs="+", default=["partial"], choices=["none", "partial", "all"])
    parser.add_argument("--sweep-interval", type=int, default=4)
    parser.add_argument("--breakdown", action="store_true",
                        help="tp=1 on a GPU: one more run a variant under torch.profiler, device time per kernel")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    if args.breakdown and (args.smoke or args.tp != 1):
        parser.error("--breakdown profiles the device time of tp=1 on a GPU: drop --smoke and --tp")
    if args.smoke:
        args.devices, args.dtype, args.decode_mode, args.kernels = ("cpu",) * args.tp, torch.float32, "padded", "torch"
        args.batches, args.prompt, args.steps, args.warmup, args.runs = [2], 8, 2, 1, 1
        args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.intermediate = 64, 2, 4, 2, 16, 128
        args.full_every, args.state_dim = 2, 16
    else:
        if torch.cuda.device_count() < args.tp:
            raise SystemExit(f"bench_reference.py --tp {args.tp} needs {args.tp} CUDA devices (or --smoke)")
        args.devices, args.dtype, args.decode_mode, args.kernels = \
            tuple(f"cuda:{i}" for i in range(args.tp)), torch.bfloat16, "graph", "triton"
    return args


def engine_config(args: argparse.Namespace, batch: int) -> EngineConfig:
    """The engine the bench times at this batch size (the shape parse_args read)."""
    context = args.prompt + args.warmup + args.steps + 2
    model = ModelConfig(vocab_size=32000, hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                        max_context=context, dtype=args.dtype, seed=0, attention=args.attention,
                        full_every=args.full_every, state_heads=args.heads, state_dim=args.state_dim,
                        kv_dtype=args.kv_dtype)
    return EngineConfig(model=model, num_slots=batch * context + 1, max_running=batch,
                        max_batch_tokens=max(context, 8192), device=args.devices[0], decode_mode=args.decode_mode,
                        num_state_slots=2 * batch + 1)


def main() -> None:
    args = parse_args()
    devices, dtype, decode_mode, kernels = args.devices, args.dtype, args.decode_mode, args.kernels
    variants = ("off", "canary") + (("cross-rank",) if args.tp > 1 else ())
    name = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    print(f"tp={args.tp} on {', '.join(devices)} ({name}); attention={args.attention}; kv_dtype={args.kv_dtype}"
          + (f" (full every {args.full_every}, state {args.heads} x {args.state_dim}^2)" if args.attention == "hybrid" else "")
          + f"; decode_mode={decode_mode}; prompt {args.prompt}, "
          f"{args.steps} timed steps x {args.runs} runs; hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
          f"({args.kv_heads} KV) x {args.head_dim}, {dtype}; sweep_interval={args.sweep_interval}")
    print("| batch | real_data | canary | ms per decode step (median of run medians) | spread over runs "
          "| cost over off | cost % min..max | cost % median, 95% CI | cost % of the mean step (95% CI) "
          "| end_forward us per step |")
    print("|---:|---|---|---:|---:|---:|---|---|---|---:|")
    for batch in args.batches:
        engine = engine_config(args, batch)
        for real_data in args.real_data:
            canary = CanaryConfig(real_data=real_data, sweep_interval=args.sweep_interval, kernels=kernels)
            ranks: Any = OneEngine(engine, canary) if args.tp == 1 else \
                ParallelHandle(RankSpec("single", ReferenceShards(engine), canary, Topology(tp=args.tp), devices))
            runs: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
            profiled: dict[tuple[str, str], DecodeRun] = {}
            try:
                for run in range(args.runs):
                    for variant in variants:
                        steps = ranks.call(DecodeRun(variant, batch, args.prompt, args.warmup, args.steps, run))[0]
                        step_ms, end_us = zip(*steps)
                        runs[variant].append((statistics.median(step_ms), statistics.mean(end_us),
                                              statistics.mean(step_ms)))
                if args.breakdown:
                    for variant in variants:
                        for kind in ("kernels", "graphs", "host"):
                            profiled[variant, kind] = DecodeRun(variant, batch, args.prompt, args.warmup, args.steps,
                                                                args.runs, breakdown=kind)
                            ranks.call(profiled[variant, kind])
            finally:
                ranks.close()
            for variant in variants:
                step_ms = [ms for ms, _, _ in runs[variant]]
                paired = [(ms - off_ms, 100 * (ms - off_ms) / off_ms)
                          for (ms, _, _), (off_ms, _, _) in zip(runs[variant], runs["off"])]
                costs = sorted(percent for _, percent in paired)
                mean_costs = sorted(100 * (mean - off_mean) / off_mean
                                    for (_, _, mean), (_, _, off_mean) in zip(runs[variant], runs["off"]))
                print(f"| {batch} | {real_data} | {variant} | {statistics.median(step_ms):.3f} | "
                      f"{min(step_ms):.3f}-{max(step_ms):.3f} | "
                      f"{statistics.median(ms for ms, _ in paired):+.3f} ms ({statistics.median(costs):+.1f}%) | "
                      f"{costs[0]:+.1f}..{costs[-1]:+.1f}% | {interval_text(costs)} | "
                      f"{statistics.median(mean_costs):+.1f}% ({interval_text(mean_costs)}) | "
                      f"{statistics.median(us for _, us, _ in runs[variant]):.0f} |", flush=True)
            if profiled:
                print_breakdown(batch, profiled)


if __name__ == "__main__":
    main()
