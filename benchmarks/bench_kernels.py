"""GPU benchmark of the view kernels (verify_view, stamp_view) against device-to-device copy bandwidth.

    python benchmarks/bench_kernels.py              # the default tiling per case
    python benchmarks/bench_kernels.py --sweep      # also time a grid of tilings, keep the best
    python benchmarks/bench_kernels.py --seq-len 64 --page-sizes 1

A pool of 2**20 slots (slot 0 reserved; with pages, block 0), one KV source per case:
  layer   bf16 [num_slots, 8 heads x 128 dim] = 2048 bytes per slot (one layer's K of a GQA model)
  row256  bf16 [num_slots, 128]               =  256 bytes per slot
The batch is every live slot once, as rows of --seq-len positions mapped through an engine table
in a random order (a fragmented pool): a per-token table (page 1) or a block table (page > 1).
verify_view reads every row's whole prefix (a HEAD with a huge batch) and checks position, chain,
token (a token table) and, in partial/all mode, the fingerprint; stamp_view writes the same
positions as one extend per row (two launches: the records, and the chain, one program per row
scanning its entries a tile at a time).

Bytes counted per position are the distinct bytes a launch must move: the table entry (its
element size / page size), the record fields read or written (8 bytes each; the predecessor's
record is the previous position's, already counted), the token-table entry, the token arrays
(stamp), and read_bytes of the source. Times are device times of a launch replayed from a CUDA
graph (the way an engine that captures its forward runs the canary; L2 flushed before each
replay), median of ``triton.testing.do_bench``. GB/s is bytes / time; "% copy" compares it with a
``copy_`` of the source tensor, counting bytes read plus bytes written. The "reads only" row per
page size is the ceiling of verify in all mode on this access pattern: a kernel that loads exactly
what that verify loads, in the same order (table entries, each slot's record and row, the
predecessor's record, the token table) and checks nothing, timed and counted the same way (best
of three tile shapes); a random 32-byte record costs more than its 32 bytes, so it sits under the
copy. "host us" is the host time of one eager call (argument checks and launch), which a captured
forward does not pay.

Tilings are fixed per launch, not autotuned: the kernels write records and ring counters and must
be capturable in a CUDA graph, so benchmarking inside a launch is not an option. --sweep is how
the default tilings (``launch.default_tiling``) were chosen.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl
import triton.testing

from kvcanary_kernels import (
    SlotMapping, RealDataMode, Tiling, ForwardView, ViolationRing, default_tiling, fingerprint_ref, layer_source,
    stamp_view, stamp_view_ref, verify_view, verify_view_ref,
)
from kvcanary_kernels.launch import mapping_args, source_args, token_args
from kvcanary_kernels.lookup import known_token, map_slot
from kvcanary_kernels.record_access import WIDTH, field_ptrs, successor_hash
from kvcanary_kernels.records import FIELD_REAL_KV_HASH, RECORD_WIDTH, GroupKind, Half, Phase, launch_tag


class Case(NamedTuple):
    name: str
    row_elems: int  # bf16 elements per slot


CASES = (Case("layer", 8 * 128), Case("row256", 128))
MODES = (RealDataMode.NONE, RealDataMode.PARTIAL, RealDataMode.ALL)
HEAD = launch_tag(Phase.HEAD, Half.K, GroupKind.FULL)
TAIL = launch_tag(Phase.TAIL, Half.K, GroupKind.FULL)
RECHECK = launch_tag(Phase.RECHECK, Half.K, GroupKind.FULL)


class Batch(NamedTuple):
    mapping: SlotMapping
    head: ForwardView  # reads every row's seq_len positions
    tail: ForwardView  # writes them
    positions: int  # live positions in the batch


def make_batch(num_slots: int, seq_len: int, page_size: int, device: torch.device, gen: torch.Generator) -> Batch:
    """Every live slot (every block past block 0) once, in random order, as rows of seq_len."""
    pages_per_row = -(-seq_len // page_size)
    rows = (num_slots // page_size - 1) // pages_per_row
    blocks = torch.randperm(num_slots // page_size - 1, generator=gen)[: rows * pages_per_row] + 1
    table = blocks.view(rows, pages_per_row).to(device)
    n = rows * seq_len
    tokens = torch.randint(0, 50_000, (rows, seq_len), generator=gen).to(device)
    index = torch.arange(rows, device=device)
    full = torch.full((rows,), seq_len, dtype=torch.int64, device=device)
    none = torch.zeros(rows, dtype=torch.int64, device=device)
    head = ForwardView(index, full, none, torch.zeros(1, dtype=torch.int64, device=device),
                    torch.zeros(1, dtype=torch.int64, device=device), tokens, None)
    positions = torch.arange(seq_len, device=device).repeat(rows)
    tail = ForwardView(index, none, full, tokens.flatten(), positions, tokens, None)
    return Batch(SlotMapping(table, page_size, 0, None), head, tail, n)


def verify_bytes(batch: Batch, sources) -> int:
    table = batch.mapping.table.element_size() / batch.mapping.page_size
    record = (4 if sources else 3) * 8  # position, prev_hash, token (+ real_kv_hash)
    return int(batch.positions * (table + record + 8 + sum(s.read_bytes for s in sources)))  # + token table


def stamp_bytes(batch: Batch, sources) -> int:
    table = batch.mapping.table.element_size() / batch.mapping.page_size
    inputs = 3 * 8  # input id, position, token-table entry
    return int(batch.positions * (table + inputs + RECORD_WIDTH * 8 + sum(s.read_bytes for s in sources)))


def median_ms(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_ms(src: torch.Tensor) -> float:
    """Median time of a device-to-device ``copy_`` of ``src``."""
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src))


@triton.jit
def _reads_only_kernel(records, source, mapping, tokens, out, seq_len, READ_WORDS: tl.constexpr, CHUNK: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, MAP: tl.constexpr, BLOCK: tl.constexpr):
    """Loads what verify_view in all mode loads for tile program_id(1) of batch row program_id(0), and
    checks nothing (a sum keeps the loads)."""
    words, row_stride, words_per_token = source
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    on = pos < seq_len
    slots = map_slot(mapping, MAP, row, pos, on)
    live = on & (slots != 0)
    prev_slots = map_slot(mapping, MAP, row, pos - 1, live & (pos > 0))
    acc = known_token(tokens, row, pos, live) + successor_hash(records, prev_slots, prev_slots != 0).to(tl.int64)
    for field in tl.static_range(WIDTH):
        acc += tl.load(field_ptrs(records, slots, field), mask=live, other=0)
    # The row in [BLOCK, chunk] tiles, each loaded before the previous is summed (as the fingerprint does).
    cols = tl.arange(0, CHUNK)
    ptrs = words + ((slots // PAGE_SIZE) * row_stride + (slots % PAGE_SIZE) * words_per_token)[:, None] + cols[None, :]
    tile = tl.load(ptrs, mask=live[:, None] & (cols < READ_WORDS)[None, :], other=0, eviction_policy="evict_first")
    sums = tl.zeros([BLOCK, CHUNK], tl.int64)
    for start in range(0, READ_WORDS, CHUNK):
        current = tile
        tile = tl.load(ptrs + start + CHUNK, mask=live[:, None] & (start + CHUNK + cols < READ_WORDS)[None, :],
                       other=0, eviction_policy="evict_first")
        sums += current
    tl.store(out + row * tl.num_programs(1) + tl.program_id(1), tl.sum(acc + tl.sum(sums, axis=1), axis=0))


def reads_only_ms(records: torch.Tensor, source, batch: Batch, chunk: int) -> tuple[float, str]:
    """Median device time of _reads_only_kernel over the batch, the best of three tile shapes."""
    (src,), (read,) = source_args([source], chunk)
    mapping, map_consts = mapping_args(batch.mapping, records)
    tokens, _ = token_args(batch.head, records)
    rows, seq_len = batch.head.token_table.shape
    timings = {}
    for block, warps in ((64, 2), (128, 4), (256, 8)):
        grid = (rows, triton.cdiv(seq_len, block))
        out = torch.empty(grid[0] * grid[1], dtype=torch.int64, device=records.device)
        timings[f"{block}/{read[1]}/{warps}"] = device_ms(lambda: _reads_only_kernel[grid](
            records, src, mapping, tokens, out, seq_len, READ_WORDS=read[0], CHUNK=read[1], PAGE_SIZE=read[2],
            MAP=map_consts, BLOCK=block, num_warps=warps))
    best = min(timings, key=timings.get)
    return timings[best], best


def device_ms(fn: Callable[[], None]) -> float:
    """Median device time of one call of ``fn``, replayed from a CUDA graph (as inside a captured
    forward), so the host's launch cost does not count; L2 is flushed before each replay."""
    fn()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def host_us(fn: Callable[[], None], calls: int = 200) -> float:
    """Host time of one eager call (argument checks and the launch), the device kept busy."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def attach(num_slots: int, sources, device: torch.device) -> torch.Tensor:
    """Records with slot 0's fingerprint, as the runtime writes them when it attaches."""
    records = torch.zeros(num_slots, RECORD_WIDTH, dtype=torch.int64, device=device)
    records[0, FIELD_REAL_KV_HASH] = fingerprint_ref(sources, torch.zeros(1, dtype=torch.int64, device=device))[0]
    return records


def check_against_reference(device: torch.device, page_sizes: list[int]) -> None:
    """Kernels == references on a small pool of each case, mode and mapping, clean and corrupted,
    and a HEAD + TAIL + RECHECK forward replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(0)
    for case in CASES:
        kv = torch.randn(4096, case.row_elems, generator=gen).to(device, torch.bfloat16)
        for page_size in page_sizes:
            batch = make_batch(kv.shape[0], 100, page_size, device, gen)
            for mode in MODES:
                src = layer_source(kv, 1, mode)
                sources = [src] if src else []
                results = []
                for stamp, verify in ((stamp_view, verify_view), (stamp_view_ref, verify_view_ref)):
                    records = attach(kv.shape[0], sources, device)
                    ring = ViolationRing(64, device)
                    opts = dict(max_context=100, check_tokens=True, sentinel=True)
                    stamp(records, sources, batch.mapping, batch.tail, ring, TAIL, check_tokens=True,
                          check_write_inputs=True)
                    verify(records, sources, batch.mapping, batch.head, ring, HEAD, window=0, **opts)
                    clean = int(ring.count)
                    records[batch.mapping.table[::7, 80 // page_size] * page_size + 80 % page_size, 0] += 1
                    verify(records, sources, batch.mapping, batch.head, ring, HEAD, window=30, **opts)
                    claimed = int(ring.count)
                    rows = sorted(map(tuple, ring.rows[:claimed].tolist()))
                    results.append((records.cpu(), clean, claimed, rows))
                (rec_k, clean_k, total_k, rows_k), (rec_r, clean_r, total_r, rows_r) = results
                what = f"{case.name}/page {page_size}/{mode.value}"
                assert torch.equal(rec_k, rec_r), f"{what}: records differ"
                assert clean_k == clean_r == 0, f"{what}: clean verify reported {clean_k}"
                assert total_k == total_r > 0 and rows_k == rows_r, f"{what}: rows differ"
    sources = [layer_source(kv, 1, RealDataMode.ALL)]
    records = attach(kv.shape[0], sources, device)
    ring = ViolationRing(64, device)

    def forward() -> None:
        verify_view(records, sources, batch.mapping, batch.head, ring, HEAD, window=0, max_context=100,
                    check_tokens=True, sentinel=True)
        stamp_view(records, sources, batch.mapping, batch.tail, ring, TAIL, check_tokens=True,
                   check_write_inputs=True)
        verify_view(records, sources, batch.mapping, batch.head, ring, RECHECK, window=0, max_context=100,
                    check_tokens=True, sentinel=True)

    stamp_view(records, sources, batch.mapping, batch.tail, ring, TAIL, check_tokens=True, check_write_inputs=True)
    forward()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    runs = ring.kernel_runs.tolist()
    assert (runs[HEAD], runs[TAIL], runs[RECHECK]) == (4, 5, 4) and int(ring.count) == 0, f"graph replay: {runs}"
    print("check: kernels == references on every case, mode and mapping; graph replay counts launches")


def sweep_tilings(read_words: int) -> list[Tiling]:
    width = triton.next_power_of_2(max(read_words, 1))
    chunks = [c for c in (8, 16, 32) if c <= width] or [width]
    return [Tiling(b, c, w) for b in (64, 128, 256) for w in (2, 4, 8) if b == 32 * w for c in chunks]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=1 << 20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16], help="mapping pages to time")
    parser.add_argument("--ops", nargs="+", choices=("verify", "stamp"), default=["verify", "stamp"])
    parser.add_argument("--sweep", action="store_true", help="time a grid of tilings per row")
    args = parser.parse_args(argv)
    for page in args.page_sizes:
        if page < 1 or page & (page - 1) or args.slots % page:
            parser.error(f"--page-sizes takes powers of two that divide --slots; got {page}")
    if args.seq_len < 1 or args.slots < 4 * args.seq_len:
        parser.error(f"--seq-len must be >= 1 and --slots >= 4 * --seq-len; got {args.seq_len} and {args.slots}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; {args.slots} slots, rows of {args.seq_len}")
    check_against_reference(device, args.page_sizes)

    gen = torch.Generator().manual_seed(1)
    kv_gen = torch.Generator(device).manual_seed(2)
    table = []
    for case in CASES:
        kv = torch.randn(args.slots, case.row_elems, generator=kv_gen, device=device, dtype=torch.bfloat16)
        copy_bytes = 2 * kv.numel() * kv.element_size()
        copy_gbs = copy_bytes / copy_ms(kv) / 1e6
        print(f"\n{case.name}: {kv.shape[1] * 2} bytes per slot; copy {copy_gbs:.0f} GB/s")
        table.append((case.name, "copy", "-", "-", "-", copy_bytes / copy_gbs / 1e3, copy_bytes, copy_gbs, 1.0,
                      float("nan")))
        for page_size in args.page_sizes:
            batch = make_batch(args.slots, args.seq_len, page_size, device, gen)
            full = layer_source(kv, 1, RealDataMode.ALL)
            ms, shape = reads_only_ms(attach(args.slots, [full], device), full, batch, default_tiling([full]).chunk)
            nbytes = verify_bytes(batch, [full])
            table.append((case.name, "reads only", page_size, "all", shape, ms * 1e3, nbytes, nbytes / ms / 1e6,
                          nbytes / ms / 1e6 / copy_gbs, float("nan")))
            ring = ViolationRing(1024, device)
            for mode in MODES:
                src = layer_source(kv, 1, mode)
                sources = [src] if src else []
                records = attach(args.slots, sources, device)
                stamp_view(records, sources, batch.mapping, batch.tail, ring, TAIL, check_tokens=True,
                           check_write_inputs=True)
                ops = {
                    "verify": (verify_bytes(batch, sources), lambda t: verify_view(
                        records, sources, batch.mapping, batch.head, ring, HEAD, window=0, max_context=args.seq_len,
                        check_tokens=True, sentinel=True, tiling=t)),
                    "stamp": (stamp_bytes(batch, sources), lambda t: stamp_view(
                        records, sources, batch.mapping, batch.tail, ring, TAIL, check_tokens=True,
                        check_write_inputs=True, tiling=t)),
                }
                for op in args.ops:
                    nbytes, run = ops[op]
                    candidates = [default_tiling(sources)]
                    if args.sweep:
                        candidates += [t for t in sweep_tilings(src.read_bytes // 8 if src else 0)
                                       if t != candidates[0]]
                    timings = {}
                    for tiling in candidates:
                        timings[tiling] = device_ms(lambda: run(tiling))
                        gbs = nbytes / timings[tiling] / 1e6
                        print(f"  page {page_size:2d} {op:6s} {mode.value:7s} block={tiling.block:4d} "
                              f"chunk={tiling.chunk:3d} warps={tiling.num_warps}: "
                              f"{timings[tiling] * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs / copy_gbs:6.1%}")
                    chosen = min(timings, key=timings.get)
                    ms = timings[chosen]
                    gbs = nbytes / ms / 1e6
                    table.append((case.name, op, page_size, mode.value, "/".join(map(str, chosen)), ms * 1e3,
                                  nbytes, gbs, gbs / copy_gbs, host_us(lambda: run(chosen))))
            torch.cuda.synchronize()
            assert int(ring.count) == 0, f"clean runs reported {int(ring.count)} violations"
        del kv

    print("\n| case | op | page | mode | block/chunk/warps | time (us) | MB moved | GB/s | % of copy | host us |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    for name, op, page, mode, tiling, us, nbytes, gbs, ratio, host in table:
        print(f"| {name} | {op} | {page} | {mode} | {tiling} | {us:.1f} | {nbytes / 1e6:.1f} | {gbs:.0f} | {ratio:.0%} "
              f"| {host:.0f} |")
    ceilings = {(name, page): us for name, op, page, _, _, us, *_ in table if op == "reads only"}
    for name, op, page, mode, _, us, *_ in table:
        if op == "verify" and mode == "all":
            share = ceilings[name, page] / us
            print(f"{name}, page {page}: verify in all mode at {share:.0%} of the reads-only ceiling")


if __name__ == "__main__":
    main()
