"""benchmarks/soak.py's table adds runs up: rows of one configuration (a row per seed, as --json
writes them, or a run's row as earlier runs wrote it) become one row whose counts are the sums, and
a seed counted twice is a usage error naming it. Its liveness gate fails a configuration whose
workloads did not move a counter it requires."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch


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


def test_a_configuration_whose_cache_path_is_switched_off_fails_its_liveness_gate(monkeypatch, capsys):
    """The reference engine's radix cache made to match nothing (a prefix cache switched off): the
    configuration that must reuse cached prefixes fails, naming the counter; the script exits 1."""
    from pytest_kvcanary.reference_engine.radix_cache import MatchResult, RadixCache

    def build():
        return soak_script._reference("mha")

    config = soak_script.Config(build, None, ("prefix hits",))
    monkeypatch.setattr(soak_script, "configurations", lambda: {"probe": config})
    monkeypatch.setattr(sys, "argv", ["soak.py", "--configs", "probe", "--forwards", "100", "--rounds", "2"])
    assert soak_script.main() == 0  # the cache on: prefix hits counted
    assert "FAILED" not in capsys.readouterr().out

    monkeypatch.setattr(RadixCache, "match_prefix", lambda self, key, context=0: MatchResult(
        torch.empty(0, dtype=torch.int64), self.root(context)))
    assert soak_script.main() == 1
    out, err = capsys.readouterr()
    assert "| FAILED: no prefix hits |" in out and "liveness gate: probe (no prefix hits)" in err


def test_the_liveness_column_lists_the_counts_and_older_rows_read_as_before():
    counted = {**row("a", [0], 100, clean=1), "liveness": {"prefix hits": 3, "host loads": 0, "retractions": 2},
               "requires": ["prefix hits"]}
    assert soak_script.liveness(counted) == "3 prefix hits, 2 retractions"
    assert soak_script.liveness({**counted, "requires": ["prefix hits", "host loads"]}) == "FAILED: no host loads"
    assert soak_script.liveness({**row("h", [0], 10), "state_restores": 0}) == "FAILED: no checkpoint restored"
    assert soak_script.liveness({**row("h", [0], 10), "state_restores": 5}) == "5 checkpoint restores"
    assert soak_script.liveness(row("t", [0], 10)) == "-"
    merged = soak_script.merge([{**counted, "seeds": [0]}, {**counted, "seeds": [1]}])[0]
    assert merged["liveness"] == {"prefix hits": 6, "host loads": 0, "retractions": 4}
