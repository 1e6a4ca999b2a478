"""How a run stops: SIGTERM (what a CI timeout sends) is read as Ctrl-C, and while the run is
stopping a second interrupt waits, so the report and the summary of the finished tests still get
written. A third one stops at once.

Installed only in the process that writes the results (the xdist controller, or the only
process), from its main thread; the previous handlers come back at the end of the run.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
IGNORED_NOTE = ("kv-canary: stopping; the results of the finished tests are being written "
                "(interrupt once more to quit without them)")


class Interrupts:
    """The run's SIGINT / SIGTERM handlers. reason: how the run was stopped ("keyboard
    interrupt", "SIGTERM"), None while it was not."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self.received = 0
        self.reason: str | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received == 1:
            self.reason = "keyboard interrupt" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.received == 2:
            print(IGNORED_NOTE, file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt
