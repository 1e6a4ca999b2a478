"""A status line for long work, so that progress can be told from a hang (no pytest, no torch).

The caller says what the line reads (`describe`) and calls `tick` as the work advances (cheap:
one clock read); the line appears once the work has run `delay` seconds and is rewritten at most
every `interval` seconds, then `close` writes its final state. On an interactive terminal it is
one line rewritten in place; elsewhere (a log) one line per update, less often.
"""

from __future__ import annotations

import time
from typing import Callable

DELAY_S = 2.0  # work shorter than this shows nothing
INTERACTIVE_INTERVAL_S = 1.0
LOG_INTERVAL_S = 10.0


def _now() -> float:
    return time.monotonic()


class ProgressLine:
    """write: puts text on the terminal as it is (no newline added). describe: the line's text
    now; the seconds since the line was made are appended. interactive: rewrite one line in
    place (a terminal) rather than add lines (a log). clock: seconds, monotonic."""

    def __init__(self, write: Callable[[str], None], describe: Callable[[], str], *, interactive: bool,
                 clock: Callable[[], float] | None = None) -> None:
        self._write = write
        self._describe = describe
        self._interactive = interactive
        self._clock = clock or _now
        self._interval = INTERACTIVE_INTERVAL_S if interactive else LOG_INTERVAL_S
        self._start = self._clock()
        self._due = self._start + DELAY_S
        self._width = 0  # of the line last written in place
        self.shown = False

    def _text(self, now: float) -> str:
        return f"{self._describe()}, {now - self._start:.0f} s"

    def _show(self, text: str, end: str) -> None:
        if not self.shown:
            self._write("\n")  # off whatever line the terminal was writing
            self.shown = True
        if self._interactive:
            self._write(f"\r{text.ljust(self._width)}{end}")
            self._width = len(text)
        else:
            self._write(f"{text}\n")

    def tick(self) -> None:
        """The work advanced: rewrite the line if it is due."""
        now = self._clock()
        if now >= self._due:
            self._due = now + self._interval
            self._show(self._text(now), "")

    def close(self) -> None:
        """The work is done: its final state, once the line was shown."""
        if self.shown:
            self._show(self._text(self._clock()), "\n")


# What makes a line for a piece of work: describe -> the line (see ProgressLine).
ProgressFactory = Callable[[Callable[[], str]], ProgressLine]
