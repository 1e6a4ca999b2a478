"""LaunchReplay: the canary's per-forward launches replayed from a CUDA graph when they repeat.

An eager forward's HEAD and TAIL launch the same kernels on the same buffers forward after forward:
an engine refills its view and mapping in place, and the kernels' grids and arguments follow from
the buffers' addresses and shapes only (kvcanary_kernels.launch). Launching them costs the host
hundreds of microseconds a forward (argument checks and Triton's launcher, several launches); a
graph replay costs one launch. A key names every buffer the launches take that the runtime does not
own (its address, shape, strides and dtype): the same key means the same launches, so a graph
captured for a key replays them exactly, whatever the buffers hold now.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable

import torch

from .seam import ForwardView

KEPT_GRAPHS = 8  # graphs kept (least recently replayed dropped first)
MAX_CAPTURES = 32  # captures in a runtime's life: an engine whose buffers keep moving stays eager


def buffers_key(tensors: Iterable[torch.Tensor | None]) -> tuple:
    """What a launch reads of these tensors: address, shape, strides and dtype (None stays None)."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


def view_tensors(view: ForwardView) -> list[torch.Tensor | None]:
    """Every tensor of a view, its groups' inputs included, in a fixed order."""
    tensors = [view.rows, view.prefix_lens, view.extend_lens, view.input_ids, view.positions,
               view.token_table, view.context_keys]
    for kind in sorted(view.group_inputs or ()):
        tensors.extend(view.group_inputs[kind])
    return tensors


class LaunchReplay:
    """Runs a launch function for a key: eagerly the first time the key comes, eagerly and then
    captured in a CUDA graph the second time, replayed from that graph after. Disabled (always
    eager) off CUDA or with the torch kernels; eager while a CUDA graph is being captured (an
    engine's own graph then holds the launches)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        self.captures = self.replays = 0
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._graphs: OrderedDict[Hashable, torch.cuda.CUDAGraph] = OrderedDict()
        self._stream: torch.cuda.Stream | None = None

    def run(self, key: Hashable, launch: Callable[[], None]) -> None:
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            launch()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()
            self.replays += 1
            return
        launch()
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > 4 * KEPT_GRAPHS:
                self._seen.popitem(last=False)
        elif self.captures < MAX_CAPTURES:
            self._capture(key, launch)

    def _capture(self, key: Hashable, launch: Callable[[], None]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        # Not torch.cuda.graph: it synchronises the device and collects garbage first, for
        # allocations inside the capture; these launches allocate nothing.
        with torch.cuda.stream(self._stream):
            graph.capture_begin(capture_error_mode="thread_local")  # records; runs nothing
            try:
                launch()
            finally:
                graph.capture_end()
        self.captures += 1
        self._graphs[key] = graph
        if len(self._graphs) > KEPT_GRAPHS:
            self._graphs.popitem(last=False)
