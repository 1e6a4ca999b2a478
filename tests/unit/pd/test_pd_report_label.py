"""The results name a pair's transport: an engine line and a test's heading say
`transport=processes` for a cross-process pair and nothing for the default one, and the JSON
report keeps it."""

from __future__ import annotations

from pytest_kvcanary.canary.violation import Violation
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.handles.pool import EngineKey, EnginePool
from pytest_kvcanary.report import ReportEntry, RunResults

STATS = {"forwards": 4, "protected_tokens": 8, "sweeps": 0, "violations": 1, "rows": 1, "dropped": 0}
VIOLATION = Violation("decode", 2, "HEAD", "K", "FULL", ("verify_real_kv_hash",), 3, 2, 0, 1, 2)


def entry(transport: str, nodeid: str) -> ReportEntry:
    """A test on a pair of that transport, described as the plugin describes it (EnginePool),
    with one violation it did not expect, read back from its JSON."""
    pool = EnginePool(lambda key: None, "main")
    key = EngineKey("pd", CanaryConfig(), "reference", "mha", "cpu", 0, transport=transport)
    served_by = pool.describe(key, serial=0 if transport == "local" else 1)
    made = ReportEntry.guarded(nodeid, "passed", served_by, seed=0, perturbs=(), violations=[VIOLATION],
                               requests=[None], injections=[], stats={"prefill": STATS, "decode": STATS},
                               expected=False, read_error=None)
    return ReportEntry.from_json(made.to_json())


def test_the_engine_line_and_the_heading_name_the_transport():
    results = RunResults()
    results.add_test(entry("processes", "t.py::test_far"))
    results.add_test(entry("local", "t.py::test_near"))
    lines = "\n".join(results.summary_lines())
    assert "reference/pd/mha transport=processes on cpu [worker main, 1 test] decode: " in lines
    assert "reference/pd/mha on cpu [worker main, 1 test] decode: " in lines
    assert "t.py::test_far (seed 0, pd/mha transport=processes on cpu):" in lines
    assert "t.py::test_near (seed 0, pd/mha on cpu):" in lines
    assert [e["transport"] for e in results.engines] == ["processes", "local"]
