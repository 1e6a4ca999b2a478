"""GPU benchmark of the stamp and verify kernels against device-to-device copy bandwidth.

    python benchmarks/bench_kernels.py              # DEFAULT_TILING
    python benchmarks/bench_kernels.py --sweep      # also time a grid of tilings, keep the best
    python benchmarks/bench_kernels.py --seq-len 64

A pool of 2**20 slots (slot 0 reserved, every other slot live), one KV source per case:
  layer   bf16 [num_slots, 8 heads x 128 dim] = 2048 bytes per slot (one layer's K of a GQA model)
  row256  bf16 [num_slots, 128]               =  256 bytes per slot
Entries cover all live slots in a random order (a fragmented pool), as sequences of --seq-len
positions: verify checks position, chain (previous slot's record), token and, in partial/all
mode, the fingerprint; stamp writes the records and runs the write checks (one launch), then the
per-sequence chains (a second launch, one lane per sequence: its steps are serial, so stamp time
grows with --seq-len).

Bytes counted per live entry are what the kernels must move: the entry arrays read once, the
record fields read or written (8 bytes each; verify also reads 3 fields of the previous slot's
record), and read_bytes of the source. GB/s is bytes / median time; "% copy" compares it with a
``copy_`` of the source tensor, counting bytes read plus bytes written.

Tilings are fixed per launch, not autotuned: the kernels write records and ring counters and must
be capturable in a CUDA graph, so benchmarking inside a launch is not an option. --sweep is how
DEFAULT_TILING was chosen.
"""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

import torch
import triton
import triton.testing

from kvcanary_kernels import (
    DEFAULT_TILING, RealDataMode, Tiling, VerifyEntries, ViolationRing, WriteEntries, layer_source,
    stamp_records, stamp_records_ref, verify_records, verify_records_ref,
)
from kvcanary_kernels.records import RECORD_WIDTH


class Case(NamedTuple):
    name: str
    row_elems: int  # bf16 elements per slot


CASES = (Case("layer", 8 * 128), Case("row256", 128))
MODES = (RealDataMode.NONE, RealDataMode.PARTIAL, RealDataMode.ALL)


class Plan(NamedTuple):
    verify: VerifyEntries
    write: WriteEntries


def make_plan(num_slots: int, seq_len: int, device: torch.device, gen: torch.Generator) -> Plan:
    """Every live slot once, in random order, as sequences of seq_len positions from 0."""
    n = num_slots - 1
    slots = (torch.randperm(n, generator=gen) + 1).to(device)
    index = torch.arange(n, device=device)
    positions = index % seq_len
    prev = torch.where(positions == 0, -1, torch.roll(slots, 1))
    tokens = torch.randint(0, 50_000, (n,), generator=gen).to(device)
    rows = index // seq_len
    seg_starts = torch.arange(0, n, seq_len, device=device)
    seg_lens = (n - seg_starts).clamp(max=seq_len)
    verify = VerifyEntries(slots, positions, prev, tokens, rows)
    write = WriteEntries(slots, tokens, positions, positions.clone(), tokens.clone(), rows,
                         seg_starts, seg_lens, torch.full_like(seg_starts, -1))
    return Plan(verify, write)


def verify_bytes(plan: Plan, sources) -> int:
    v = plan.verify
    live = int((v.slots != 0).sum())
    with_prev = int((v.prev_slots >= 0).sum())
    entry = 4 * 8  # slots, positions, prev_slots, tokens
    record = (3 + (1 if sources else 0)) * 8  # position, prev_hash, token (+ real_kv_hash)
    return live * (entry + record + sum(s.read_bytes for s in sources)) + with_prev * 3 * 8


def stamp_bytes(plan: Plan, sources) -> int:
    w = plan.write
    live = int((w.slots != 0).sum())
    entry = 5 * 8  # slots, tokens, positions, expected_positions, expected_tokens
    record = RECORD_WIDTH * 8
    return live * (entry + record + sum(s.read_bytes for s in sources))


def median_ms(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def check_against_reference(device: torch.device) -> None:
    """Kernels == references on a small pool of each case and mode, clean and corrupted, and a
    verify launch replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(0)
    for case in CASES:
        kv = torch.randn(4096, case.row_elems, generator=gen).to(device, torch.bfloat16)
        plan = make_plan(kv.shape[0], 100, device, gen)
        for mode in MODES:
            src = layer_source(kv, 1, mode)
            sources = [src] if src else []
            results = []
            for stamp, verify in ((stamp_records, verify_records), (stamp_records_ref, verify_records_ref)):
                records = torch.zeros(kv.shape[0], RECORD_WIDTH, dtype=torch.int64, device=device)
                ring = ViolationRing(64, device)
                stamp(records, plan.write, sources, ring, 2)
                verify(records, plan.verify, sources, ring, 0)
                clean = ring.total()
                records[plan.verify.slots[::500], 0] += 1
                verify(records, plan.verify, sources, ring, 0)
                rows = sorted(map(tuple, ring.read(0, ring.total()).tolist()))
                results.append((records.cpu(), clean, ring.total(), rows))
            (rec_k, clean_k, total_k, rows_k), (rec_r, clean_r, total_r, rows_r) = results
            assert torch.equal(rec_k, rec_r), f"{case.name}/{mode.value}: records differ"
            assert clean_k == clean_r == 0, f"{case.name}/{mode.value}: clean verify reported {clean_k}"
            assert total_k == total_r > 0 and rows_k == rows_r, f"{case.name}/{mode.value}: rows differ"
    records = torch.zeros(kv.shape[0], RECORD_WIDTH, dtype=torch.int64, device=device)
    ring = ViolationRing(64, device)
    sources = [layer_source(kv, 1, RealDataMode.ALL)]
    stamp_records(records, plan.write, sources, ring, 2)
    verify_records(records, plan.verify, sources, ring, 0)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_records(records, plan.verify, sources, ring, 0)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert ring.kernel_runs[0].item() == 4 and ring.total() == 0, "graph replay"
    print("check: kernels == references on every case and mode; graph replay counts launches")


def sweep_tilings(read_words: int) -> list[Tiling]:
    width = triton.next_power_of_2(max(read_words, 1))
    chunks = [c for c in (8, 16, 32) if c <= width] or [width]
    return [Tiling(b, c, w) for b in (64, 128, 256) for w in (2, 4, 8) if b == 32 * w for c in chunks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=1 << 20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--sweep", action="store_true", help="time a grid of tilings per row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; {args.slots} slots, sequences of {args.seq_len}")
    check_against_reference(device)

    gen = torch.Generator().manual_seed(1)
    plan = make_plan(args.slots, args.seq_len, device, gen)
    kv_gen = torch.Generator(device).manual_seed(2)
    table = []
    for case in CASES:
        kv = torch.randn(args.slots, case.row_elems, generator=kv_gen, device=device, dtype=torch.bfloat16)
        copy_dst = torch.empty_like(kv)
        copy_bytes = 2 * kv.numel() * kv.element_size()
        copy_gbs = copy_bytes / median_ms(lambda: copy_dst.copy_(kv)) / 1e6
        del copy_dst
        print(f"\n{case.name}: {kv.shape[1] * 2} bytes per slot; copy {copy_gbs:.0f} GB/s")
        table.append((case.name, "copy", "-", "-", copy_bytes / copy_gbs / 1e3, copy_bytes, copy_gbs, 1.0))
        records = torch.zeros(args.slots, RECORD_WIDTH, dtype=torch.int64, device=device)
        ring = ViolationRing(1024, device)
        for mode in MODES:
            src = layer_source(kv, 1, mode)
            sources = [src] if src else []
            stamp_records(records, plan.write, sources, ring, 2)
            ops = {
                "verify": (verify_bytes(plan, sources),
                           lambda t: verify_records(records, plan.verify, sources, ring, 0, tiling=t)),
                "stamp": (stamp_bytes(plan, sources),
                          lambda t: stamp_records(records, plan.write, sources, ring, 2, tiling=t)),
            }
            for op, (nbytes, run) in ops.items():
                candidates = [DEFAULT_TILING]
                if args.sweep:
                    candidates += [t for t in sweep_tilings(src.read_bytes // 8 if src else 0)
                                   if t != DEFAULT_TILING]
                timings = {}
                for tiling in candidates:
                    timings[tiling] = median_ms(lambda: run(tiling))
                    gbs = nbytes / timings[tiling] / 1e6
                    print(f"  {op:6s} {mode.value:7s} block={tiling.block:4d} chunk={tiling.chunk:3d} "
                          f"warps={tiling.num_warps}: "
                          f"{timings[tiling] * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs / copy_gbs:6.1%}")
                chosen = min(timings, key=timings.get)
                ms = timings[chosen]
                gbs = nbytes / ms / 1e6
                table.append((case.name, op, mode.value, "/".join(map(str, chosen)), ms * 1e3,
                              nbytes, gbs, gbs / copy_gbs))
        torch.cuda.synchronize()
        assert ring.total() == 0, f"clean runs reported {ring.total()} violations"
        del kv, records

    print("\n| case | op | mode | block/chunk/warps | time (us) | MB moved | GB/s | % of copy |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name, op, mode, tiling, us, nbytes, gbs, ratio in table:
        print(f"| {name} | {op} | {mode} | {tiling} | {us:.1f} | {nbytes / 1e6:.1f} | {gbs:.0f} | {ratio:.0%} |")


if __name__ == "__main__":
    main()
