"""LaunchReplay: a fixed sequence of device launches replayed from a CUDA graph when it repeats.

Around an eager forward, the canary's HEAD and TAIL (the runtime) and an adapter's staging of the
canary's view (the transformers adapter) launch the same kernels on the same buffers forward after
forward: the buffers are refilled in place, and the launches' grids and arguments follow from the
buffers' addresses and shapes only. Launching them costs the host tens to hundreds of microseconds
a forward (argument checks, Triton's launcher, torch's dispatch, several launches); a graph replay
costs one launch. A key names every buffer the launches take that their caller does not own (its
address, shape, strides and dtype, ``buffers_key``): the same key means the same launches, so a
graph captured for a key replays them exactly, whatever the buffers hold now. The launches must not
synchronise with the host or depend on what the buffers hold. It holds no canary state (an adapter
uses it beside the seam, for its own launches).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable

import torch

KEPT_GRAPHS = 8  # graphs kept (least recently replayed dropped first)
MAX_CAPTURES = 32  # captures in a replay's life: launches whose buffers keep moving stay eager


def buffers_key(tensors: Iterable[torch.Tensor | None]) -> tuple:
    """What a launch reads of these tensors: address, shape, strides and dtype (None stays None)."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


class LaunchReplay:
    """Runs a launch function for a key: eagerly the first time the key comes, eagerly and then
    captured in a CUDA graph the second time, replayed from that graph after. Disabled: always
    eager (its owner disables it off CUDA); eager while a CUDA graph is being captured (an
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
        # Not torch.cuda.graph: it synchronises the device and collects garbage first, to free
        # memory for the capture. What the launches allocate while captured (temporaries) comes
        # from the graph's own memory pool, which capture_begin makes and the graph keeps.
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
