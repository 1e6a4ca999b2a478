"""TransformersEngine: Hugging Face transformers continuous batching behind the canary seam (an
EngineUnderTest).

It drives a ``ContinuousBatchProcessor`` in the calling thread (prepare_next_batch ->
_generation_step -> update_batch, in transformers' own order under async batching) and wraps the
model runner's ``compute_batch``: the host stages only what it alone knows (batch_buffers.py),
and the canary runs inside the model's forward, from a forward pre-hook and a forward hook that
act only in the forwards this engine drives, on a view derived on the device from the inputs
transformers hands that forward (forward_view.py). A request holds a lane (a row of the canary's
tables) until the lane is handed to another. docs/transformers.md says how each part is guarded:
lanes, token-table entries, write-through, the block log, CUDA graphs and async batching.
"""

from __future__ import annotations

import gc
import inspect
import operator
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from kvcanary_kernels.checks import check_int
from kvcanary_kernels.records import UNKNOWN, GroupKind

from ...canary.launch_replay import LaunchReplay, buffers_key
from ...canary.seam import (Arrival, CacheWalk, Capacities, EngineDefect, ForwardHooks, FreeListener, PagedWalk,
                            PoolGroup, RowOwners, SlotMapping, TokenScores)
from .batch_buffers import BatchBuffers
from .block_log import BlockLog
from .forward_view import DerivedView, empty_tables, empty_view
from .offload import CpuOffloadTier
from .versions import (
    CAUSE_RESET, DEFECT_CACHED_BLOCK_REWRITE, DEFECT_SHARED_DECODE_BLOCK, GroupCache, SectorLayout, UnsupportedModel,
    cache_layout, config_options, sdpa_attention,
)


_NO_ENTRIES: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
_STATE = operator.attrgetter("state")  # a FutureRequestState's RequestState


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """`method` through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


class TransformersEngine:
    """A transformers model under continuous batching, guarded through the CanaryHost seam.

    page_size: tokens per KV block; num_blocks: cache capacity in blocks (the prefix cache evicts
    and transformers offloads requests when it runs short); max_batch_tokens /
    max_requests_per_batch: the largest forward; max_context: the longest request (prompt plus
    new tokens); allow_block_sharing: prefix sharing and block de-duplication (full-attention
    models only); use_cuda_graph: capture the forward in CUDA graphs (CUDA only);
    use_async_batching: transformers' asynchronous batching (two IO pairs, the next batch prepared
    while the device computes this one; CUDA only); write_through:
    hand each layer's computed K/V to the canary at the cache's update (eager forwards);
    canary_graphs: with use_cuda_graph, the canary's per-forward device work is captured in
    transformers' own CUDA graphs (forward observers such as the fault injector are then not
    called on replay, so fault-injection tests leave it off); without it that work runs eagerly
    around each replay. cpu_offload_space: GiB of transformers' CPU swap pool (5.18+; transformers
    pins it, which needs CUDA): an offloaded request's blocks are copied there and back instead of
    being recomputed, guarded as a host tier (offload.py); 0 (the default): offloaded requests are
    recomputed.

    Attributes for tools that reach inside: ``model``, ``tokenizer``, ``manager`` (the
    ContinuousBatchingManager), ``processor`` (its ContinuousBatchProcessor; ``processor.cache``
    is the PagedAttentionCache), ``layout`` (versions.py), ``block_log``, ``host_tier`` (the CPU
    swap pool as the seam's HostTier, or None).
    """

    def __init__(self, model: Any, tokenizer: Any, *, page_size: int = 16, num_blocks: int = 256,
                 max_batch_tokens: int = 256, max_requests_per_batch: int = 8, max_context: int = 512,
                 allow_block_sharing: bool = True, use_cuda_graph: bool = False, use_async_batching: bool = False,
                 write_through: bool = True, canary_graphs: bool = False, cpu_offload_space: float = 0.0) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        for option, on in (("use_cuda_graph", use_cuda_graph), ("use_async_batching", use_async_batching)):
            if on and self.device.type != "cuda":
                raise ValueError(f"{option}=True needs a CUDA device; the model is on {self.device}")
        if canary_graphs and not use_cuda_graph:
            raise ValueError("canary_graphs=True needs use_cuda_graph=True")
        if isinstance(cpu_offload_space, bool) or not isinstance(cpu_offload_space, (int, float)) \
                or not cpu_offload_space >= 0:
            raise ValueError(f"cpu_offload_space must be a number of GiB >= 0; got {cpu_offload_space!r}")
        self.eos_token_id = model.config.eos_token_id if model.config.eos_token_id is not None else -1
        model.set_attn_implementation(sdpa_attention())
        generation = GenerationConfig(do_sample=False, eos_token_id=self.eos_token_id,
                                      pad_token_id=model.config.pad_token_id)
        config = ContinuousBatchingConfig(**config_options(
            page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests_per_batch, allow_block_sharing=allow_block_sharing,
            use_cuda_graph=use_cuda_graph, use_async_batching=use_async_batching, cpu_offload_space=cpu_offload_space))
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        self.manager.warmup()  # creates the processor; captures CUDA graphs when they are on
        self.processor = self.manager.batch_processor
        self.layout = cache_layout(self.processor)
        self.groups: list[GroupCache] = self.layout.groups
        self.page_size = page_size
        self.block_log = BlockLog(page_size, self.groups[0].num_slots)
        self._free_listeners: list[FreeListener] = []
        self._held_frees: list[tuple[GroupKind, list[int], str]] | None = None  # announced after an offload
        self.layout.install(self._on_free, self._on_marked)
        self.host_tier = self._cpu_offload() if cpu_offload_space else None

        resolved = self.manager.continuous_batching_config
        self.capacities = Capacities(
            max_batch=resolved.max_requests_per_batch, max_tokens=self.processor.cache.max_batch_tokens,
            max_context=min(max_context, model.config.max_position_embeddings))
        io = self.processor.inputs_and_outputs
        self._io_pairs: list[Any] = list(io.io_pairs) if use_async_batching else []
        device_ios = [pair.device_io for pair in self._io_pairs] or [io]
        lanes = 2 * self.capacities.max_batch
        self._buffers = BatchBuffers(self.capacities, lanes, self.device, len(device_ios))
        self._tables = empty_tables(self.groups, self.capacities, lanes, self.device)
        self._view = empty_view(self.capacities, self._buffers.lanes, self._buffers.token_table)
        self._device_ios = device_ios
        self._derived = [DerivedView(d, self.capacities, self._buffers.batch, self._view, self.groups, self._tables)
                         for d in device_ios]
        self._clear_lanes()

        self._hooks: ForwardHooks | None = None
        self._view_staging = LaunchReplay(self.device, self.device.type == "cuda")
        self._stream_events = (torch.cuda.Event(), torch.cuda.Event()) if self.device.type == "cuda" else ()
        self._canary_graphs = canary_graphs
        self._use_cuda_graph = use_cuda_graph
        self._in_forward = canary_graphs or not use_cuda_graph  # the canary's work inside the model's forward
        self._forward_pair: int | None = None  # the IO pair of the forward the wrapper runs now
        self._in_flight = False  # async batching: a launched batch is not updated yet
        self._head_pair = 0  # the IO pair of the forward whose HEAD ran last
        if self._in_forward:  # the model outlives the engine: its hooks hold the engine weakly
            for handle in (model.register_forward_pre_hook(_weakly(self._head_in_forward), with_kwargs=True),
                           model.register_forward_hook(_weakly(self._tail_in_forward), with_kwargs=True)):
                weakref.finalize(self, handle.remove)
        if write_through and not canary_graphs:
            self._wrap_cache_update()
        runner = self.processor.model_runner
        self._compute = runner.compute_batch
        runner.compute_batch = self._guarded_compute
        sample, record = runner._forward_process_and_sample, _weakly(self._record_sampled)

        def sample_and_record(model: Any, batch_data: dict[str, Any], *ids: torch.Tensor) -> None:
            sample(model, batch_data, *ids)
            record(batch_data, ids[-1])  # (carry_over_ids, prev_output_ids, output_ids)

        runner._forward_process_and_sample = sample_and_record  # what compute_batch runs or captures
        self._next_request = 0
        self._steps = 0  # forwards since the last reset: the step a canary's violations name
        self._row_owners: RowOwners[str] = RowOwners()  # request ids
        self._prompts: dict[str, str] = {}
        self._defects: list[EngineDefect] = []  # the engine's own defects seen since the last reset
        self._hashed_writers: set[str] = set()  # requests that may write a hashed block (5.17)

    # ----------------------------------------------------------------------------- CanaryHost
    def canary_groups(self) -> Sequence[PoolGroup]:
        return [PoolGroup(g.kind, g.k_layers, g.v_layers, g.num_slots,
                          SlotMapping(self._tables[g.kind][:-1], page_size=g.page_size, ring=g.ring),
                          page_size=g.page_size, window=g.window, fingerprintable=g.fingerprintable)
                for g in self.groups]

    def canary_capacities(self) -> Capacities:
        return self.capacities

    def cache_walk(self) -> PagedWalk | CacheWalk | None:
        """The hashed FULL blocks transformers keeps for prefix sharing (None when the model has
        no prefix sharing: hybrid models, or allow_block_sharing=False)."""
        if not self.processor.cache.use_prefix_sharing:
            return None
        return self.block_log.walk(*self.layout.hashed_blocks())

    def add_free_listener(self, listener: FreeListener) -> None:
        """listener(group, slots of that group, cause) before any block goes back to the free
        pool: every slot of the block."""
        self._free_listeners.append(listener)

    # ------------------------------------------------------------------------ EngineUnderTest
    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        if self._canary_graphs and hooks is not self._hooks:
            for io in self._device_ios:  # captured with the old hooks' work inside: capture again
                io.graphs = type(io.graphs)()
        self._hooks = hooks

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy output token ids per prompt, in order; runs until every request is done. If a
        forward raises (a hook, say), every request is dropped and the error propagates."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of prompts (str or token ids), not one bare string")
        check_int("max_new_tokens", max_new_tokens, 1)
        encoded = [self.encode_request(p, max_new_tokens) for p in prompts]
        request_ids = [self._submit(prompt, ids, max_new_tokens) for prompt, ids in zip(prompts, encoded)]
        outputs = self._run(request_ids)
        return [outputs[r] for r in request_ids]

    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """Greedy output ids per arrival: each added once this call ran `at_forward` forwards (at
        once when nothing is left to run), cancelled `abort_after` forwards after that (keeping the
        tokens transformers had handed over); runs until every request is done or cancelled."""
        encoded = [self.encode_request(list(a.prompt), a.max_new_tokens) for a in arrivals]
        order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_forward)
        request_ids: list[str] = [""] * len(arrivals)
        aborts: list[tuple[int, str]] = []  # (the forward to cancel at, the request)
        cancelled: dict[str, list[int]] = {}
        idle = 0  # forwards skipped while nothing ran

        def feed(forwards: int, nothing_to_run: bool) -> bool:
            nonlocal idle
            now = forwards + idle
            if nothing_to_run and order and arrivals[order[0]].at_forward > now:
                idle, now = idle + arrivals[order[0]].at_forward - now, arrivals[order[0]].at_forward
            while order and arrivals[order[0]].at_forward <= now:
                i = order.pop(0)
                request_ids[i] = self._submit(arrivals[i].prompt, encoded[i], arrivals[i].max_new_tokens)
                if arrivals[i].abort_after is not None:
                    aborts.append((now + arrivals[i].abort_after, request_ids[i]))
            scheduler = self.processor.scheduler
            due = [x for x in aborts if x[0] <= now]
            if due:
                # transformers frees a cancelled request's blocks at once, also while a forward that
                # writes them is in flight (async batching), whose update then fails: cancel
                # between batches only.
                self._drain_async()
            for at, request_id in due:
                aborts.remove((at, request_id))
                state = scheduler.active_requests.get(request_id) or scheduler.waiting_requests.get(request_id)
                if state is not None:  # not finished yet
                    cancelled[request_id] = list(state.generated_tokens)
                    self.manager.cancel_request(request_id)
            return bool(order)

        outputs = self._run([], feed)
        outputs.update(cancelled)
        if missing := [r for r in request_ids if r not in outputs]:
            raise RuntimeError(f"transformers stopped scheduling with {len(missing)} request(s) unfinished: {missing[:4]}")
        return [outputs[r] for r in request_ids]

    @torch.no_grad()
    def score_uncached(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TokenScores]:
        """What greedy decoding picks after each prefix of each (prompt, output): one forward of the
        model over prompt + output without any cache per request (its SDPA path outside continuous
        batching; the paged cache is not touched)."""
        scores = []
        with self._plain_attention():
            for prompt, output in requests:
                if not output:
                    scores.append(TokenScores([], [], []))
                    continue
                ids = torch.tensor([[*prompt, *output[:-1]]], dtype=torch.int64, device=self.device)
                logits = self.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:]
                top = logits.float().topk(2, dim=-1)
                best, runner_up = top.indices.T.tolist()
                scores.append(TokenScores(best, runner_up, (top.values[:, 0] - top.values[:, 1]).tolist()))
        return scores

    @contextmanager
    def _plain_attention(self) -> Iterator[None]:
        """The model on plain SDPA for a forward outside continuous batching (5.17 names its
        continuous-batching attention apart)."""
        implementation = sdpa_attention()
        if implementation == "sdpa":
            yield
            return
        self.model.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            self.model.set_attn_implementation(implementation)

    def _submit(self, prompt: str | Sequence[int], ids: list[int], max_new_tokens: int) -> str:
        request_id = f"kvcanary-{self._next_request}"
        self._next_request += 1
        self._prompts[request_id] = prompt if isinstance(prompt, str) else repr(list(prompt))
        self.manager.add_request(ids, request_id=request_id, max_new_tokens=max_new_tokens,
                                 eos_token_id=self.eos_token_id)
        return request_id

    def _run(self, request_ids: list[str], feed: Callable[[int, bool], bool] | None = None) -> dict[str, list[int]]:
        """Run every batch until no request is left (feed: see _run_batches); the outputs by
        request id. Raises RuntimeError when one of request_ids got none."""
        if self._use_cuda_graph:
            # A canary dropped earlier (a finished test's, with its engine) is cyclic garbage holding
            # CUDA graphs (its sweep's): released by a collection that happens to run while
            # transformers computes a forward in its graph pool (before capturing it), their pools
            # abort the process. Freed here, as PyTorch collects before a capture.
            gc.collect()
        try:
            self._run_batches(feed)
        except BaseException:
            self._drop_requests()
            raise
        outputs = self._collect()
        missing = [r for r in request_ids if r not in outputs]
        if missing:
            self._drop_requests()
            raise RuntimeError(f"transformers stopped scheduling with {len(missing)} request(s) unfinished "
                               f"(num_blocks too small for one request?): {missing[:4]}")
        return outputs

    def reset(self) -> None:
        """Drop every request and flush the prefix cache: blocks are handed out in a new cache's
        order again (the step count restarts)."""
        with self.layout.causes.cause(CAUSE_RESET):
            self._drop_requests()
            self.processor.reset()
            self.layout.flush()
        self.block_log.clear()
        self._buffers.reset()
        for table in self._tables.values():
            table.zero_()
        self._clear_lanes()
        self._steps = 0
        self._row_owners.clear()
        self._prompts.clear()
        self._defects.clear()
        self._hashed_writers.clear()

    def request_at(self, row: int, step: int) -> tuple[str, str] | None:
        """The request (id, prompt text) that held lane `row` at forward `step` since the last
        reset; None when none did."""
        owner = self._row_owners.at(row, step)
        return None if owner is None else (owner, self._prompts.get(owner, ""))

    # ------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def _run_batches(self, feed: Callable[[int, bool], bool] | None = None) -> None:
        """Every batch until no request is left, as transformers' generation loop runs them (the
        engine's wrappers run inside it, without autograd); under async batching each update is of
        the batch before the one just launched. feed(forwards launched, nothing to run), when
        given, is called before each batch is prepared to add and cancel requests; it returns
        whether requests are still to come (the loop then waits for none: with nothing to run it
        calls feed again, which adds the next ones)."""
        processor, launched = self.processor, 0
        self._in_flight = False
        coming = feed(0, False) if feed is not None else False
        while True:
            if processor.prepare_next_batch():
                processor._generation_step(self.model)
                launched += 1
                if self._in_flight or not self._io_pairs:
                    processor.update_batch()  # async: the batch before the one just launched
                self._in_flight = bool(self._io_pairs)
            elif self._in_flight:
                self._drain_async()
            elif coming:
                coming = feed(launched, True)
                continue
            else:
                return
            if feed is not None:
                coming = feed(launched, False)

    def _drain_async(self) -> None:
        """Async batching: update the batch still in flight (the last one launched, on the other IO
        pair), so no batch is in flight; the next one launched has nothing to update before it."""
        if not self._in_flight:
            return
        io = self.processor.inputs_and_outputs
        io.current_pair = 1 - io.current_pair
        self.processor.update_batch()
        io.current_pair = 1 - io.current_pair  # where transformers prepares the next batch
        self._in_flight = False

    def _guarded_compute(self, model: Any, batch_data: dict[str, Any]) -> None:
        """The forward with the canary's work around it (see the module docstring), then
        hooks.end_forward as soon as the forward is launched."""
        hooks = self._hooks
        if hooks is None:
            self._compute(model, batch_data)
            self._steps += 1
            return
        pair = self._pair()
        self._map_batch(pair)
        if not self._in_forward:
            with self._on_compute_stream():
                self._head(hooks, pair, batch_data)
        self._forward_pair = pair
        try:
            self._compute(model, batch_data)
        finally:
            self._forward_pair = None
        if not self._in_forward:  # after the replay, which sampled too
            with self._on_compute_stream():
                self._tail(hooks, pair)
                self._put_sampled(pair, batch_data, self._device_ios[pair].output_ids)
        hooks.end_forward(self._on_compute_stream)
        self._steps += 1

    @torch.compiler.disable
    def _head_in_forward(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """The model's forward pre-hook: HEAD inside the forward, on its stream (captured with it);
        a forward the wrapper does not run (a test's own model call) is left alone."""
        pair, hooks = self._forward_pair, self._hooks
        if pair is None or hooks is None:
            return
        consumed = kwargs.get("input_ids")
        if consumed is None or consumed.data_ptr() != self._derived[pair].input_ids.data_ptr():
            raise UnsupportedModel("the model's forward does not embed the input ids transformers staged for "
                                   "it; the canary's view would not be what the forward consumed")
        self._head(hooks, pair, kwargs)

    @torch.compiler.disable
    def _tail_in_forward(self, model: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """The model's forward hook: RECHECK and TAIL inside the forward."""
        pair, hooks = self._forward_pair, self._hooks
        if pair is not None and hooks is not None:
            self._tail(hooks, pair)

    @torch.compiler.disable
    def _record_sampled(self, batch_data: dict[str, Any], output_ids: torch.Tensor) -> None:
        """Right after transformers sampled a forward's tokens, inside the forward (captured with it)
        when the canary's work is."""
        pair, hooks = self._forward_pair, self._hooks
        if pair is not None and hooks is not None and self._in_forward:
            self._put_sampled(pair, batch_data, output_ids)

    def _put_sampled(self, pair: int, batch_data: dict[str, Any], output_ids: torch.Tensor) -> None:
        """The forward's sampled tokens (output_ids row 0, in the order of its logits_indices) into
        the token table, each at the position its request decodes next (device work)."""
        self._buffers.put_tokens(*self._derived[pair].sampled_at(batch_data["logits_indices"]), output_ids[0])

    def _pair(self) -> int:
        """The IO pair this forward's inputs are in (always 0 without async batching)."""
        return self.processor.inputs_and_outputs.current_pair if self._io_pairs else 0

    def _batch_io(self) -> Any:
        """The host-side inputs of the batch transformers prepared last (under async batching, the
        current IO pair's)."""
        io = self.processor.inputs_and_outputs
        return self._io_pairs[io.current_pair].host_io if self._io_pairs else io

    def batch_requests(self) -> list[Any]:
        """The FutureRequestStates of the batch transformers prepared last."""
        return self._batch_io().requests_in_batch

    def _head(self, hooks: ForwardHooks, pair: int, inputs: dict[str, Any]) -> None:
        """What the host staged for this forward onto the device, the view's lengths and block
        tables from the buffers and indices the forward consumes (`inputs`: its keyword
        arguments) and its inputs as they are now (what a forward observer sees), then HEAD
        (device work)."""
        if inputs.get("block_table") is not None:
            raise UnsupportedModel("transformers runs this batch on its block-table decode path (flash attention "
                                   "with a KV cache); the canary reads the read and write indices of the SDPA path")
        reads, writes = inputs["read_index"], inputs["write_index"]
        self._view_staging.run((pair, buffers_key([*reads, *writes])), lambda: self._stage_view(pair, reads, writes))
        self._head_pair = pair
        hooks.before_forward(self._view)

    def _stage_view(self, pair: int, read_index: Sequence[torch.Tensor], write_index: Sequence[torch.Tensor]) -> None:
        """The staged buffer uploaded and its token entries applied, the view derived and its inputs
        copied (device work only, the same launches for the same pair and index buffers: an eager
        forward's are replayed from a CUDA graph once they repeat, launch_replay.py)."""
        self._buffers.upload()
        self._buffers.apply_tokens()
        derived = self._derived[pair]
        derived.derive(read_index, write_index)
        derived.copy_inputs()

    def feed_token(self, view: Any, index: int, token: int) -> None:
        """The forward about to run embeds `token` at view token `index` (optional CanaryHost extra,
        from a forward observer in before_forward): written into the input ids transformers staged
        for it and into the view's copy of them. With async batching and the canary around
        transformers' graphs, transformers' carry-over of a token sampled by the forward before may
        still overwrite it."""
        self._derived[self._head_pair].input_ids[index] = token
        view.input_ids[index] = token

    def _tail(self, hooks: ForwardHooks, pair: int) -> None:
        """The inputs as the forward left them into the view, then RECHECK and TAIL (device work)."""
        self._derived[pair].copy_inputs()
        hooks.after_forward(self._view)

    def _wrap_cache_update(self) -> None:
        """Report each layer's computed K/V rows ([T, H, D], view token order) to hooks.kv_stored
        before the paged cache stores them; not while a CUDA graph is being captured (a replay
        never calls back, so a captured report would hand TAIL rows that were never computed)."""
        cache = self.processor.cache
        update = cache.update
        signature = inspect.signature(update)
        targets = {layer: self.layout.store_target(layer) for g in self.groups for layer in g.layers}

        def reporting_update(*args: Any, **kwargs: Any) -> Any:
            report = getattr(self._hooks, "kv_stored", None)  # optional in ForwardHooks
            if report is not None and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                bound = signature.bind(*args, **kwargs).arguments
                kind, index = targets[bound["layer_idx"]]
                k, v = (bound[name][0].transpose(0, 1) for name in ("key_states", "value_states"))
                report(kind, index, k, v)
            return update(*args, **kwargs)

        cache.update = reporting_update

    def _compute_stream(self) -> torch.cuda.Stream | None:
        """The stream transformers computes on (None: no stream of its own, or no CUDA)."""
        return getattr(self.processor.inputs_and_outputs, "compute_stream", None)

    @contextmanager
    def _on_compute_stream(self) -> Iterator[None]:
        """The canary's device work on the stream transformers computes on (CUDA), ordered both
        ways with the host's stream: after the input writes transformers enqueued there for this
        forward, and before its next batch's reset and writes of the same buffers (the canary
        reads transformers' input buffers; without the second wait the next reset could zero them
        before TAIL copies them)."""
        stream = self._compute_stream()
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

    def _map_batch(self, pair: int) -> None:
        """Stage what only the host knows about the batch transformers just prepared (its size, its
        rows' lanes and the token-table entries it adds) in the pair's buffer; entries past its
        fixed-size part go to the device here."""
        io = self._batch_io()
        batch = io.requests_in_batch
        size = len(batch)
        if size > self.capacities.max_batch:
            raise RuntimeError(f"transformers batched {size} requests; the canary was sized for "
                               f"{self.capacities.max_batch}")
        buffers = self._buffers
        buffers.select(pair)
        buffers.set_batch(size, len(io.req_id_to_new_token_position))
        states = list(map(_STATE, batch))
        reassigned = not all(map(operator.is_, states, self._row_states))
        if reassigned:
            self._assign_lanes(states)
        if self._staged_lanes[pair] != self._lanes_version:
            # every mapped row's lane: a later batch of this pair may have rows this one lacks
            buffers.set_lanes(self._row_lanes[:self._rows_mapped])
            self._staged_lanes[pair] = self._lanes_version
        if reassigned or io.total_seqlen_q != size:  # another batch, or not one token a row
            cleared, *entries = self._token_entries(states)
            buffers.clear_lanes(cleared)
            buffers.set_entries(*entries)
        else:  # a decode step of the same batch: its tokens are the ones the device sampled
            buffers.set_entries(*_NO_ENTRIES)
        if self.layout.writes_hashed_blocks:
            self._note_hashed_block_writes(batch, every_row=reassigned or io.total_seqlen_q != size)
        if buffers.has_direct_writes():
            with self._on_compute_stream():
                buffers.write_direct()

    def _note_hashed_block_writes(self, batch: list[Any], *, every_row: bool) -> None:
        """The slots this forward writes in blocks transformers has hashed (content other requests
        may read or adopt), noted for `engine_defects` as the engine's defect: a prompt's token
        rewritten into a cached block (versions.DEFECT_CACHED_BLOCK_REWRITE), a generated token into
        a block hashed before it was full (versions.DEFECT_SHARED_DECODE_BLOCK). every_row: look at
        every row (another batch, or rows of more than one token); else (a decode step of the same
        batch) only at the requests that may write a hashed block: seen writing one, or marked with
        a hashed block at or past their next write (`_on_marked`)."""
        if not every_row and not self._hashed_writers:
            return
        rows = batch if every_row else [f for f in batch if f.state.request_id in self._hashed_writers]
        full, page, hashed = self.groups[0], self.page_size, self.layout.hashed_ids()
        slots: dict[str, list[int]] = {DEFECT_CACHED_BLOCK_REWRITE: [], DEFECT_SHARED_DECODE_BLOCK: []}
        for future in rows:
            state = future.state
            end = state.position_offset
            start = end - future.query_length
            prompt = len(state.initial_tokens)
            blocks = self.layout.block_ids(full, state.request_id)
            wrote = False
            for index in range(start // page, min(-(-end // page), len(blocks))):
                if blocks[index] in hashed:
                    wrote = True
                    for p in range(max(start, index * page), min(end, (index + 1) * page)):
                        defect = DEFECT_CACHED_BLOCK_REWRITE if p < prompt else DEFECT_SHARED_DECODE_BLOCK
                        slots[defect].append(blocks[index] * page + p % page)
            if wrote:
                self._hashed_writers.add(state.request_id)
            else:
                self._hashed_writers.discard(state.request_id)
        self._defects += [EngineDefect(self._steps, GroupKind.FULL, tuple(s), name) for name, s in slots.items() if s]

    def engine_defects(self) -> list[EngineDefect]:
        """The forwards since the last reset that wrote a hashed block (the engine's defects)."""
        return list(self._defects)

    def _assign_lanes(self, states: list[Any]) -> None:
        """Give each request of a batch that is not the last one's its lane: the one it holds, else
        a free lane or the one used longest ago (its request sends everything again if it comes
        back). The rows' views of their lanes (what each holds) come from the lanes."""
        used = self._lane_used
        for row, lane in enumerate(self._row_lanes[:self._rows_mapped]):  # the rows' views, back
            self._lane_known[lane] = self._row_known[row]
            used[lane] = self._steps - 1  # (at most) the forward before, which may still run
        mine = {self._lane_of.get(state.request_id) for state in states}
        for row, state in enumerate(states):
            lane = self._lane_of.get(state.request_id)
            if lane is None:
                lane = min((lane for lane in range(len(used)) if lane not in mine), key=used.__getitem__)
                mine.add(lane)
                gone = self._lane_states[lane]
                if gone is not None:
                    del self._lane_of[gone.request_id]
                self._lane_of[state.request_id] = lane
            if self._lane_states[lane] is not state:  # a new request, or one transformers re-created
                self._lane_states[lane], self._lane_known[lane] = state, 0
                self._row_owners.note(lane, self._steps, state.request_id)
            used[lane] = self._steps
            self._row_states[row], self._row_lanes[row], self._row_known[row] = state, lane, self._lane_known[lane]
        # Rows past the batch held no one now: a later batch with more rows is mapped afresh (their
        # lanes may have gone to the requests of this one).
        self._row_states[len(states):] = [None] * (len(self._row_states) - len(states))
        self._rows_mapped = len(states)
        self._lanes_version += 1

    def _token_entries(self, states: list[Any]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """(cleared, lanes, starts, counts, tokens): the lanes to clear and the token-table entries
        this forward adds, a run a row (BatchBuffers.set_entries): the positions its request
        advanced past since its lane last heard of it whose token the host has (the others are
        left to the tokens the device sampled, and sent once the host has them). A lane that
        changed hands is cleared first (UNKNOWN everywhere: no position of its request may be
        checked against the tokens of the lane's previous request)."""
        known, row_lanes = self._row_known, self._row_lanes
        cleared: list[int] = []
        lanes: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        tokens: list[int] = []
        for row, state in enumerate(states):
            length, start = state.position_offset, known[row]  # advanced past this forward's tokens
            if length <= start:
                continue
            generated, n = state.generated_tokens, len(state.initial_tokens)
            have = min(length, n + len(generated))  # positions [start, have)
            known[row] = have
            if not start:
                cleared.append(row_lanes[row])
            if have <= start:
                continue
            lanes.append(row_lanes[row])
            starts.append(start)
            counts.append(have - start)
            if start < n:
                tokens += state.initial_tokens[start:have]
            tokens += generated[max(start - n, 0):max(have - n, 0)]
        return cleared, lanes, starts, counts, tokens

    def _clear_lanes(self) -> None:
        """Forget what every lane and batch row holds: the next forward re-sends each lane it uses."""
        lanes, rows = self._buffers.token_table.shape[0], self.capacities.max_batch
        self._lane_of: dict[str, int] = {}  # request id -> the lane it holds
        self._lane_states: list[Any] = [None] * lanes  # the RequestState each lane's tokens are of
        self._lane_known = [0] * lanes  # positions of that state in token_table (as of the last batch change)
        self._lane_used = [-1] * lanes  # the forward that last used each lane
        self._row_states: list[Any] = [None] * rows  # the last batch's requests, by batch row
        self._row_lanes = [0] * rows  # their lanes
        self._row_known = [0] * rows  # their lanes' known positions, kept up to date per forward
        self._rows_mapped = 0  # the last batch's size
        self._lanes_version = 0  # changes whenever a row's lane does
        self._staged_lanes = [-1] * len(self._buffers.staging)  # the version each pair's staged lanes are of

    # ------------------------------------------------------------------------ bookkeeping
    def encode_request(self, prompt: str | Sequence[int], max_new_tokens: int, context_key: int = 0) -> list[int]:
        """The prompt's token ids, checked as generate checks them: ValueError for an empty prompt,
        a token outside the vocabulary, more tokens than max_context, or a context key (this
        engine has no contexts: context_key must be 0)."""
        if context_key != 0:
            raise ValueError(f"engine 'transformers' has no request contexts: context_key must be 0; got {context_key}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={vocab}); got {bad[0]}")
        total = len(ids) + max_new_tokens
        if total > self.capacities.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                             f"max_context ({self.capacities.max_context})")
        return ids

    def _cpu_offload(self) -> CpuOffloadTier:
        """transformers' CPU swap pool as a host tier. Blocks an offload frees are announced once
        it returned, after their copy to the pool (listeners then follow the data there)."""
        manager = self.processor.offloading_manager
        if not isinstance(self.layout, SectorLayout) or getattr(manager, "_cpu_pool", None) is None:
            raise ValueError("cpu_offload_space > 0 needs transformers >= 5.18 and room for a sector of the cache in "
                             "it; this one keeps no CPU swap pool")
        offload = manager.offload_requests

        def offload_requests() -> bool:
            self._held_frees = []
            try:
                return offload()
            finally:
                held, self._held_frees = self._held_frees, None
                for args in held:
                    self._on_free(*args)

        manager.offload_requests = offload_requests
        return CpuOffloadTier(self.processor, self.layout)

    def _on_free(self, kind: GroupKind, blocks: list[int], cause: str) -> None:
        if self._held_frees is not None:
            self._held_frees.append((kind, blocks, cause))
            return
        if kind is GroupKind.FULL:
            self.block_log.forget(blocks)
        if self._free_listeners:
            offsets = torch.arange(self.page_size, dtype=torch.int64)
            # CPU slots: a copy to the device here would wait for the device's queue at every free
            slots = (torch.tensor(blocks, dtype=torch.int64).reshape(-1, 1) * self.page_size + offsets).flatten()
            for listener in self._free_listeners:
                listener(kind, slots, cause)

    def _on_marked(self, state: Any) -> None:
        full, hashed = self.groups[0], self.layout.hashed_ids()
        blocks, tokens = self.layout.block_ids(full, state.request_id), state.initial_tokens + state.generated_tokens
        self.block_log.note(blocks, tokens, hashed)
        next_write = max(len(tokens) - 1, 0)  # the last token's KV is written by the next forward
        if self.layout.writes_hashed_blocks and any(b in hashed for b in blocks[next_write // self.page_size:]):
            self._hashed_writers.add(state.request_id)

    def _collect(self) -> dict[str, list[int]]:
        queue = self.manager.output_router.output_queue
        outputs = {}
        while not queue.empty():
            output = queue.get_nowait()
            if output.error is not None:
                raise RuntimeError(f"transformers failed request {output.request_id}: {output.error}")
            outputs[output.request_id] = list(output.generated_tokens)
        return outputs

    def _drop_requests(self) -> None:
        """Forget every queued, waiting and running request (their blocks are released)."""
        input_queue = self.manager.input_queue
        while not input_queue.empty():
            input_queue.get_nowait()
        self.processor.fail_all_requests(RuntimeError("dropped by the kvcanary engine"))
        queue = self.manager.output_router.output_queue
        while not queue.empty():
            queue.get_nowait()
