"""What the canary costs a decode step at Llama-3-8B shapes, eager and replayed from a CUDA graph.

    python benchmarks/bench_overhead.py                 # the full table (GPU)
    python benchmarks/bench_overhead.py --cells 32x2048 --real-data partial
    python benchmarks/bench_overhead.py --smoke         # tiny shapes, any device (checks the script)

A fake engine with Llama-3-8B's KV: 32 layers, 8 KV heads x 128 dims, bf16 (2 KiB per slot per
layer and half), one FULL group behind a per-token table, every batch row decoding one token at
position context - 1 after a prefix of context - 1 stamped tokens. The canary reads at most 4 layers
per half (the ones its fingerprint samples), so only those are real allocations; the other 28
alias the first (the canary never reads them, and the floor below counts them anyway).

Per cell: the canary's cost per decode step, before_forward + after_forward + end_forward, as
median device time over the steps (eager: CUDA events around the Python calls, whose launches the
runtime replays from graphs of its own once they repeat, launch_replay.py; graph: the two
device halves captured in one CUDA graph and replayed, end_forward between replays), and the host
time per forward (the calls, or the replay and end_forward, with no synchronisation inside). The step's physical floor is the time to
read the weights (16.06 GB) and the step's KV (batch x context x 32 layers x 2 halves x 2 KiB) at
the copy bandwidth measured in the same run; the cost is given as a percentage of it.
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.groups import pick_layers
from pytest_kvcanary.canary.seam import Capacities, ForwardView, PoolGroup, SlotMapping
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig

WEIGHT_BYTES = 16.06e9  # Llama-3-8B in bf16
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
SLOT_BYTES = KV_HEADS * HEAD_DIM * 2  # one layer, one half
DEFAULT_CELLS = ("1x2048", "32x2048", "128x2048", "1x8192", "32x8192", "128x8192", "1x32768", "32x32768",
                 "128x32768")


class Cell(NamedTuple):
    batch: int
    context: int


class FakeEngine:
    """Pools, table and a decode view for one cell; the prefix is stamped by one prefill forward."""

    def __init__(self, cell: Cell, device: torch.device, layers: int = LAYERS, heads: int = KV_HEADS,
                 head_dim: int = HEAD_DIM) -> None:
        b, c = cell
        self.num_slots = b * c + 1
        picked = set(pick_layers(layers))
        first_k = first_v = None
        self.k, self.v = [], []
        for i in range(layers):
            if i in picked or first_k is None:
                k = torch.randn(self.num_slots, heads, head_dim, device=device, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                first_k, first_v = (k, v) if first_k is None else (first_k, first_v)
            else:
                k, v = first_k, first_v
            self.k.append(k)
            self.v.append(v)
        self.table = (torch.arange(b * c, device=device, dtype=torch.int64) + 1).view(b, c)
        self.tokens = torch.randint(0, 128_000, (b, c), device=device, dtype=torch.int64)
        self.cell = cell
        self.device = device

    def canary_groups(self):
        return [PoolGroup(GroupKind.FULL, self.k, self.v, self.num_slots, SlotMapping(self.table))]

    def canary_capacities(self) -> Capacities:
        b, c = self.cell
        return Capacities(max_batch=b, max_tokens=b * c, max_context=c)

    def cache_walk(self):
        return None

    def view(self, prefix: int, extend: int) -> ForwardView:
        b, _ = self.cell
        rows = torch.arange(b, device=self.device)
        positions = (prefix + torch.arange(extend, device=self.device)).repeat(b)
        return ForwardView(rows=rows, prefix_lens=torch.full((b,), prefix, device=self.device),
                           extend_lens=torch.full((b,), extend, device=self.device),
                           input_ids=self.tokens[:, prefix:prefix + extend].reshape(-1).contiguous(),
                           positions=positions, token_table=self.tokens,
                           context_keys=torch.zeros(b, dtype=torch.int64, device=self.device))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (median of 20)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / sorted(times[2:])[len(times[2:]) // 2]


def measure(engine: FakeEngine, config: CanaryConfig, steps: int, graph: bool) -> tuple[float, float]:
    """(canary device ms per decode step, host us per forward) for one configuration."""
    b, c = engine.cell
    runtime = CanaryRuntime(config, engine)
    prefill = engine.view(0, c - 1)
    runtime.before_forward(prefill)
    runtime.after_forward(prefill)
    runtime.end_forward()
    decode = engine.view(c - 1, 1)

    def step() -> None:
        runtime.before_forward(decode)
        runtime.after_forward(decode)

    for _ in range(3):  # compile, warm up
        step()
        runtime.end_forward()
    torch.cuda.synchronize()
    replay = step
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
            runtime.end_forward()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g):
            step()
        replay = g.replay
    times, host = [], []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        replay()
        end.record()
        runtime.end_forward()
        host.append(time.perf_counter() - t0)
        end.synchronize()
        times.append(start.elapsed_time(end))
    runtime.drain()
    problems = runtime.health_problems()
    assert not problems and not runtime.log.violations, (problems, runtime.log.violations[:3])
    return sorted(times)[len(times) // 2], 1e6 * sorted(host)[len(host) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="*", default=list(DEFAULT_CELLS), help="BATCHxCONTEXT")
    parser.add_argument("--real-data", nargs="*", default=["none", "partial", "all"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps: checks the script runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead.py needs a CUDA device")
    device = torch.device("cuda")
    cells = [Cell(*map(int, c.split("x"))) for c in args.cells]
    layers, heads, head_dim, steps = LAYERS, KV_HEADS, HEAD_DIM, args.steps
    if args.smoke:
        cells, layers, heads, head_dim, steps = [Cell(2, 64)], 4, 2, 16, 2
    bw = copy_bandwidth(device)
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e9:.0f} GB/s")
    print("| batch x context | real_data | tokens | recheck | floor ms | eager ms | eager % | graph ms | graph % "
          "| eager host us | graph host us |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    variants = [(rd, True, True) for rd in args.real_data]
    for cell in cells:
        floor_ms = 1e3 * (WEIGHT_BYTES + cell.batch * cell.context * LAYERS * 2 * SLOT_BYTES) / bw
        try:
            engine = FakeEngine(cell, device, layers, heads, head_dim)
        except torch.OutOfMemoryError:
            print(f"| {cell.batch}x{cell.context} | does not fit in device memory |")
            continue
        extra = [("partial", False, True)] + [(rd, True, False) for rd in args.real_data]
        extra = extra if (cell.batch, cell.context) == (32, 2048) else []
        for real_data, tokens, recheck in variants + extra:
            config = CanaryConfig(real_data=real_data, check_tokens=tokens, recheck=recheck, sweep_interval=0)
            eager_ms, host_us = measure(engine, config, steps, graph=False)
            graph_ms, graph_host_us = measure(engine, config, steps, graph=True)
            print(f"| {cell.batch}x{cell.context} | {real_data} | {'on' if tokens else 'off'} | "
                  f"{'on' if recheck else 'off'} | {floor_ms:.2f} | {eager_ms:.3f} | {100 * eager_ms / floor_ms:.2f}% | "
                  f"{graph_ms:.3f} | {100 * graph_ms / floor_ms:.2f}% | {host_us:.0f} | {graph_host_us:.0f} |",
                  flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
