"""A terminal section with the detection latencies the fault-injection tests measured (each test
records one line as a user property, so it reaches the controller under xdist too)."""

from __future__ import annotations

import pytest

from perturb_support import LATENCY_PROPERTY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = sorted(value for report in terminalreporter.stats.get("passed", [])
                   for name, value in report.user_properties if name == LATENCY_PROPERTY)
    if lines:
        terminalreporter.section("kv-canary detection latency (forwards from injection to violation)")
        for line in lines:
            terminalreporter.write_line(line)
