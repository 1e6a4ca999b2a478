"""The progress line of long generations: shown only past a delay, rate-limited, in place on a
terminal and as lines in a log, and from a run only where someone can see it."""

from __future__ import annotations

import pytest
import torch  # noqa: F401  (loaded once here: pytester's inline runs drop the modules they import first)

from pytest_kvcanary.plugin_support import progress
from pytest_kvcanary.plugin_support.progress import ProgressLine


class Clock:
    """Seconds that advance only when told (or by `step` at every read)."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _line(interactive: bool, clock: Clock) -> tuple[ProgressLine, list[str], list[int]]:
    written: list[str] = []
    done = [0]
    line = ProgressLine(written.append, lambda: f"{done[0]} done", interactive=interactive, clock=clock)
    return line, written, done


def test_short_work_shows_nothing() -> None:
    clock = Clock()
    line, written, _ = _line(True, clock)
    for _ in range(100):
        clock.now += 0.01
        line.tick()
    line.close()
    assert written == []


def test_a_terminal_line_is_rewritten_in_place_at_most_once_a_second() -> None:
    clock = Clock()
    line, written, done = _line(True, clock)
    for _ in range(40):  # 4 s of ticks, 0.1 s apart
        clock.now += 0.1
        done[0] += 1
        line.tick()
    line.close()
    assert written[0] == "\n"
    assert written[1:] == ["\r20 done, 2 s", "\r30 done, 3 s", "\r40 done, 4 s", "\r40 done, 4 s\n"]


def test_a_shorter_text_clears_the_longer_one_it_replaces() -> None:
    clock = Clock()
    written: list[str] = []
    texts = iter(["a long text", "short"])
    line = ProgressLine(written.append, lambda: next(texts), interactive=True, clock=clock)
    clock.now = 5
    line.tick()
    clock.now = 5  # the final state, at the same second
    line.close()
    assert written[1:] == ["\ra long text, 5 s", "\rshort, 5 s      \n"]


def test_a_log_gets_a_line_every_ten_seconds() -> None:
    clock = Clock()
    line, written, done = _line(False, clock)
    for _ in range(25):
        clock.now += 1
        done[0] += 1
        line.tick()
    line.close()
    assert written == ["\n", "2 done, 2 s\n", "12 done, 12 s\n", "22 done, 22 s\n", "25 done, 25 s\n"]


LONG_GENERATION = """
def test_long(kv_engine):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=2)
"""


def test_a_run_without_capture_shows_the_line_of_a_long_generation(realtester: pytest.Pytester,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every clock read moves 5 s on, so each forward is due: the line counts the requests the
    engine finished of those sent and the forwards, then ends with the final state."""
    monkeypatch.setattr(progress, "_now", Clock(step=5.0))
    realtester.makepyfile(test_generation=LONG_GENERATION)
    result = realtester.runpytest("--kv-canary", "-s")
    result.assert_outcomes(passed=1)
    lines = [line for line in result.errlines if line.startswith("kv-canary test_generation.py::test_long: ")]
    assert lines[0] == "kv-canary test_generation.py::test_long: 0/3 requests finished, 1 forward, 5 s"
    assert lines[-1] == "kv-canary test_generation.py::test_long: 3/3 requests finished, 2 forwards, 15 s"


def test_a_captured_run_shows_no_line(realtester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "_now", Clock(step=5.0))
    realtester.makepyfile(test_generation=LONG_GENERATION)
    result = realtester.runpytest("--kv-canary", "-rA")
    result.assert_outcomes(passed=1)
    assert "requests finished" not in result.stdout.str() + result.stderr.str()
