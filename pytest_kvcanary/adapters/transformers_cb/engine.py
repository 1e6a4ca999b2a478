"""TransformersEngine: Hugging Face transformers continuous batching behind the canary seam.

The engine drives a ``ContinuousBatchProcessor`` in the calling thread (no background thread):

    prepare_next_batch -> _generation_step -> update_batch

and wraps ``_generation_step`` on the processor: before it, the batch's lengths, changed
block-table rows and new token-table entries are uploaded in one copy (batch_buffers.py) and the
ForwardView is filled, then hooks.before_forward; after it, hooks.after_forward and
hooks.end_forward. The wrapper runs in Python around whatever the step does inside, so it works
the same when the step replays a CUDA graph (``use_cuda_graph=True``): the canary's kernels run
on the processor's compute stream right before and after the replay, eagerly or, with
``canary_graphs=True``, replayed from graphs of their own (canary_graphs.py).

With write_through (the default) the paged cache's ``update`` is wrapped too: each layer's K and
V rows, as the forward computed them, go to hooks.kv_stored before transformers stores them, so
TAIL checks every written slot holds exactly what the forward computed (a store to the wrong
slot, one slot early, say, is reported in that forward). Write-through runs in eager forwards
only: a forward replayed from a CUDA graph skips the wrapper and is stamped without it.

Mapping row r is batch row r of the current forward (refilled every forward: transformers
re-points a request's table when it de-duplicates a block). Slot s of a group is offset
``s % page_size`` of block ``s // page_size`` in that group's block geometry; slot 0 (block 0's
first slot) is never a token's: it lies in a trash block transformers never allocates (5.18+) or
in block 0, which the adapter takes out of the free list (5.17).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any, Sequence

import torch

from kvcanary_kernels.checks import check_int
from kvcanary_kernels.records import GroupKind

from ...canary.host import CacheWalk, Capacities, ForwardHooks, ForwardView, FreeListener, PoolGroup, SlotMapping
from .batch_buffers import BatchBuffers
from .block_log import BlockLog
from .canary_graphs import CanaryGraphs
from .versions import CAUSE_RESET, GroupCache, cache_layout, config_options, sdpa_attention


class TransformersEngine:
    """A transformers model under continuous batching, guarded through the CanaryHost seam.

    page_size: tokens per KV block; num_blocks: cache capacity in blocks (the prefix cache evicts
    and transformers offloads requests when it runs short); max_batch_tokens /
    max_requests_per_batch: the largest forward; max_context: the longest request (prompt plus
    new tokens); allow_block_sharing: prefix sharing and block de-duplication (full-attention
    models only); use_cuda_graph: capture the forward in CUDA graphs (CUDA only); write_through:
    hand each layer's computed K/V to the canary at the cache's update (eager forwards);
    canary_graphs: with use_cuda_graph, replay the canary's per-forward device work from CUDA
    graphs of its own (canary_graphs.py; forward observers such as the fault injector are then
    not called, so fault-injection tests leave it off).

    Attributes for tools that reach inside: ``model``, ``tokenizer``, ``manager`` (the
    ContinuousBatchingManager), ``processor`` (its ContinuousBatchProcessor; ``processor.cache``
    is the PagedAttentionCache), ``layout`` (versions.py), ``block_log``.
    """

    def __init__(self, model: Any, tokenizer: Any, *, page_size: int = 16, num_blocks: int = 256,
                 max_batch_tokens: int = 256, max_requests_per_batch: int = 8, max_context: int = 512,
                 allow_block_sharing: bool = True, use_cuda_graph: bool = False,
                 write_through: bool = True, canary_graphs: bool = False) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs a CUDA device; the model is on {self.device}")
        if canary_graphs and not use_cuda_graph:
            raise ValueError("canary_graphs=True needs use_cuda_graph=True")
        self.eos_token_id = model.config.eos_token_id if model.config.eos_token_id is not None else -1
        model.set_attn_implementation(sdpa_attention())
        generation = GenerationConfig(do_sample=False, eos_token_id=self.eos_token_id,
                                      pad_token_id=model.config.pad_token_id)
        config = ContinuousBatchingConfig(**config_options(
            page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests_per_batch, allow_block_sharing=allow_block_sharing,
            use_cuda_graph=use_cuda_graph, use_async_batching=False, cpu_offload_space=0.0))
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        self.manager.warmup()  # creates the processor; captures CUDA graphs when they are on
        self.processor = self.manager.batch_processor
        self.layout = cache_layout(self.processor)
        self.groups: list[GroupCache] = self.layout.groups
        self.page_size = page_size
        self.block_log = BlockLog(page_size)
        self._free_listeners: list[FreeListener] = []
        self.layout.install(self._on_free, self._on_marked)

        resolved = self.manager.continuous_batching_config
        self.capacities = Capacities(
            max_batch=resolved.max_requests_per_batch, max_tokens=self.processor.cache.max_batch_tokens,
            max_context=min(max_context, model.config.max_position_embeddings))
        self._buffers = self._batch_buffers()
        self._tables = self._buffers.tables
        self._view = self._forward_view()
        self._row_tables: list[tuple[Any, ...] | None] = [None] * self.capacities.max_batch  # what each row's tables hold
        self._table_epoch = 0  # advances whenever a block is freed or hashed (a table may be re-pointed)
        self._row_tokens: list[Any] = [None] * self.capacities.max_batch  # the RequestState each row's tokens are of
        self._row_known = [0] * self.capacities.max_batch  # positions of that state already in token_table

        self._hooks: ForwardHooks | None = None
        self._canary_graphs = canary_graphs
        self._graphs: CanaryGraphs | None = None
        if write_through and not canary_graphs:
            self._wrap_cache_update()
        self._step = self.processor._generation_step
        self.processor._generation_step = self._guarded_step
        self._next_request = 0
        self._steps = 0  # forwards since the last reset: the step a canary's violations name
        self._row_owners: dict[int, list[tuple[int, str]]] = {}  # row -> (first step, request id)
        self._prompts: dict[str, str] = {}

    # ----------------------------------------------------------------------------- CanaryHost
    def canary_groups(self) -> Sequence[PoolGroup]:
        return [PoolGroup(g.kind, g.k_layers, g.v_layers, g.num_slots,
                          SlotMapping(self._tables[g.kind], page_size=g.page_size, ring=g.ring),
                          page_size=g.page_size, window=g.window, fingerprintable=g.fingerprintable)
                for g in self.groups]

    def canary_capacities(self) -> Capacities:
        return self.capacities

    def cache_walk(self) -> CacheWalk | None:
        """The hashed FULL blocks transformers keeps for prefix sharing (None when the model has
        no prefix sharing: hybrid models, or allow_block_sharing=False)."""
        if not self.processor.cache.use_prefix_sharing:
            return None
        return self.block_log.walk(self.layout.hashed_blocks(), self.device)

    def add_free_listener(self, listener: FreeListener) -> None:
        """listener(group, slots of that group, cause) before any block goes back to the free
        pool: every slot of the block."""
        self._free_listeners.append(listener)

    # ------------------------------------------------------------------------ EngineUnderTest
    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self._hooks = hooks
        self._graphs = (CanaryGraphs(hooks, self._view, self._buffers.apply_tokens)
                        if hooks is not None and self._canary_graphs else None)

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy output token ids per prompt, in order; runs until every request is done. If a
        forward raises (a hook, say), every request is dropped and the error propagates."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of prompts (str or token ids), not one bare string")
        check_int("max_new_tokens", max_new_tokens, 1)
        encoded = [self._encode(p, max_new_tokens) for p in prompts]
        request_ids = []
        for prompt, ids in zip(prompts, encoded):
            request_id = f"kvcanary-{self._next_request}"
            self._next_request += 1
            self._prompts[request_id] = prompt if isinstance(prompt, str) else repr(list(prompt))
            self.manager.add_request(ids, request_id=request_id, max_new_tokens=max_new_tokens,
                                     eos_token_id=self.eos_token_id)
            request_ids.append(request_id)
        try:
            while self.processor.prepare_next_batch():
                self.processor._generation_step(self.model)
                self.processor.update_batch()
        except BaseException:
            self._drop_requests()
            raise
        outputs = self._collect()
        missing = [r for r in request_ids if r not in outputs]
        if missing:
            self._drop_requests()
            raise RuntimeError(f"transformers stopped scheduling with {len(missing)} request(s) unfinished "
                               f"(num_blocks too small for one request?): {missing[:4]}")
        return [outputs[r] for r in request_ids]

    def reset(self) -> None:
        """Drop every request and flush the prefix cache: blocks are handed out in a new cache's
        order again (the step count restarts)."""
        with self.layout.causes.cause(CAUSE_RESET):
            self._drop_requests()
            self.processor.reset()
            self.layout.flush()
        self.block_log.clear()
        self._buffers.reset()
        self._row_tables = [None] * self.capacities.max_batch
        self._row_tokens = [None] * self.capacities.max_batch
        self._row_known = [0] * self.capacities.max_batch
        self._steps = 0
        self._row_owners.clear()
        self._prompts.clear()

    def request_at(self, row: int, step: int) -> tuple[str, str] | None:
        """The request (id, prompt text) that held mapping row `row` at forward `step` since the
        last reset; None when none did."""
        owner = None
        for first, request_id in self._row_owners.get(row, []):
            if first > step:
                break
            owner = request_id
        return None if owner is None else (owner, self._prompts.get(owner, ""))

    # ------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def _guarded_step(self, model: Any) -> None:
        hooks = self._hooks
        if hooks is None:
            self._step(model)
        else:
            with self._on_compute_stream():
                self._canary_before(hooks)
            self._step(model)
            with self._on_compute_stream():
                self._canary_after(hooks)
        self._steps += 1

    def _canary_before(self, hooks: ForwardHooks) -> None:
        self._map_batch()
        if self._graphs is not None:
            self._graphs.before()
        else:
            self._buffers.apply_tokens()
            hooks.before_forward(self._view)

    def _canary_after(self, hooks: ForwardHooks) -> None:
        if self._graphs is not None:
            self._graphs.after()
        else:
            hooks.after_forward(self._view)
        hooks.end_forward()

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
                k, v = (bound[name][0].transpose(0, 1).contiguous() for name in ("key_states", "value_states"))
                report(kind, index, k, v)
            return update(*args, **kwargs)

        cache.update = reporting_update

    def _on_compute_stream(self) -> Any:
        """The stream transformers computes on (CUDA), so the canary's work is ordered with it."""
        stream = getattr(self.processor.inputs_and_outputs, "compute_stream", None)
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _map_batch(self) -> None:
        """Fill the mapping tables and the view for the batch transformers just prepared: one
        upload of the lengths, the table rows that changed and the new token entries."""
        io = self.processor.inputs_and_outputs
        batch = io.requests_in_batch
        if len(batch) > self.capacities.max_batch:
            raise RuntimeError(f"transformers batched {len(batch)} requests; the canary was sized for "
                               f"{self.capacities.max_batch}")
        prefix, extend = [], []
        tables: dict[GroupKind, dict[int, list[int]]] = {g.kind: {} for g in self.groups}
        rows, positions, tokens = [], [], []
        for row, future in enumerate(batch):
            state, query = future.state, future.query_length
            start = state.position_offset - query  # prepare_batch_tensors already advanced the offset
            prefix.append(start)
            extend.append(query)
            blocks = [self.layout.block_ids(g, state.request_id) for g in self.groups]
            key = (id(state), self._table_epoch, *map(len, blocks))
            if self._row_tables[row] != key:
                self._row_tables[row] = key
                for group, ids in zip(self.groups, blocks):
                    tables[group.kind][row] = ids
            self._note_tokens(row, state, start + query, rows, positions, tokens)
        for row in range(len(batch), self.capacities.max_batch):
            self._row_tables[row] = None
        self._buffers.fill(prefix, extend, tables, rows, positions, tokens)
        self._buffers.upload()
        self._view.input_ids.copy_(io.input_ids[:self.capacities.max_tokens])
        self._view.positions.copy_(io.position_ids[:self.capacities.max_tokens])

    def _note_tokens(self, row: int, state: Any, length: int, rows: list[int], positions: list[int],
                     tokens: list[int]) -> None:
        """Queue the token_table entries of `row` that are new: the request's whole sequence up to
        `length` when the row changed hands, else what was added since."""
        if self._row_tokens[row] is not state:
            self._row_tokens[row], self._row_known[row] = state, 0
            self._row_owners.setdefault(row, []).append((self._steps, state.request_id))
        start = self._row_known[row]
        if length > start:
            prompt, generated = state.initial_tokens, state.generated_tokens
            tokens.extend(prompt[start:length])
            tokens.extend(generated[max(0, start - len(prompt)):max(0, length - len(prompt))])
            rows.extend([row] * (length - start))
            positions.extend(range(start, length))
            self._row_known[row] = length

    def _batch_buffers(self) -> BatchBuffers:
        c = self.capacities
        widths = {g.kind: -(-(g.ring if g.ring else c.max_context) // g.page_size) for g in self.groups}
        return BatchBuffers(c, widths, self.device)

    def _forward_view(self) -> ForwardView:
        c, device = self.capacities, self.device
        lens = self._buffers.lens
        return ForwardView(
            rows=torch.arange(c.max_batch, dtype=torch.int64, device=device),
            prefix_lens=lens[0], extend_lens=lens[1],
            input_ids=torch.zeros(c.max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(c.max_tokens, dtype=torch.int64, device=device),
            token_table=self._buffers.token_table)

    # ------------------------------------------------------------------------ bookkeeping
    def _encode(self, prompt: str | Sequence[int], max_new_tokens: int) -> list[int]:
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

    def _on_free(self, kind: GroupKind, blocks: list[int], cause: str) -> None:
        self._table_epoch += 1
        if kind is GroupKind.FULL:
            self.block_log.forget(blocks)
        if self._free_listeners:
            offsets = torch.arange(self.page_size, dtype=torch.int64)
            slots = (torch.tensor(blocks, dtype=torch.int64).reshape(-1, 1) * self.page_size + offsets).flatten()
            slots = slots.to(self.device)
            for listener in self._free_listeners:
                listener(kind, slots, cause)

    def _on_marked(self, state: Any) -> None:
        self._table_epoch += 1
        full = self.groups[0]
        self.block_log.note(self.layout.block_ids(full, state.request_id),
                            state.initial_tokens + state.generated_tokens, self.layout.hashed_blocks())

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
