"""benchmarks/bench_pd_transfer.py on the CPU pair (gloo, its --smoke shapes): its pairs read every
measure and print the table, and what it stands on: the decode side's clock readings of each
transfer it landed (DecodeResult.transfers) with when the prefill side began sending it, and a
pair whose canaries are detached in their processes (no records stamped, no sidecar, no HEAD) and
attached again.

One pair, started once for the module (the bench's own engine, PairSpec.config) and reset before
each use.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest
import torch

from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.handles.pd_side import DEFAULT_TRANSFER_TIMEOUT_S, PairSpec
from pytest_kvcanary.handles.rank import RankContext
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.pd_transport import TransportFault

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU processes (gloo); GPUs run the bench")

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "bench_pd_transfer.py"
spec = importlib.util.spec_from_file_location("bench_pd_transfer_script", SCRIPT)
bench = sys.modules["bench_pd_transfer_script"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def args():
    return bench.parse_args(["--smoke"])


@pytest.fixture(scope="module")
def pair(args):
    handle = bench.open_pair(args)
    yield handle
    handle.close()


def canary_forwards(context: RankContext) -> int:
    return context.handle.sides[0].runtime.forwards


def fresh(args, seed: int) -> list[list[int]]:
    """The bench's prompts, unlike any other test's (stale bytes of the same tokens would be right)."""
    return bench.prompts(args, 5000 + seed)


def test_the_bench_reads_every_measure_paired_and_prints_the_table(args, pair):
    args = bench.argparse.Namespace(**{**vars(args), "pairs": 2})
    out = io.StringIO()
    readings = bench.run(args, pair, out)
    kv, sidecar = bench.transfer_bytes(args)
    assert [r.name for r in readings] == list(bench.MEASURES)
    for r in readings:
        assert len(r.off_ms) == len(r.on_ms) == len(r.costs) == 2
        assert all(0 < ms < 10_000 for ms in r.off_ms + r.on_ms)
        assert r.costs == [pytest.approx(100 * (on - off) / off) for off, on in zip(r.off_ms, r.on_ms)]
        scale = 1 if r.name in bench.PER_TRANSFER else args.batch
        assert (r.kv_bytes, r.sidecar_bytes) == (scale * kv, scale * sidecar)
    by = {r.name: r for r in readings}
    assert all(t >= land for t, land in zip(by["transfer"].on_ms, by["landing"].on_ms))  # landing is its end
    progress = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in progress] == ["pair 1/2 (off first)", "pair 2/2 (on first)"]
    lines = bench.table(args, readings).splitlines()
    assert lines[0].startswith("| measure | off ms | on ms | cost (median) | 95% interval | min..max | pairs |")
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| transfer (per transfer)", "| landing (per transfer)", "| first decoded token (batch of 2)",
        "| generate, 4 tokens (batch of 2)"]
    assert lines[2].endswith(f"| 2 | {kv:,} B (24.0 KiB) | {sidecar:,} B (3.0 KiB) |")
    pair.generate(fresh(args, 3), 2)  # the canary is left attached
    assert 0 not in pair.call(canary_forwards)


def test_the_decode_side_times_each_transfer_it_landed(args, pair):
    pair.reset(0, ())
    batch = fresh(args, 0)
    decoded, began = pair.processes.call("generate", batch, 3, None, DEFAULT_TRANSFER_TIMEOUT_S, ())
    kv, sidecar = bench.transfer_bytes(args)
    assert sorted((t.seq, t.index) for t in decoded.transfers) == [(i, i) for i in range(len(batch))]
    assert sorted(began) == list(range(len(batch)))
    for t in decoded.transfers:
        assert (t.kv_bytes, t.sidecar_bytes) == (kv, sidecar)
        # receives posted at admission; the prefill side hears the accept after; in, then landed
        assert t.posted <= began[t.seq] <= t.received <= t.landed
        assert t.landed - t.posted < 30
    assert [t.landed for t in decoded.transfers] == sorted(t.landed for t in decoded.transfers)


def test_a_detached_canary_stamps_and_sends_nothing_and_attaches_again(args, pair):
    stale = (TransportFault("stale_bytes", 0),)
    pair.set_canary(False)
    decoded, _ = pair.processes.call("generate", fresh(args, 1), 3, None, DEFAULT_TRANSFER_TIMEOUT_S, stale)
    assert decoded.transfers and {t.sidecar_bytes for t in decoded.transfers} == {0}
    assert pair.call(canary_forwards) == [0, 0]  # neither side stamped or verified a forward
    assert pair.violations() == [] and pair.healthy()  # the stale bytes went unseen: no HEAD

    pair.set_canary(True)  # and reset: the records are fresh again
    decoded, _ = pair.processes.call("generate", fresh(args, 2), 3, None, DEFAULT_TRANSFER_TIMEOUT_S, stale)
    assert {t.sidecar_bytes for t in decoded.transfers} == {bench.transfer_bytes(args)[1]}
    found = {(v.side, v.phase, v.reasons) for v in pair.violations()}
    assert found == {("decode", "HEAD", ("verify_real_kv_hash",))}


def test_a_pair_spec_config_must_be_of_its_attention():
    config = EngineConfig(model=ModelConfig(attention="swa"))
    with pytest.raises(ValueError, match="config's model has attention 'swa'; the pair's is 'mha'"):
        PairSpec("mha", 0, CanaryConfig(), config=config)


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--new", "1"], "--new at least 2"),
    (["--smoke", "--decode-mode", "graph"], "--decode-mode graph captures CUDA graphs: not with --smoke"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs run it")
def test_without_two_gpus_only_the_smoke_runs():
    with pytest.raises(SystemExit, match="needs 2 CUDA devices"):
        bench.parse_args([])
