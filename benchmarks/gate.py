"""The GPU performance gate: what the canary costs on SGLang's CI shapes and ours, each row read to
a 95% interval and held to a budget.

    python benchmarks/gate.py                                   # every row (GPU)
    python benchmarks/gate.py --rows reference-b1 decode-tinyllama-b1
    python benchmarks/gate.py --list                            # the rows and their budgets
    python benchmarks/gate.py --smoke --rows reference-b1       # tiny shapes on the CPU: checks the script
    python benchmarks/gate.py --rows ... --json gpu0.jsonl      # each row's reading kept as it ends
    python benchmarks/gate.py --table gpu0.jsonl gpu1.jsonl     # the table of readings made apart
    python benchmarks/gate.py --claim DIR --json gpuN.jsonl     # one of several processes sharing the rows
    python benchmarks/gate.py --claim DIR --pool ROW ...        # ... and reading ROW together, its pairs pooled

A row is one measurement of the committed benchmarks, canary off versus on in one process:
transformers continuous batching with CUDA graphs (bench_transformers.py: a decode step's median
time at a batch size, or the time to first token of a prefill), or the reference engine's graph
decode (bench_reference.py: a decode step's median time). A transformers pair is one off run and
one on run of one engine (the order alternates, so a drift lands on both sides); a reference pair
is one run of two engines side by side, the canary off on one and on on the other, their decode
steps timed in turn (bench_reference.SideBySide: the host's pace moves between runs by more than
the canary costs, and within a run both sides share it). Its cost is (on - off) / off.

Per row, pairs are measured until the 95% interval of the median cost (a seeded bootstrap over
the pairs, at least --min-pairs of them) is decided against the row's budget: entirely at or
under it (within), entirely over it (over). A row whose interval still straddles its budget after
--max-pairs pairs or --seconds (--prefill-seconds for a prefill row; no new pair starts past them,
but the first --min-pairs always run) reads "unreadable": its spread is wider than its margin, and it
gates nothing. Each pair prints a progress line (the clock time, its cost, both sides); the table comes
last. A transformers decode row's side of a pair is one generation of DECODE_NEW tokens, its median
step (the row's engine warmed once a mode when it opens); a prefill row's, one warmed prefill (the
row's engine run once a mode at its full shape when it opens); a
reference row's, the median of its engine's timed steps in the run.

Processes sharing a claim folder read the rows --pool names together (each on its own GPU, before
the rows they share out): each appends its pairs to the row's file in the folder and decides on
all the pairs there, so a row whose spread needs more pairs than one GPU makes in its time gets
them from every GPU. A pair is still one process's off and on runs. --table pools every reading of
a row it is given and reads the row's verdict from all their pairs.

Exit status: 0 when every row is within its budget, 1 when a row is over, 2 when none is over
but a row could not be read (with --table: or was not read at all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).parent))  # the benchmarks the rows run

WITHIN, OVER, UNREADABLE = "within", "over", "unreadable"
DECODE_NEW = 32  # tokens a decode row's generation decodes: one generation a side of a pair, its median step
Pair = Callable[[int], tuple[float, float]]  # pair i -> (off ms, on ms)


@dataclass(frozen=True)
class Row:
    """A gated measurement: its budget (percent of the off time) and what opens it (smoke: tiny
    shapes on the CPU), returning the pair function and what to close when done."""

    budget: float
    what: str
    open: Callable[[bool], tuple[Pair, Callable[[], None]]]


def verdict(costs: Sequence[float], budget: float, min_pairs: int) -> str | None:
    """within / over once at least min_pairs costs put the 95% interval of their median on one
    side of the budget; None while it straddles it (or too few)."""
    from bench_reference import median_interval

    if len(costs) < min_pairs:
        return None
    low, high = median_interval(list(costs))
    if high <= budget:
        return WITHIN
    if low > budget:
        return OVER
    return None


def alternate(i: int, measure: Callable[[bool], float]) -> tuple[float, float]:
    """Pair i: (off ms, on ms) from measure(canary on?), off first in even pairs, on first in odd."""
    ms = {canary: measure(canary) for canary in ((False, True) if i % 2 == 0 else (True, False))}
    return ms[False], ms[True]


def reference(attention: str, batch: int, kv_dtype: str = "auto") -> Callable[[bool], tuple[Pair, Callable[[], None]]]:
    def open_row(smoke: bool) -> tuple[Pair, Callable[[], None]]:
        import bench_reference as bench
        from pytest_kvcanary.config import CanaryConfig

        args = bench.parse_args(["--attention", attention, "--kv-dtype", kv_dtype] + (["--smoke"] if smoke else []))
        engines = bench.SideBySide(bench.engine_config(args, batch), CanaryConfig(
            real_data="partial", sweep_interval=args.sweep_interval, kernels=args.kernels))
        return (lambda i: engines.pair(batch, args.prompt, args.warmup, args.steps, i)), engines.close

    return open_row


def transformers(shape: str, batch: int, prefill: int | None = None) -> Callable[[bool], tuple[Pair, Callable[[], None]]]:
    """A decode row at `batch` (CUDA graphs), or with `prefill` a prefill row of batch x prefill."""
    def open_row(smoke: bool) -> tuple[Pair, Callable[[], None]]:
        import torch

        import bench_transformers as bench

        device = "cpu" if smoke else "cuda"
        model, tokenizer = bench.random_model(device, shape, smoke)
        kernels = "torch" if smoke else "triton"
        if prefill is not None:
            rows, prompt = (2, 24) if smoke else (batch, prefill)
            engine = bench.prefill_engine(model, tokenizer, rows, prompt)
            bench.warm_prefill(engine, rows, prompt, kernels)

            def pair(i: int) -> tuple[float, float]:
                return bench.measure_prefill(engine, rows, prompt, "partial", kernels, i)[:2]
        else:
            rows, (prompt, new) = (2 if smoke else batch), ((24, 8) if smoke else (bench.PROMPT, DECODE_NEW))
            engine = bench.decode_engine(model, tokenizer, rows, prompt, new, not smoke, "sync")

            def step_ms(canary: bool) -> float:
                def work(_: object = None) -> float:
                    return bench.run(engine, rows, prompt, new, 1, warmup=False, phases=False)[0]
                return bench.with_canary(engine, "partial", kernels, work) if canary else work()

            step_ms(False), step_ms(True)  # the compiles and the engine's graph captures, once a mode

            def pair(i: int) -> tuple[float, float]:
                return alternate(i, step_ms)

        def close() -> None:
            engine.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

        return pair, close

    return open_row


def decode(shape: str, batch: int, budget: float) -> Row:
    return Row(budget, f"transformers, {shape} shape, CUDA graphs: decode step at batch {batch}", transformers(shape, batch))


# The order processes sharing the rows (--claim) take them in (after the rows they --pool): the reference
# rows after the TinyLlama prefill (pooled by gpu_run.sh), then the longest first, so the processes end
# close together.
ROWS: dict[str, Row] = {
    "prefill-tinyllama-32x16384": Row(1.0, "transformers, TinyLlama shape: time to first token of 32 x 16384",
                                      transformers("tinyllama", 32, 16384)),
    "reference-b1": Row(2.0, "reference engine, graph decode at batch 1", reference("mha", 1)),
    "reference-hybrid-b32": Row(2.0, "reference engine, hybrid model, graph decode at batch 32",
                                reference("hybrid", 32)),
    "reference-hybrid-b1": Row(3.0, "reference engine, hybrid model, graph decode at batch 1", reference("hybrid", 1)),
    "reference-b32": Row(2.0, "reference engine, graph decode at batch 32", reference("mha", 32)),
    "reference-fp8-b1": Row(3.0, "reference engine, KV in FP8 (e4m3), graph decode at batch 1",
                            reference("mha", 1, "fp8_e4m3")),
    "reference-fp8-b32": Row(2.0, "reference engine, KV in FP8 (e4m3), graph decode at batch 32",
                             reference("mha", 32, "fp8_e4m3")),
    "decode-llama3-8b-b128": decode("llama3-8b", 128, 0.5),
    "prefill-llama3-8b-8x16384": Row(1.0, "transformers, Llama-3-8B shape: time to first token of 8 x 16384",
                                     transformers("llama3-8b", 8, 16384)),
    "decode-llama3-8b-b64": decode("llama3-8b", 64, 0.5),
    "decode-tinyllama-b128": decode("tinyllama", 128, 0.5),
    "decode-tinyllama-b64": decode("tinyllama", 64, 0.5),
    "decode-llama3-8b-b1": decode("llama3-8b", 1, 1.5),
    "decode-tinyllama-b1": decode("tinyllama", 1, 1.5),
}


def claim(folder: Path, name: str) -> bool:
    """True for the one process among those sharing ``folder`` that claims the row first (it
    creates the row's file there, atomically); False for the others."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@dataclass
class Reading:
    name: str
    costs: list[float]
    off_ms: list[float]
    on_ms: list[float]
    verdict: str
    seconds: float


def cost(off: float, on: float) -> float:
    """A pair's cost: percent of its off time."""
    return 100 * (on - off) / off


def pooled(shared: Path, off: float, on: float) -> list[float]:
    """Append this pair to `shared` (one line, one write: processes append side by side) and return
    the costs of every pair there."""
    with open(shared, "a") as out:
        out.write(f"{off!r} {on!r}\n")
    pairs = [tuple(map(float, line.split())) for line in shared.read_text().split("\n")[:-1]]  # whole lines
    return [cost(off, on) for off, on in pairs]


def read(name: str, row: Row, smoke: bool, min_pairs: int, max_pairs: int, seconds: float,
         shared: Path | None = None) -> Reading:
    """Pairs until the row's verdict is decided, or the pairs or seconds run out (unreadable); the
    first min_pairs pairs whatever the seconds (nothing is decided on fewer). shared: the file the
    processes reading the row together pool their pairs in (the verdict is read from them all)."""
    start = time.perf_counter()
    pair, close = row.open(smoke)
    costs, offs, ons = [], [], []
    try:
        decided = None
        while decided is None and len(costs) < max_pairs and (len(costs) < min_pairs
                                                                or time.perf_counter() - start < seconds):
            off, on = pair(len(costs))
            offs.append(off)
            ons.append(on)
            costs.append(cost(off, on))
            every = costs if shared is None else pooled(shared, off, on)
            decided = verdict(every, row.budget, min_pairs)
            print(f"{time.strftime('%H:%M:%S')} {name}: pair {len(costs)}: {costs[-1]:+.2f}% "
                  f"(off {off:.3f} ms, on {on:.3f} ms; median {statistics.median(every):+.2f}%"
                  + (f" of {len(every)} pooled)" if shared else ")") + (f", {decided}" if decided else ""), flush=True)
    finally:
        close()
    return Reading(name, costs, offs, ons, decided or UNREADABLE, time.perf_counter() - start)


def table(readings: list[Reading]) -> str:
    from bench_reference import median_interval

    lines = ["| row | budget | pairs | off ms | on ms | cost (median) | 95% interval | verdict | time |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in readings:
        if not r.costs:
            lines.append(f"| {r.name} | {ROWS[r.name].budget:.1f}% | 0 | | | | | {r.verdict} | {r.seconds:.0f} s |")
            continue
        low, high = median_interval(r.costs)
        lines.append(f"| {r.name} | {ROWS[r.name].budget:.1f}% | {len(r.costs)} | {statistics.median(r.off_ms):.3f} | "
                     f"{statistics.median(r.on_ms):.3f} | {statistics.median(r.costs):+.2f}% | "
                     f"{low:+.2f}..{high:+.2f}% | {r.verdict} | {r.seconds:.0f} s |")
    return "\n".join(lines)


def load(paths: Sequence[str], min_pairs: int) -> list[Reading]:
    """The readings --json wrote to these files, in ROWS' order; a row read more than once (by
    processes reading it together, or in several runs) pooled: its pairs together, its verdict
    read from them all, its time the longest reading's."""
    readings: dict[str, Reading] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            reading = Reading(**json.loads(line))
            if reading.name not in ROWS:
                raise SystemExit(f"--table: {path} holds a reading of {reading.name!r}, which is no row; the rows are "
                                 f"{', '.join(ROWS)}")
            before = readings.get(reading.name)
            if before is not None:
                costs = before.costs + reading.costs
                reading = Reading(reading.name, costs, before.off_ms + reading.off_ms, before.on_ms + reading.on_ms,
                                  verdict(costs, ROWS[reading.name].budget, min_pairs) or UNREADABLE,
                                  max(before.seconds, reading.seconds))
            readings[reading.name] = reading
    return [readings[name] for name in ROWS if name in readings]


def finish(readings: list[Reading], expected: Sequence[str]) -> None:
    """Print the table (and the expected rows with no reading), then exit with the gate's status."""
    print(table(readings), flush=True)
    missing = [name for name in expected if name not in {r.name for r in readings}]
    if missing:
        print(f"not read: {', '.join(missing)}")
    verdicts = {r.verdict for r in readings}
    sys.exit(1 if OVER in verdicts else 2 if UNREADABLE in verdicts or missing else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), metavar="ROW", help="rows to read (default: all)")
    parser.add_argument("--list", action="store_true", help="print the rows and their budgets, then exit")
    parser.add_argument("--min-pairs", type=int, default=7)
    parser.add_argument("--max-pairs", type=int, default=41)
    parser.add_argument("--seconds", type=float, default=300.0, help="at most this long a row")
    parser.add_argument("--prefill-seconds", type=float, help="at most this long a prefill row (default: --seconds)")
    parser.add_argument("--claim", metavar="DIR",
                        help="read a row only if no other process given the same DIR has claimed it (a file a row): "
                             "processes on several GPUs, each given every row, share them out as each comes free")
    parser.add_argument("--pool", nargs="+", default=[], metavar="ROW",
                        help="with --claim: rows every process given the same DIR reads at once, before the rows "
                             "they share out, deciding on the pairs of them all")
    parser.add_argument("--json", metavar="PATH", help="append each row's reading to PATH as a JSON line as it ends")
    parser.add_argument("--table", nargs="+", metavar="PATH",
                        help="print the table of the readings --json wrote to these files (every row expected), "
                             "exit with the gate's status, and read nothing")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, 2 pairs a row: checks the script")
    args = parser.parse_args()
    for option, names in (("--rows", args.rows), ("--pool", args.pool)):
        unknown = [name for name in names if name not in ROWS]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
    if args.pool and not args.claim:
        parser.error("--pool needs --claim DIR: the folder the processes reading the rows together share")
    if args.min_pairs < 2 or args.max_pairs < args.min_pairs:
        parser.error(f"--min-pairs must be at least 2 and --max-pairs at least --min-pairs; got "
                     f"{args.min_pairs} and {args.max_pairs}")
    if args.list:
        for name, row in ROWS.items():
            print(f"{name}: <= {row.budget:.1f}%  ({row.what})")
        return
    if args.smoke:
        args.min_pairs = args.max_pairs = 2
    if args.table:
        missing = [path for path in args.table if not Path(path).is_file()]
        if missing:
            parser.error(f"--table: no such file: {', '.join(missing)}")
        finish(load(args.table, args.min_pairs), args.rows)
    readings, mine = [], []
    if args.claim:
        Path(args.claim).mkdir(parents=True, exist_ok=True)
    pool = [name for name in args.rows if name in args.pool]
    for name in pool + [name for name in args.rows if name not in pool]:
        if args.claim and name not in pool and not claim(Path(args.claim), name):
            continue  # another process reads it
        mine.append(name)
        seconds = args.prefill_seconds if name.startswith("prefill-") and args.prefill_seconds else args.seconds
        shared = Path(args.claim) / f"{name}.pairs" if name in pool else None
        readings.append(read(name, ROWS[name], args.smoke, args.min_pairs, args.max_pairs, seconds, shared))
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(asdict(readings[-1])) + "\n")
    finish(readings, mine)


if __name__ == "__main__":
    main()
