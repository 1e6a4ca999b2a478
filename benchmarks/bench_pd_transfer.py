"""What the canary costs a prefill/decode pair whose engines run in processes of their own: its
transfers, the first decoded token and a generate call, canary on versus off, paired in the same
two processes.

    python benchmarks/bench_pd_transfer.py                  # prefill on cuda:0, decode on cuda:1 (NCCL)
    python benchmarks/bench_pd_transfer.py --prompt 8192 --batch 8 --pairs 31
    python benchmarks/bench_pd_transfer.py --smoke          # the CPU pair over gloo, tiny shapes: checks the script

The pair: kv_pd(transport="processes")'s (handles/pd_processes.py, docs/pd-processes.md), prefill
on cuda:0 and decode on cuda:1, the KV moving over NCCL point-to-point (--smoke: both on the CPU,
gloo), with the reference engine at a shape whose transfers are measurable: Llama-style in bf16
on random weights, --layers 8 layers of mha with --kv-heads 8 KV heads x --head-dim 128 (GQA under
16 query heads), decoding eagerly as the plugin's pair does (--decode-mode graph: CUDA graphs,
captured during each measurement's warm-up). A batch of --batch 4 prompts of --prompt 4096 random
tokens is prefilled in one forward and transferred request by request. A transfer moves:

    KV       layers x 2 halves x kv_heads x head_dim x 2 bytes = 32 KiB a token: 128 MiB a request
    sidecar  (canary on) every transferred slot's records, 2 halves x 4 int64 = 64 bytes a token:
             256 KiB a request (0.2% of its KV); canary off, no sidecar goes

and the script prints both, as the decode side received them.

Canary off and on: ProcessPairHandle.set_canary detaches both sides' canaries in their processes
(no forward hooks: no records stamped, no HEAD on the decode side; no sidecar exported, sent,
received or installed) or attaches them, and resets the pair. A measurement (one setting) sets it,
runs --warmup untimed generate calls of other prompts, then, the pair reset before each, two timed
ones of the pair's prompts, whose wall times this process reads (the outputs come back to it, so
every device's work is done):

    first token  a generate call of max_new_tokens 2: prefill, transfers, landings and one decode
                 step: every request of the batch has its first decoded token
    generate     a generate call of max_new_tokens --new

and from both calls' transfers (DecodeResult.transfers, and when the prefill side began each):

    transfer     per transfer, from the prefill side beginning to send it (gathering its KV and,
                 canary on, its records, posting the sends) to the decode side having landed it
                 (bytes and records written into its slots, its stream synchronized), on the
                 monotonic clock both processes of one host read; the decode side lands at its
                 next poll, so this includes up to one of its ticks (an exchange, and a decode
                 step of the requests already landed). Mean over the measurement's transfers.
    landing      per transfer, the decode side's part alone: from both messages found in to landed.

A pair is one measurement off and one on with the same prompts (fresh each pair), off first in
even pairs and on first in odd ones (gate.py's alternate: a drift lands on both sides); its cost is
(on - off) / off. Each pair prints a progress line; the table comes last: per measure the median
off and on ms, the cost's median, its 95% interval (bench_reference.median_interval: a seeded
bootstrap over the pairs), min..max and the pairs, with the bytes moved (a transfer's in its rows,
the batch's in the others). A canary-on measurement that logs a violation, a request not decoded
to the end, or a sidecar that went with the canary off (or none with it on) stops the script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from kvcanary_kernels.records import RECORD_WIDTH

sys.path.insert(0, str(Path(__file__).parent))  # bench_reference

from bench_reference import median_interval  # noqa: E402
from pytest_kvcanary.config import CanaryConfig  # noqa: E402
from pytest_kvcanary.handles.pd_processes import ProcessPairHandle  # noqa: E402
from pytest_kvcanary.handles.pd_side import DEFAULT_TRANSFER_TIMEOUT_S, PairSpec  # noqa: E402
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig  # noqa: E402
from pytest_kvcanary.reference_engine.pd_remote import DecodeResult, TransferTimes  # noqa: E402

MEASURES = ("transfer", "landing", "first token", "generate")
PER_TRANSFER = ("transfer", "landing")  # the others are the batch's


@dataclass
class Measurement:
    """One canary setting's timed calls: ms by measure (MEASURES), and the bytes each transfer
    moved (means over the measurement's transfers)."""

    ms: dict[str, float]
    kv_bytes: float
    sidecar_bytes: float


@dataclass
class Reading:
    """A measure over the pairs: off and on ms, the paired costs (percent), and the bytes moved."""

    name: str
    off_ms: list[float] = field(default_factory=list)
    on_ms: list[float] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)
    kv_bytes: float = 0.0
    sidecar_bytes: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argv: None for sys.argv), with what it implies: devices, dtype, kernels;
    --smoke's tiny shapes on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="requests a generate call sends")
    parser.add_argument("--prompt", type=int, default=4096, help="tokens a prompt holds")
    parser.add_argument("--new", type=int, default=32, help="max_new_tokens of the timed generate call")
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=1, help="untimed generate calls before a measurement's")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--decode-mode", default="eager", choices=["eager", "padded", "graph"])
    parser.add_argument("--real-data", default="partial", choices=["none", "partial", "all"])
    parser.add_argument("--smoke", action="store_true", help="the CPU pair over gloo, tiny shapes: checks the script")
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt, args.pairs) < 1 or args.new < 2 or args.warmup < 0:
        parser.error("--batch, --prompt and --pairs must be at least 1, --new at least 2 (a decoded token), "
                     "--warmup at least 0")
    if args.smoke:
        args.devices, args.dtype, args.kernels = ("cpu", "cpu"), torch.float32, "torch"
        args.batch, args.prompt, args.new, args.pairs, args.warmup = 2, 48, 4, 4, 1
        args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.intermediate = 64, 2, 4, 2, 16, 128
        if args.decode_mode == "graph":
            parser.error("--decode-mode graph captures CUDA graphs: not with --smoke")
        args.vocab = 512
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("bench_pd_transfer.py puts prefill and decode on a GPU each: it needs 2 CUDA devices "
                             "(or --smoke)")
        args.devices, args.dtype, args.kernels, args.vocab = ("cuda:0", "cuda:1"), torch.bfloat16, "triton", 32000
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Both sides' engine (each on its own device): the batch prefills in one forward, and the
    pools hold it twice over."""
    context = args.prompt + args.new
    model = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                        max_context=context, dtype=args.dtype, seed=0, attention="mha")
    return EngineConfig(model=model, num_slots=2 * args.batch * (context + 2) + 1, max_running=args.batch,
                        max_batch_tokens=args.batch * context, device=args.devices[0], decode_mode=args.decode_mode)


def transfer_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """(KV bytes, sidecar bytes) a transfer of one prompt moves, canary on (mha: one FULL group of
    two halves, each slot's record RECORD_WIDTH int64)."""
    size = torch.empty((), dtype=args.dtype).element_size()
    return (args.prompt * args.layers * 2 * args.kv_heads * args.head_dim * size,
            args.prompt * 2 * RECORD_WIDTH * 8)


def open_pair(args: argparse.Namespace) -> ProcessPairHandle:
    """The pair the bench measures, canary attached, reset."""
    canary = CanaryConfig(real_data=args.real_data, kernels=args.kernels)
    pair = ProcessPairHandle(PairSpec("mha", 0, canary, args.devices, config=engine_config(args)))
    pair.reset(0, ())
    return pair


def prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, args.vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]


def generate(pair: ProcessPairHandle, batch: list[list[int]], max_new_tokens: int
             ) -> tuple[float, DecodeResult, dict[int, float]]:
    """One generate call of the pair: its wall time (ms), the decode side's result and when the
    prefill side began sending each transfer. Raises when a request was not decoded to the end."""
    start = time.perf_counter()
    decoded, began = pair.processes.call("generate", batch, max_new_tokens, None, DEFAULT_TRANSFER_TIMEOUT_S, ())
    ms = 1e3 * (time.perf_counter() - start)
    short = [i for i, out in enumerate(decoded.outputs) if len(out) != max_new_tokens]
    if decoded.failure or decoded.aborted or short:
        raise RuntimeError(f"the pair did not decode every request: failure {decoded.failure}, aborted "
                           f"{decoded.aborted}, requests short of {max_new_tokens} tokens {short}")
    return ms, decoded, began


def measure(pair: ProcessPairHandle, on: bool, batch: list[list[int]], warm: list[list[list[int]]],
            new: int) -> Measurement:
    """One measurement (the module docstring): the canary set `on`, the warm-up calls, then the
    first-token and generate calls, the pair reset before each; checked for violations after."""
    pair.set_canary(on)
    for other in warm:
        generate(pair, other, new)
        pair.reset(0, ())
    first_ms, first, first_began = generate(pair, batch, 2)
    pair.reset(0, ())
    generate_ms, whole, whole_began = generate(pair, batch, new)
    times: list[tuple[TransferTimes, float]] = [(t, first_began[t.seq]) for t in first.transfers]
    times += [(t, whole_began[t.seq]) for t in whole.transfers]
    if len(times) != 2 * len(batch):
        raise RuntimeError(f"expected {2 * len(batch)} transfers, the decode side landed {len(times)}")
    if any(bool(t.sidecar_bytes) != on for t, _ in times):
        raise RuntimeError(f"canary {'on' if on else 'off'}: sidecars of "
                           f"{sorted({t.sidecar_bytes for t, _ in times})} bytes went")
    found = [v for report in pair.processes.call("collect") for v in report.violations]
    if found:
        raise RuntimeError(f"canary {'on' if on else 'off'}: {len(found)} violation(s), the first: {found[0]}")
    return Measurement({"transfer": statistics.mean(1e3 * (t.landed - began) for t, began in times),
                        "landing": statistics.mean(1e3 * (t.landed - t.received) for t, _ in times),
                        "first token": first_ms, "generate": generate_ms},
                       statistics.mean(t.kv_bytes for t, _ in times),
                       statistics.mean(t.sidecar_bytes for t, _ in times))


def alternate(i: int, measure_one: Callable[[bool], Measurement]) -> tuple[Measurement, Measurement]:
    """Pair i: (off, on) from measure_one(canary on?), off first in even pairs, on first in odd."""
    done = {on: measure_one(on) for on in ((False, True) if i % 2 == 0 else (True, False))}
    return done[False], done[True]


def run(args: argparse.Namespace, pair: ProcessPairHandle, out: Any = sys.stdout) -> list[Reading]:
    """args.pairs pairs on `pair` (its canary attached and the pair reset after); a progress line
    each to `out`. The readings, by MEASURES."""
    readings = {name: Reading(name) for name in MEASURES}
    for i in range(args.pairs):
        batch = prompts(args, i)
        warm = [prompts(args, 1_000_000 + args.warmup * i + w) for w in range(args.warmup)]
        off, on = alternate(i, lambda canary: measure(pair, canary, batch, warm, args.new))
        for name, reading in readings.items():
            reading.off_ms.append(off.ms[name])
            reading.on_ms.append(on.ms[name])
            reading.costs.append(100 * (on.ms[name] - off.ms[name]) / off.ms[name])
            scale = 1 if name in PER_TRANSFER else args.batch
            reading.kv_bytes, reading.sidecar_bytes = scale * on.kv_bytes, scale * on.sidecar_bytes
        print(f"pair {i + 1}/{args.pairs} ({'off' if i % 2 == 0 else 'on'} first): " + ", ".join(
            f"{name} {r.off_ms[-1]:.2f} -> {r.on_ms[-1]:.2f} ms {r.costs[-1]:+.2f}% "
            f"(median {statistics.median(r.costs):+.2f}%)" for name, r in readings.items()), file=out, flush=True)
    pair.set_canary(True)
    return list(readings.values())


def size(n: float) -> str:
    """Bytes, and in the largest binary unit that is at most n."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,.0f} B ({n / scale:.1f} {unit})"
    return f"{n:,.0f} B"


def table(args: argparse.Namespace, readings: list[Reading]) -> str:
    labels = {"transfer": "transfer (per transfer)", "landing": "landing (per transfer)",
              "first token": f"first decoded token (batch of {args.batch})",
              "generate": f"generate, {args.new} tokens (batch of {args.batch})"}
    lines = ["| measure | off ms | on ms | cost (median) | 95% interval | min..max | pairs | KV moved "
             "| sidecar moved |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in readings:
        low, high = median_interval(r.costs)
        lines.append(f"| {labels[r.name]} | {statistics.median(r.off_ms):.3f} | {statistics.median(r.on_ms):.3f} | "
                     f"{statistics.median(r.costs):+.2f}% | {low:+.2f}..{high:+.2f}% | "
                     f"{min(r.costs):+.2f}..{max(r.costs):+.2f}% | {len(r.costs)} | {size(r.kv_bytes)} | "
                     f"{size(r.sidecar_bytes)} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    kv, sidecar = transfer_bytes(args)
    names = "cpu" if args.smoke else f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_name(1)}"
    print(f"prefill on {args.devices[0]}, decode on {args.devices[1]} ({names}; "
          f"{'gloo' if args.smoke else 'NCCL'}); mha, {args.layers} layers, {args.heads} heads ({args.kv_heads} KV) x "
          f"{args.head_dim}, hidden {args.hidden}, {str(args.dtype).removeprefix('torch.')}, decode_mode "
          f"{args.decode_mode}; batch {args.batch} x {args.prompt} tokens, {args.new} new; {args.pairs} pairs; "
          f"real_data={args.real_data}, kernels={args.kernels}", flush=True)
    print(f"a transfer moves KV of {size(kv)} and, canary on, a sidecar of {size(sidecar)} "
          f"({100 * sidecar / kv:.2f}% of the KV)", flush=True)
    start = time.perf_counter()
    pair = open_pair(args)
    print(f"pair started in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        readings = run(args, pair)
    finally:
        pair.close()
    print(table(args, readings), flush=True)


if __name__ == "__main__":
    main()
