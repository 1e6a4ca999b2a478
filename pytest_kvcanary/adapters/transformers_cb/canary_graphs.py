"""The canary's per-forward device work captured in two CUDA graphs of its own (HEAD; RECHECK and
TAIL), replayed around transformers' own graph replay, so a decode step pays two graph launches
for the canary instead of a Python launch per kernel.

The graphs read the engine's persistent upload buffers and transformers' static input buffers,
which are refilled in place before each forward; the view is derived from them inside the graphs
(`head_prelude`, `tail_prelude`). The first forward under a set of hooks runs them eagerly (Triton
compiles, buffers are allocated); the second captures both graphs, and every forward replays.
Forward observers (the fault injector) are not called on replay; write-through is off (the
forward's own KV store runs inside transformers' graph).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...canary.seam import ForwardHooks, ForwardView


class CanaryGraphs:
    """HEAD (after `head_prelude`) and RECHECK+TAIL (after `tail_prelude`) of one hooks object over
    one view, eager once, then captured; the preludes are the engine's own device work on the view."""

    def __init__(self, hooks: ForwardHooks, view: ForwardView, head_prelude: Callable[[], None],
                 tail_prelude: Callable[[], None]) -> None:
        self.hooks, self.view = hooks, view
        self.head_prelude, self.tail_prelude = head_prelude, tail_prelude
        self.eager_runs = 0
        self.head: torch.cuda.CUDAGraph | None = None
        self.tail: torch.cuda.CUDAGraph | None = None

    def before(self) -> None:
        if self.eager_runs == 0:
            self._head()
            return
        if self.head is None:
            self.head = self._capture(self._head)
        self.head.replay()

    def _head(self) -> None:
        self.head_prelude()
        self.hooks.before_forward(self.view)

    def _tail(self) -> None:
        self.tail_prelude()
        self.hooks.after_forward(self.view)

    def after(self) -> None:
        if self.eager_runs == 0:
            self._tail()
            self.eager_runs = 1
            return
        if self.tail is None:
            self.tail = self._capture(self._tail)
        self.tail.replay()

    @staticmethod
    def _capture(work: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Capture `work` (capturing executes nothing; torch synchronises the device first)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
        return graph
