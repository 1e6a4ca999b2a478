"""GuardedForward: the canary's work around and inside each forward transformers computes.

It replaces the model runner's ``compute_batch``: the host stages only what it alone knows
(staging.py), and the canary runs inside the model's forward, from a forward pre-hook and a forward
hook that act only in the forwards this wrapper runs, on a view derived on the device from the
inputs transformers hands that forward (forward_view.py). With CUDA graphs and canary_graphs off,
that work runs eagerly on the compute stream around each replay instead. docs/transformers.md says
how each part is guarded.
"""

from __future__ import annotations

import dataclasses
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch

from ...canary.launch_replay import LaunchReplay, buffers_key
from ...canary.seam import Capacities, ForwardHooks, ForwardView
from .forward_view import DerivedView, empty_tables, empty_view
from ..patches import Patches
from .staging import BatchStaging
from .versions import (
    BlockManagerLayout, IOPairs, SectorLayout, StoreReport, UnsupportedModel, guard_compute, record_sampled,
    report_cache_stores, waiting_requests,
)


MIN_SPAN = 64  # the shortest token span of the views handed to the canary (token_view)


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """`method` through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


def last_decoder_layer(model: Any) -> torch.nn.Module | None:
    """The last of the model's decoder layers (``get_decoder().layers``), None where the model has
    no such list."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder() if callable(get_decoder) else None, "layers", None)
    return layers[-1] if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


def _sharded() -> bool:
    """Whether this process is one rank of several: a rank's TAIL may run collectives, which must
    not run beside the forward's own."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class GuardedForward:
    """The forwards of one processor under the canary's ``hooks`` (None: they run unguarded).
    ``steps``: forwards since the last reset (the step a canary's violations name); ``tables``: per
    group kind, the lanes' block tables ``[lanes + 1, width]`` (the last row: scratch); ``view``:
    the view HEAD and TAIL get. write_through: hand each layer's computed K/V to
    hooks.kv_stored (eager forwards); canary_graphs: with use_cuda_graph, the canary's device work
    is captured in transformers' CUDA graphs (see TransformersEngine)."""

    def __init__(self, model: Any, processor: Any, io: IOPairs, staging: BatchStaging,
                 layout: SectorLayout | BlockManagerLayout, capacities: Capacities, patches: Patches, *,
                 use_cuda_graph: bool, canary_graphs: bool, write_through: bool) -> None:
        self.device = device = model.device
        self.io, self.staging = io, staging
        self._waiting = partial(waiting_requests, processor)  # transformers' requests not scheduled yet
        buffers, groups = staging.buffers, layout.groups
        self.tables = empty_tables(groups, capacities, buffers.token_table.shape[0], device)
        self.view = empty_view(capacities, buffers.lanes, buffers.token_table)
        self._token_views: dict[int, ForwardView] = {}  # the view's token arrays cut to a span (token_view)
        self._pair_views = [self.view] * len(io.device_ios)  # the view each pair's forward in flight was handed
        self.derived = [DerivedView(d, capacities, buffers.batch, self.view, groups, self.tables,
                                    fused=device.type == "cuda") for d in io.device_ios]
        self.hooks: ForwardHooks | None = None
        self.steps = 0
        self.view_staging = LaunchReplay(device, device.type == "cuda")
        self._stream_events = (torch.cuda.Event(), torch.cuda.Event()) if device.type == "cuda" else ()
        self._canary_graphs = canary_graphs
        self._in_forward = canary_graphs or not use_cuda_graph  # the canary's work inside the model's forward
        self._forward_pair: int | None = None  # the IO pair of the forward the wrapper runs now
        self._head_pair = 0  # the IO pair of the forward whose HEAD ran last
        self._store_targets = {layer: layout.store_target(layer) for g in groups for layer in g.layers}
        # Under canary_graphs (one rank), TAIL forks off the captured forward after its last decoder
        # layer and joins it at the model's end: its nodes run beside the final norm and the LM
        # head instead of after them (_fork_tail).
        self._last_layer = last_decoder_layer(model) if canary_graphs and not _sharded() else None
        self._tail_stream = torch.cuda.Stream(device) if self._last_layer is not None else None
        self._tail_events = (torch.cuda.Event(), torch.cuda.Event()) if self._last_layer is not None else ()
        self._tail_forked = False  # TAIL forked in the capture now running, not yet joined
        if self._in_forward:  # the model outlives the engine: its hooks hold this weakly
            handles = [model.register_forward_pre_hook(_weakly(self._head_in_forward), with_kwargs=True),
                       model.register_forward_hook(_weakly(self._tail_in_forward), with_kwargs=True)]
            if self._last_layer is not None:
                handles.append(self._last_layer.register_forward_hook(_weakly(self._fork_tail)))
            for handle in handles:
                weakref.finalize(self, handle.remove)
                patches.on_uninstall(handle.remove)
        if write_through and not canary_graphs:
            report_cache_stores(patches, processor, self._store_report)
        self._compute = guard_compute(patches, processor, self._guarded_compute)
        record_sampled(patches, processor, _weakly(self._record_sampled))

    def set_hooks(self, hooks: ForwardHooks | None) -> None:
        if self._canary_graphs and hooks is not self.hooks:
            self.io.drop_graphs()  # captured with the old hooks' work inside: capture again
        self.hooks = hooks

    def reset(self) -> None:
        """Every lane's block table zeroed; the step count restarts."""
        for table in self.tables.values():
            table.zero_()
        self.steps = 0

    def _guarded_compute(self, model: Any, batch_data: dict[str, Any]) -> None:
        """The forward with the canary's work around it (see the module docstring), then, as soon
        as the forward is launched, hooks.end_forward and the next forwards' prompts converted."""
        hooks = self.hooks
        if hooks is None:
            self._compute(model, batch_data)
            self.steps += 1
            return
        pair = self.io.pair()
        self.staging.map(self.io.batch_io(), pair, self.steps)
        if self.staging.buffers.has_direct_writes():
            with self._on_compute_stream():
                self.staging.buffers.write_direct()
        if not self._in_forward:
            with self._on_compute_stream():
                self._head(hooks, pair, batch_data)
        self._forward_pair = pair
        try:
            self._compute(model, batch_data)
        finally:  # a fork left unjoined (the forward raised after it) is not the next forward's
            self._forward_pair, self._tail_forked = None, False
        if not self._in_forward:  # after the replay, which sampled too
            with self._on_compute_stream():
                self._tail(hooks, pair)
                self._put_sampled(pair, batch_data, self.io.device_ios[pair].output_ids)
        hooks.end_forward(self._on_compute_stream)
        self.staging.ahead(self._waiting())  # while the device computes the forward
        self.steps += 1

    @torch.compiler.disable
    def _head_in_forward(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """The model's forward pre-hook: HEAD inside the forward, on its stream (captured with it);
        a forward the wrapper does not run (a test's own model call) is left alone."""
        pair, hooks = self._forward_pair, self.hooks
        if pair is None or hooks is None:
            return
        consumed = kwargs.get("input_ids")
        if consumed is None or consumed.data_ptr() != self.derived[pair].input_ids.data_ptr():
            raise UnsupportedModel("the model's forward does not embed the input ids transformers staged for "
                                   "it; the canary's view would not be what the forward consumed")
        self._head(hooks, pair, kwargs)

    @torch.compiler.disable
    def _tail_in_forward(self, model: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """The model's forward hook: RECHECK and TAIL inside the forward, or, where they were forked
        after the last decoder layer (``_fork_tail``), the forward joined with them."""
        if self._tail_forked:
            self._tail_forked = False
            torch.cuda.current_stream().wait_event(self._tail_events[1])
            return
        pair, hooks = self._forward_pair, self.hooks
        if pair is not None and hooks is not None:
            self._tail(hooks, pair)

    @torch.compiler.disable
    def _fork_tail(self, layer: Any, args: tuple, output: Any) -> None:
        """The last decoder layer's forward hook, in a forward being captured: RECHECK and TAIL on
        a stream forked from the forward's (every KV read and write of the forward is done; what
        is left reads no KV), joined again by the model's forward hook. Outside a capture (eager
        forwards, the warm-up before one) TAIL stays in the model's forward hook."""
        pair, hooks = self._forward_pair, self.hooks
        if pair is None or hooks is None or not torch.cuda.is_current_stream_capturing():
            return
        fork, join = self._tail_events
        side = self._tail_stream
        fork.record(torch.cuda.current_stream())
        side.wait_event(fork)
        with torch.cuda.stream(side):
            self._tail(hooks, pair)
        join.record(side)
        self._tail_forked = True

    @torch.compiler.disable
    def _record_sampled(self, batch_data: dict[str, Any], output_ids: torch.Tensor) -> None:
        """Right after transformers sampled a forward's tokens, inside the forward (captured with it)
        when the canary's work is."""
        pair, hooks = self._forward_pair, self.hooks
        if pair is not None and hooks is not None and self._in_forward:
            self._put_sampled(pair, batch_data, output_ids)

    def _put_sampled(self, pair: int, batch_data: dict[str, Any], output_ids: torch.Tensor) -> None:
        """The forward's sampled tokens (output_ids row 0, in the order of its logits_indices) into
        the token table, each at the position its request decodes next (device work)."""
        self.derived[pair].put_sampled(batch_data["logits_indices"], output_ids[0], self.staging.buffers)

    def _head(self, hooks: ForwardHooks, pair: int, inputs: dict[str, Any]) -> None:
        """What the host staged for this forward onto the device, the view's lengths and block
        tables from the buffers and indices the forward consumes (`inputs`: its keyword
        arguments) and its inputs as they are now (what a forward observer sees), then HEAD
        (device work)."""
        if inputs.get("block_table") is not None:
            raise UnsupportedModel("transformers runs this batch on its block-table decode path (flash attention "
                                   "with a KV cache); the canary reads the read and write indices of the SDPA path")
        reads, writes = inputs["read_index"], inputs["write_index"]
        view = self._pair_views[pair] = self.token_view(inputs["input_ids"].shape[-1])
        self.view_staging.run((pair, view.input_ids.shape[0], buffers_key([*reads, *writes])),
                              lambda: self._stage_view(pair, view, reads, writes))
        self._head_pair = pair
        hooks.before_forward(view)

    def token_view(self, tokens: int) -> ForwardView:
        """The view with its token arrays cut to the first span of MIN_SPAN * 4^k tokens that holds a
        forward of `tokens` (capped at max_tokens; the same object for the same span): the canary's
        launches for a decode step span its padded tokens, not the buffers' capacity, and a few
        spans keep their replays few."""
        capacity, span = self.view.input_ids.shape[0], MIN_SPAN
        while span < tokens:
            span *= 4
        span = min(span, capacity)
        view = self._token_views.get(span)
        if view is None:
            view = self._token_views[span] = dataclasses.replace(
                self.view, input_ids=self.view.input_ids[:span], positions=self.view.positions[:span])
        return view

    def _stage_view(self, pair: int, view: ForwardView, read_index: Sequence[torch.Tensor],
                    write_index: Sequence[torch.Tensor]) -> None:
        """The staged buffer uploaded and its token entries applied, the view derived and its inputs
        copied into `view` (device work only, the same launches for the same pair, span and index
        buffers: an eager forward's are replayed from a CUDA graph once they repeat, launch_replay.py)."""
        self.staging.buffers.upload()
        self.staging.buffers.apply_tokens()
        derived = self.derived[pair]
        derived.derive(read_index, write_index)
        derived.copy_inputs(view)

    def feed_token(self, view: Any, index: int, token: int) -> None:
        """`token` at view token `index` of the forward about to run (TransformersEngine.feed_token)."""
        self.derived[self._head_pair].input_ids[index] = token
        view.input_ids[index] = token

    def _tail(self, hooks: ForwardHooks, pair: int) -> None:
        """The inputs as the forward left them into the view, then RECHECK and TAIL (device work)."""
        view = self._pair_views[pair]
        self.derived[pair].copy_inputs(view)
        hooks.after_forward(view)

    def _store_report(self) -> StoreReport | None:
        """Where the paged cache's update hands a layer's computed K/V rows ([T, H, D], view token
        order): hooks.kv_stored, before the cache stores them; nowhere while a CUDA graph is being
        captured (a replay never calls back, so a captured report would hand TAIL rows that were
        never computed)."""
        report = getattr(self.hooks, "kv_stored", None)  # optional in ForwardHooks
        if report is None or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        targets = self._store_targets
        return lambda layer, k, v: report(*targets[layer], k, v)

    @contextmanager
    def _on_compute_stream(self) -> Iterator[None]:
        """The canary's device work on the stream transformers computes on (CUDA), ordered both
        ways with the host's stream: after the input writes transformers enqueued there for this
        forward, and before its next batch's reset and writes of the same buffers (the canary
        reads transformers' input buffers; without the second wait the next reset could zero them
        before TAIL copies them)."""
        stream = self.io.compute_stream()
        if stream is None:
            yield
            return
        host = torch.cuda.current_stream()
        host_done, canary_done = self._stream_events  # reused: a wait is on the record made just before it
        host_done.record(host)
        stream.wait_event(host_done)
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(host)
            canary_done.record(stream)
            host.wait_event(canary_done)
