"""benchmarks/gate.py decides a row only when the 95% interval of its median cost lies on one side
of the budget, reads the rest as unreadable, exits by the worst verdict, pools a row's pairs over
the processes reading it together and the readings a table is given, opens a prefill row with an
unmeasured run at its full shape, and refuses rows it does not know by name."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "gate.py"
spec = importlib.util.spec_from_file_location("gate_script", SCRIPT)
gate = sys.modules["gate_script"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(gate)


def test_a_row_is_decided_only_once_its_interval_clears_the_budget():
    assert gate.verdict([1.0, 1.2, 0.9, 1.1, 1.0, 0.8, 1.1], budget=2.0, min_pairs=7) == gate.WITHIN
    assert gate.verdict([3.0, 3.2, 2.9, 3.1, 3.0, 2.8, 3.1], budget=2.0, min_pairs=7) == gate.OVER
    straddling = [-4.0, 6.0, 1.5, 2.5, -1.0, 5.0, 2.0]
    assert gate.verdict(straddling, budget=2.0, min_pairs=7) is None
    assert gate.verdict([1.0, 1.0, 1.0], budget=2.0, min_pairs=7) is None  # too few pairs yet


def test_a_row_that_stays_undecided_reads_unreadable_and_the_worst_verdict_sets_the_exit():
    costs = iter([-4.0, 6.0, 1.5, 2.5, -1.0, 5.0, 2.0, -3.0, 7.0])
    closed = []
    row = gate.Row(2.0, "a noisy row", lambda smoke: ((lambda i: (100.0, 100.0 + next(costs))), lambda: closed.append(1)))
    reading = gate.read("noisy", row, smoke=True, min_pairs=3, max_pairs=9, seconds=60)
    assert reading.verdict == gate.UNREADABLE and len(reading.costs) == 9 and closed == [1]
    row = gate.Row(2.0, "a cheap row", lambda smoke: ((lambda i: (100.0, 100.5)), lambda: None))
    assert gate.read("cheap", row, smoke=True, min_pairs=3, max_pairs=9, seconds=60).verdict == gate.WITHIN


@pytest.mark.parametrize("argv, message", [
    (["--rows", "decode-b3"], "--rows: unknown decode-b3; the rows are prefill-tinyllama-32x16384"),
    (["--min-pairs", "9", "--max-pairs", "5"], "--max-pairs at least --min-pairs; got 9 and 5"),
    (["--pool", "reference-b1"], "--pool needs --claim DIR"),
    (["--pool", "prefill-b3", "--claim", "x"], "--pool: unknown prefill-b3; the rows are"),
])
def test_bad_arguments_are_refused_by_name(argv, message):
    result = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr


def _reading(name: str, costs: list[float], verdict: str) -> str:
    return gate.json.dumps(gate.asdict(gate.Reading(name, costs, [100.0] * len(costs),
                                                    [100.0 + c for c in costs], verdict, 10.0)))


def test_readings_made_apart_merge_into_one_table_in_row_order_and_exit_by_the_worst(tmp_path):
    first, second = tmp_path / "gpu0.jsonl", tmp_path / "gpu1.jsonl"
    first.write_text(_reading("reference-b32", [0.5] * 7, gate.WITHIN) + "\n")
    second.write_text(_reading("reference-b1", [1.0] * 7, gate.WITHIN) + "\n")
    rows = ["reference-b1", "reference-b32"]
    both = subprocess.run([sys.executable, str(SCRIPT), "--table", str(first), str(second), "--rows", *rows],
                          capture_output=True, text=True)
    assert both.returncode == 0, both.stdout + both.stderr
    lines = [line for line in both.stdout.splitlines() if line.startswith("| reference")]
    assert [line.split("|")[1].strip() for line in lines] == rows and "+1.00%" in lines[0]
    one = subprocess.run([sys.executable, str(SCRIPT), "--table", str(first), "--rows", *rows],
                         capture_output=True, text=True)
    assert one.returncode == 2 and "not read: reference-b1" in one.stdout
    second.write_text(_reading("reference-b1", [5.0] * 7, gate.OVER) + "\n")
    over = subprocess.run([sys.executable, str(SCRIPT), "--table", str(first), str(second), "--rows", *rows],
                          capture_output=True, text=True)
    assert over.returncode == 1


def test_a_table_of_a_missing_file_or_an_unknown_row_is_refused_by_name(tmp_path):
    missing = subprocess.run([sys.executable, str(SCRIPT), "--table", str(tmp_path / "none.jsonl")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "--table: no such file" in missing.stderr
    odd = tmp_path / "odd.jsonl"
    odd.write_text(_reading("decode-b3", [1.0], gate.WITHIN) + "\n")
    unknown = subprocess.run([sys.executable, str(SCRIPT), "--table", str(odd)], capture_output=True, text=True)
    assert unknown.returncode == 1 and "holds a reading of 'decode-b3', which is no row" in unknown.stderr


def test_a_slow_row_gets_its_minimum_pairs_whatever_the_seconds_and_no_pair_after():
    noisy = iter([-4.0, 6.0, 1.5, 2.5, -1.0])
    row = gate.Row(2.0, "a slow row", lambda smoke: ((lambda i: (100.0, 100.0 + next(noisy))), lambda: None))
    reading = gate.read("slow", row, smoke=True, min_pairs=3, max_pairs=9, seconds=0)
    assert len(reading.costs) == 3 and reading.verdict == gate.UNREADABLE


def test_processes_sharing_a_claim_folder_read_each_row_once(tmp_path):
    claims = tmp_path / "claims"
    assert gate.claim(claims, "reference-b1") and not gate.claim(claims, "reference-b1")
    readings = tmp_path / "gpu1.jsonl"
    other = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--rows", "reference-b1", "reference-b32",
                            "--claim", str(claims), "--json", str(readings)], capture_output=True, text=True)
    assert "reference-b1:" not in other.stdout and "| reference-b32 |" in other.stdout, other.stdout + other.stderr
    assert "not read" not in other.stdout  # a row another process claimed is its to read
    assert [gate.json.loads(line)["name"] for line in readings.read_text().splitlines()] == ["reference-b32"]
    assert sorted(p.name for p in claims.iterdir()) == ["reference-b1", "reference-b32"]


def test_a_pooled_row_decides_on_the_pairs_every_process_appended(tmp_path):
    shared = tmp_path / "prefill.pairs"
    shared.write_text("100.0 100.5\n" * 6)  # another process's six pairs
    row = gate.Row(1.0, "a pooled row", lambda smoke: ((lambda i: (100.0, 100.5)), lambda: None))
    reading = gate.read("pooled", row, smoke=True, min_pairs=7, max_pairs=9, seconds=60, shared=shared)
    assert len(reading.costs) == 1 and reading.verdict == gate.WITHIN  # its one pair made seven
    assert shared.read_text().splitlines()[-1].split() == ["100.0", "100.5"] and len(shared.read_text().split()) == 14
    alone = gate.read("alone", row, smoke=True, min_pairs=7, max_pairs=9, seconds=60)
    assert len(alone.costs) == 7


def test_a_table_pools_the_readings_of_one_row_and_reads_its_verdict_from_all_their_pairs(tmp_path):
    first, second = tmp_path / "gpu0.jsonl", tmp_path / "gpu1.jsonl"
    first.write_text(_reading("prefill-tinyllama-32x16384", [0.4, 0.5, 0.3, 0.6], gate.UNREADABLE) + "\n")
    second.write_text(_reading("prefill-tinyllama-32x16384", [0.5, 0.4, 0.5, 0.4], gate.UNREADABLE) + "\n")
    rows = ["prefill-tinyllama-32x16384"]
    both = subprocess.run([sys.executable, str(SCRIPT), "--table", str(first), str(second), "--rows", *rows],
                          capture_output=True, text=True)
    line = next(line for line in both.stdout.splitlines() if line.startswith("| prefill"))
    assert both.returncode == 0 and line.split("|")[3].strip() == "8" and "| within |" in line, both.stdout
    one = subprocess.run([sys.executable, str(SCRIPT), "--table", str(first), "--rows", *rows],
                         capture_output=True, text=True)
    assert one.returncode == 2 and "| unreadable |" in one.stdout  # four pairs decide nothing


def test_a_prefill_row_runs_once_at_its_full_shape_before_its_first_pair(monkeypatch):
    pytest.importorskip("transformers")
    import bench_transformers  # gate.py put benchmarks/ on the path

    runs = []
    measure = bench_transformers.measure_prefill

    def recorded(engine, batch, prompt, real_data, kernels, run, breakdown=False):
        runs.append((batch, prompt, run))
        return measure(engine, batch, prompt, real_data, kernels, run, breakdown)

    monkeypatch.setattr(bench_transformers, "measure_prefill", recorded)
    pair, close = gate.ROWS["prefill-tinyllama-32x16384"].open(True)
    try:
        assert runs == [(2, 24, -1)]  # unmeasured: no pair has been asked for
        pair(0)
        assert runs == [(2, 24, -1), (2, 24, 0)]
    finally:
        close()
