"""TransformersEngine: Hugging Face transformers continuous batching behind the canary seam (an
EngineUnderTest).

It drives a ``ContinuousBatchProcessor`` in the calling thread (prepare_next_batch ->
_generation_step -> update_batch, in transformers' own order under async batching); the canary
guards each forward from inside it (forward.py), the host staging what only it knows per forward
(staging.py: a request holds a lane, a row of the canary's tables, lanes.py). What the adapter
reads or patches of transformers' private parts goes through versions.py, and every patch is
undone by `close`. docs/transformers.md says how each part is guarded: lanes, token-table
entries, write-through, the block log, CUDA graphs and async batching.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from kvcanary_kernels.checks import check_int

from ...canary.seam import (Arrival, CacheWalk, Capacities, EngineDefect, ForwardHooks, FreeListener, GroupKind,
                            PagedWalk, PoolGroup, SlotMapping, TokenScores)
from .batch_buffers import BatchBuffers
from .block_log import BlockLog
from .defects import HashedBlockWrites
from .forward import GuardedForward
from .offload import CpuOffloadTier
from ..patches import Patches
from .staging import BatchStaging
from .versions import (
    CAUSE_RESET, GroupCache, IOPairs, SectorLayout, cache_layout, count_prefix_hits, generation_step, has_cpu_swap_pool,
    hold_offload_frees, sdpa_attention, start_batching,
)


class TransformersEngine:
    """A transformers model under continuous batching, guarded through the GuardedEngine seam.

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
    swap pool as the seam's HostTier, or None). ``close`` undoes every patch the engine installed
    in transformers (its wrappers, and its hooks on the model, which an engine dropped unclosed
    removes when it is collected).
    """

    def __init__(self, model: Any, tokenizer: Any, *, page_size: int = 16, num_blocks: int = 256,
                 max_batch_tokens: int = 256, max_requests_per_batch: int = 8, max_context: int = 512,
                 allow_block_sharing: bool = True, use_cuda_graph: bool = False, use_async_batching: bool = False,
                 write_through: bool = True, canary_graphs: bool = False, cpu_offload_space: float = 0.0) -> None:
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
        self.manager = start_batching(
            model, self.eos_token_id, page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests_per_batch, allow_block_sharing=allow_block_sharing,
            use_cuda_graph=use_cuda_graph, use_async_batching=use_async_batching, cpu_offload_space=cpu_offload_space)
        self.processor = self.manager.batch_processor
        self.layout = cache_layout(self.processor)
        self.groups: list[GroupCache] = self.layout.groups
        self.page_size = page_size
        self.block_log = BlockLog(page_size, self.groups[0].num_slots)
        self._free_listeners: list[FreeListener] = []
        self._held_frees: list[tuple[GroupKind, list[int], str]] | None = None  # announced after an offload
        self._patches = Patches()
        self._closed = False
        self.layout.install(self._patches, self._on_free, self._on_marked)
        self._prefix_hits = 0
        self._counts_hits = count_prefix_hits(self._patches, self.processor, self._hit)
        self.host_tier = self._cpu_offload() if cpu_offload_space else None

        resolved = self.manager.continuous_batching_config
        self.capacities = Capacities(
            max_batch=resolved.max_requests_per_batch, max_tokens=self.processor.cache.max_batch_tokens,
            max_context=min(max_context, model.config.max_position_embeddings))
        self._io = IOPairs(self.processor, use_async_batching)
        buffers = BatchBuffers(self.capacities, 2 * self.capacities.max_batch, self.device, len(self._io.device_ios),
                               fused=self.device.type == "cuda")
        self._hashed_writes = HashedBlockWrites(self.layout, page_size)
        self._staging = BatchStaging(buffers, self.capacities.max_batch, self._hashed_writes)
        self._forward = GuardedForward(model, self.processor, self._io, self._staging, self.layout, self.capacities,
                                       self._patches, use_cuda_graph=use_cuda_graph, canary_graphs=canary_graphs,
                                       write_through=write_through)
        self._use_cuda_graph = use_cuda_graph
        self._in_flight = False  # async batching: a launched batch is not updated yet
        self._next_request = 0
        self._prompts: dict[str, str | list[int]] = {}  # request id -> its prompt (text, or the ids)

    def close(self) -> None:
        """Undo every patch of transformers the engine installed; the engine is not used after:
        attaching hooks or running requests then raises (its forwards would run unguarded)."""
        self._patches.uninstall()
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on a closed TransformersEngine: close() (which a handle's close() calls) "
                               "undid its patches of transformers, so a canary would see none of its forwards; "
                               "build a new engine, or detach with set_forward_hooks(None) instead of closing")

    # ----------------------------------------------------------------------------- GuardedEngine
    def canary_groups(self) -> Sequence[PoolGroup]:
        return [PoolGroup(g.kind, g.k_layers, g.v_layers, g.num_slots,
                          SlotMapping(self._forward.tables[g.kind][:-1], page_size=g.page_size, ring=g.ring),
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

    @property
    def prefix_caching(self) -> bool:
        """Whether transformers shares cached prefixes between requests: not for a model with
        sliding-window layers, nor with allow_block_sharing=False."""
        return bool(self.processor.cache.use_prefix_sharing)

    def liveness(self) -> dict[str, int]:
        """Requests admitted with a cached prefix since start-up ("prefix hits"); {} where the
        release's cache does not say."""
        return {"prefix hits": self._prefix_hits} if self._counts_hits else {}

    def _hit(self) -> None:
        self._prefix_hits += 1

    def add_free_listener(self, listener: FreeListener) -> None:
        """listener(group, slots of that group, cause) before any block goes back to the free
        pool: every slot of the block."""
        self._free_listeners.append(listener)

    # ------------------------------------------------------------------------ EngineUnderTest
    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        if hooks is not None:
            self._check_open("set_forward_hooks")
        self._forward.set_hooks(hooks)

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy output token ids per prompt, in order; runs until every request is done. If a
        forward raises (a hook, say), every request is dropped and the error propagates."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of prompts (str or token ids), not one bare string")
        self._check_open("generate")
        check_int("max_new_tokens", max_new_tokens, 1)
        encoded = [self.encode_request(p, max_new_tokens) for p in prompts]
        request_ids = [self._submit(prompt, ids, max_new_tokens) for prompt, ids in zip(prompts, encoded)]
        outputs = self._run(request_ids)
        return [outputs[r] for r in request_ids]

    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """Greedy output ids per arrival: each added once this call ran `at_forward` forwards (at
        once when nothing is left to run), cancelled `abort_after` forwards after that (keeping the
        tokens transformers had handed over); runs until every request is done or cancelled."""
        self._check_open("serve")
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
        self._prompts[request_id] = prompt if isinstance(prompt, str) else ids  # formatted when a report asks
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
        self._staging.reset()
        self._forward.reset()
        self._prompts.clear()
        self._hashed_writes.clear()

    def request_at(self, row: int, step: int) -> tuple[str, str] | None:
        """The request (id, prompt text) that held lane `row` at forward `step` since the last
        reset; None when none did."""
        owner = self._staging.lanes.owners.at(row, step)
        if owner is None:
            return None
        prompt = self._prompts.get(owner, "")
        return owner, prompt if isinstance(prompt, str) else repr(prompt)

    def feed_token(self, view: Any, index: int, token: int) -> None:
        """The forward about to run embeds `token` at view token `index` (optional GuardedEngine extra,
        from a forward observer in before_forward): written into the input ids transformers staged
        for it and into the view's copy of them. With async batching and the canary around
        transformers' graphs, transformers' carry-over of a token sampled by the forward before may
        still overwrite it."""
        self._forward.feed_token(view, index, token)

    def batch_requests(self) -> list[Any]:
        """The FutureRequestStates of the batch transformers prepared last."""
        return self._io.batch_io().requests_in_batch

    def engine_defects(self) -> list[EngineDefect]:
        """The forwards since the last reset that wrote a hashed block (the engine's defects)."""
        return list(self._hashed_writes.defects)

    # -------------------------------------------------------------------------------- the loop
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
                generation_step(processor, self.model)
                launched += 1
                if self._in_flight or not self._io.pairs:
                    processor.update_batch()  # async: the batch before the one just launched
                self._in_flight = bool(self._io.pairs)
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
        self._io.update_other_pair(self.processor)
        self._in_flight = False

    # ------------------------------------------------------------------------ bookkeeping
    def encode_request(self, prompt: str | Sequence[int], max_new_tokens: int, context_key: int = 0) -> list[int]:
        """The prompt's token ids, checked as generate checks them: ValueError for an empty prompt,
        a token outside the vocabulary, more tokens than max_context, or a context key (this
        engine has no contexts: context_key must be 0)."""
        if context_key != 0:
            raise ValueError(f"engine 'transformers' has no request contexts: context_key must be 0; got {context_key}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(map(int, prompt))
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:  # (C loops: a long prompt's ids are checked in microseconds)
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token ids must be in [0, vocab_size={vocab}); got {bad}")
        total = len(ids) + max_new_tokens
        if total > self.capacities.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                             f"max_context ({self.capacities.max_context})")
        return ids

    def _cpu_offload(self) -> CpuOffloadTier:
        """transformers' CPU swap pool as a host tier."""
        if not isinstance(self.layout, SectorLayout) or not has_cpu_swap_pool(self.processor):
            raise ValueError("cpu_offload_space > 0 needs transformers >= 5.18 and room for a sector of the cache in "
                             "it; this one keeps no CPU swap pool")
        hold_offload_frees(self._patches, self.processor, self._offloading)
        return CpuOffloadTier(self.processor, self.layout, self._patches)

    def _offloading(self, offload: Callable[[], bool]) -> bool:
        """transformers' offload_requests, the blocks it frees announced once it returned, after
        their copy to the pool (listeners then follow the data there)."""
        self._held_frees = []
        try:
            return offload()
        finally:
            held, self._held_frees = self._held_frees, None
            for args in held:
                self._on_free(*args)

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
        self._hashed_writes.marked(state.request_id, blocks, len(tokens), hashed)

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
