"""How a run stops: SIGTERM (what a CI timeout sends) is read as Ctrl-C, and while the run is
stopping a second interrupt waits, so the report and the summary of the finished tests still get
written. A third one stops at once.

Installed in the process that writes the results (the xdist controller, or the only process),
from its main thread; the previous handlers come back at the end of the run. An xdist worker gets
the same for SIGINT alone, silent (a terminal's Ctrl-C reaches every process of the run): its
second interrupt does not land in the middle of its own stopping. Whatever frame an interrupt
lands in, its traceback can be shown (`mend_traceback`).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import CodeType, FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
IGNORED_NOTE = ("kv-canary: stopping; the results of the finished tests are being written "
                "(interrupt once more to quit without them)")


class Interrupts:
    """The run's SIGINT / SIGTERM handlers. reason: how the run was stopped ("keyboard
    interrupt", "SIGTERM"), None while it was not."""

    def __init__(self, *, worker: bool = False) -> None:
        """worker: an xdist worker's (SIGINT only; the second is ignored without a note)."""
        self._previous: dict[int, Any] = {}
        self.received = 0
        self.reason: str | None = None
        self._worker = worker

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT,) if self._worker else SIGNALS:
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
            if not self._worker:
                print(IGNORED_NOTE, file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt


def _line_before(code: CodeType, offset: int) -> int:
    """The line of the last instruction at or before `offset` that has one."""
    line = code.co_firstlineno
    for start, _end, lineno in code.co_lines():
        if start > offset:
            break
        if lineno is not None:
            line = lineno
    return line


def mend_traceback(error: BaseException) -> None:
    """Give every traceback entry of `error` and of the exceptions it chains a line number.

    An interrupt taken at an instruction without a line (the jump back of a loop whose body ends
    in an `if`, as in a kernel Triton's interpreter runs) leaves an entry whose tb_lineno is None,
    and pytest's formatting of the traceback then fails before the summary is written. Such an
    entry is replaced by one of the same frame at the line of the nearest instruction before it.
    `error`'s first entry stays as it is (the frame that caught it holds that one)."""
    pending, seen = [error], set()
    while pending:
        exc = pending.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        pending += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            after = tb.tb_next
            if after.tb_lineno is None:
                tb.tb_next = TracebackType(after.tb_next, after.tb_frame, after.tb_lasti,
                                           _line_before(after.tb_frame.f_code, after.tb_lasti))
            tb = tb.tb_next
