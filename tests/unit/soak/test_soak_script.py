"""benchmarks/soak.py's table adds runs up: rows of one configuration (a row per seed, as --json
writes them, or a run's row as earlier runs wrote it) become one row whose counts are the sums, and
a seed counted twice is a usage error naming it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).parents[3] / "benchmarks" / "soak.py"
spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
soak_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak_script)


def row(config: str, seeds: list[int], forwards: int, device: str = "cpu", **verdicts: int) -> dict:
    counts = dict.fromkeys(soak_script.VERDICTS, 0)
    counts.update({k.replace("_", " "): v for k, v in verdicts.items()})
    return {"config": config, "device": device, "real_data": "partial", "seeds": seeds, "rounds": sum(counts.values()),
            "forwards": forwards, "near_ties": 1, "verdicts": counts, "failures": [], "seconds": 10.0,
            "versions": {"torch": "2.13.0"}}


def test_rows_of_one_configuration_add_up_and_others_stay_apart():
    merged = soak_script.merge([row("a", [0, 1, 2], 300, clean=3), row("b", [0], 50, clean=1),
                                row("a", [1000], 120, device="gpu", clean=1, engine_defect=1),
                                {"config": "c", "skipped": "needs CUDA"}])
    assert [m["config"] for m in merged] == ["a", "b", "c"]
    a = merged[0]
    assert (a["seeds"], a["forwards"], a["rounds"], a["near_ties"], a["seconds"]) == ([0, 1, 2, 1000], 420, 5, 2, 20.0)
    assert a["verdicts"]["clean"] == 4 and a["verdicts"]["engine defect"] == 1 and a["device"] == "cpu + gpu"
    assert soak_script.seed_ranges(a["seeds"]) == "0..2, 1000"


def test_a_seed_counted_twice_is_a_usage_error(tmp_path):
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in (row("a", [0, 1], 10), row("a", [1, 2], 10))))
    done = subprocess.run([sys.executable, str(SCRIPT), "--table", str(runs)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--table: a: seed 1 appears in two rows" in done.stderr
