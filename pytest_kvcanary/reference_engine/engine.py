"""The reference engine: model + KV pools + radix cache + scheduler, one forward per step.

    step -> Scheduler.schedule -> hooks.before_forward -> [draft model] -> model (PagedKV)
         -> hooks.after_forward -> greedy sample (speculative: accept proposals) -> Scheduler.process

It is a `GuardedEngine`: the canary runtime attaches through `canary_groups` / `canary_capacities` /
`cache_walk` and is called around every forward through `set_forward_hooks`, in the seam's order
(before_forward, the forward with kv_stored at each layer's KV-store point, after_forward,
end_forward).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvcanary_kernels.checks import check_int, is_int
from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.seam import (
    Arrival, CacheWalk, Capacities, CheckpointWalk, ForwardHooks, ForwardView, FreeListener, GroupInputs, PoolGroup,
    RowOwners, SlotMapping, StateInputs, TokenScores,
)

from .arrivals import serve_arrivals
from .async_steps import AsyncSteps
from .attention import PagedKV
from .config import EngineConfig
from .decode_graphs import DecodeGraphs
from .disk_tier import DiskTier
from .host_tier import HostKVCache
from .jitter import Jitter
from .kv_pool import KVPools, ReqToTokenPool
from .model import CausalLM
from .radix_cache import RadixCache
from .request import Request
from .scheduler import Batch, Scheduler
from .sparse import PagedSparseKV, empty_selection
from .speculative import Drafter
from .state_access import PooledState
from .state_pool import StatePool
from .token_notes import TokenNotes
from .tokenizer import ByteTokenizer
from .weights import load_weights


class Engine:
    """Attributes for tools that reach inside: ``model``, ``pools`` (FULL ``pools.full`` and SWA
    ``pools.swa`` KV pools, ``pools.swa.full_to_swa``), ``req_to_token_pool`` (``.table``: per token,
    or with page_size > 1 a block table of pages; ``.read(row, start, end)`` gives slots),
    ``radix_cache``, ``scheduler`` (``running`` / ``waiting`` requests; each running request has
    ``row``, ``kv_len``, ``prefix_len``, ``token_ids``), ``forward_count``, ``token_table``
    (``[rows, max_context]``: the token at each position of each row's request, -1 past it),
    ``drafter`` (speculative decoding's draft model and its acceptance counts, or None; its KV
    pool is ``pools.draft``), ``host_tier`` (the host-memory tier the radix cache writes evicted
    pages back to, or None; also the seam's optional GuardedEngine.host_tier), ``disk_tier`` (the
    storage tier under it that pages host memory evicts are stored in, or None), ``states`` (a hybrid
    model's state pool, StatePool, or None). model: what the engine
    runs, with its weights (default: a CausalLM of config.model with the checkpoint's weights; a
    parallel rank passes its shard)."""

    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if model is None:
            model = CausalLM(config.model)
            if config.checkpoint is not None:
                load_weights(model, config.checkpoint)
        self.model = model.to(self.device)
        self.tokenizer = ByteTokenizer()
        self.pools = KVPools(config)
        self.req_to_token_pool = ReqToTokenPool(config.max_running, config.model.max_context, self.device,
                                                config.page_size)
        self.states = (StatePool(config.num_state_slots, config.model, self.device, self.pools.free_listeners)
                       if config.model.attention == "hybrid" else None)
        self.jitter = Jitter(config.jitter_seed)
        self.host_tier = (HostKVCache(config, self.pools, self.device, self.states, self.jitter) if config.host_num_slots
                          else None)
        if self.states is not None and self.host_tier is not None:
            self.states.before_copy = self.host_tier.wait
        self.disk_tier = None if config.disk_dir is None else DiskTier(config, self.host_tier)
        window = config.model.window if self.pools.swa is not None else None
        self.radix_cache = RadixCache(self.pools, self.req_to_token_pool, window, self.host_tier, self.states,
                                      self.disk_tier)
        self.scheduler = Scheduler(config, self.pools, self.req_to_token_pool, self.radix_cache, self.states)
        self.token_table = torch.full((config.max_running, config.model.max_context), -1, dtype=torch.int64,
                                      device=self.device)
        self.drafter = None if self.pools.draft is None else Drafter(
            self.model, config, self.pools.draft, self.req_to_token_pool.table, self.token_table, self.device,
            self.states)
        self.forward_count = 0
        self._hooks: ForwardHooks | None = None
        self._next_rid = 0
        self._finished = 0  # requests finished since the last reset
        self._steps = 0  # forwards since the last reset: the step a canary's violations name
        self._row_owners: RowOwners[Request] = RowOwners()
        self._decode = None if config.decode_mode == "eager" else DecodeGraphs(
            self.model, self.pools, self.req_to_token_pool.table, self.token_table, config.max_running,
            self.device, use_graphs=config.decode_mode == "graph", states=self.states,
            spin=lambda: self.jitter.spin_at(self.device))
        self._token_notes = TokenNotes(self.token_table, incremental=self.drafter is None
                                       and not config.async_scheduling)
        self._async = AsyncSteps(self.scheduler, self.token_table, lambda batch: self._forward(batch, on_device=True),
                                 self._account, self.jitter) if config.async_scheduling else None

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self._hooks = hooks
        if self.states is not None:
            self.states.on_copy = None if hooks is None else hooks.states_copied
        if self._decode is not None:
            self._decode.invalidate()

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int, context_key: int = 0) -> Request:
        """Queue a request read in context `context_key` (a cache salt or adapter id, 0 = none: KV
        is shared within one context only); raises what `encode_request` raises."""
        req = Request(self._next_rid, self.encode_request(prompt, max_new_tokens, context_key), max_new_tokens,
                      context_key)
        self._next_rid += 1
        self.scheduler.waiting.append(req)
        return req

    def encode_request(self, prompt: str | Sequence[int], max_new_tokens: int, context_key: int = 0) -> list[int]:
        """The prompt's token ids, once the request is known to fit (nothing is queued); raises
        ValueError for an empty or too long prompt, a bad token id, max_new_tokens or context key,
        or a request the pools could not hold alone."""
        m = self.config.model
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        check_int("max_new_tokens", max_new_tokens, 1)
        if not is_int(context_key) or not 0 <= context_key < 1 << 62:
            raise ValueError(f"context_key must be an integer in [0, 2**62); got {context_key!r}")
        if bad := [t for t in ids if not 0 <= t < m.vocab_size]:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={m.vocab_size}); got {bad[0]}")
        total = len(ids) + max_new_tokens
        if total > m.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                             f"exceeds max_context ({m.max_context})")
        ps = self.config.page_size
        for name, pool in (("num_slots", self.pools.full), ("swa_num_slots", self.pools.swa)):
            if pool is not None and -(-(total - 1) // ps) * ps > pool.num_slots - ps:  # page 0 is reserved
                raise ValueError(f"pool too small for a single request: it needs {total - 1} KV slots, "
                                 f"{name}={pool.num_slots} holds {pool.num_slots - ps} in pages of {ps}")
        return ids

    def step(self) -> list[Request]:
        """Run one forward; returns the requests that finished in it ([] when idle). If the
        forward raises (a hook, say), its requests go back to waiting and the error propagates.
        With async scheduling: launch one and process the one launched before it (async_steps.py)."""
        return self._run(self.scheduler.schedule()) if self._async is None else self._async.step()

    def prefill_for_transfer(self) -> list[Request]:
        """The prefill side of a disaggregated pair: one prefill forward over waiting requests
        (never a decode; [] when none is waiting). Returns the prefilled requests that still need
        decoding: they stay running here, their KV cached by the radix cache (a duplicate prompt of
        the batch shares the first copy's slots, its own freed), until `scheduler.finish(req)`.
        Raises RuntimeError when requests wait but none fits beside those still held."""
        batch = self.scheduler.schedule_prefill()
        finished = self._run(batch)
        return [] if batch is None else [r for r in batch.reqs if r not in finished]

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int,
                 context_keys: Sequence[int] | None = None) -> list[list[int]]:
        """Greedy output token ids per prompt, in order (runs until every queued request is done);
        context_keys: one per prompt (default: none)."""
        keys = [0] * len(prompts) if context_keys is None else list(context_keys)
        if len(keys) != len(prompts):
            raise ValueError(f"context_keys must hold one key per prompt ({len(prompts)}); got {len(keys)}")
        reqs = [self.submit(p, max_new_tokens, k) for p, k in zip(prompts, keys)]
        while self.scheduler.has_work:
            self.step()
        return [r.output_ids for r in reqs]

    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """Greedy output ids per arrival: each submitted once this call ran `at_forward` forwards
        (at once when nothing is left to run before it), aborted `abort_after` forwards after
        that (keeping its tokens so far), paused as its `pause` says (Scheduler.pause: forwards
        pass while only paused requests are left); runs until every request is done or aborted."""
        return serve_arrivals(self, arrivals)

    @torch.no_grad()
    def score_uncached(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                       context_keys: Sequence[int] | None = None) -> list[TokenScores]:
        """What greedy decoding picks after each prefix of each (prompt, output): one forward over
        prompt + output without any KV cache per request (the cache is not touched)."""
        keys = [0] * len(requests) if context_keys is None else list(context_keys)
        scores = []
        for (prompt, output), key in zip(requests, keys, strict=True):
            if not output:
                scores.append(TokenScores([], [], []))
                continue
            ids = torch.tensor([*prompt, *output[:-1]], dtype=torch.int64, device=self.device)
            top = self.model.logits_without_cache(ids, key)[len(prompt) - 1:].float().topk(2, dim=-1)
            best, runner_up = top.indices.T.tolist()
            scores.append(TokenScores(best, runner_up, (top.values[:, 0] - top.values[:, 1]).tolist()))
        return scores

    def reset(self) -> None:
        """Drop all requests and flush the radix cache: every slot and row is free again, handed
        out in a new engine's order (forward_count keeps counting)."""
        if self._async is not None:
            self._async.settle()  # every launched forward over, its results dropped
        self.scheduler.reset()
        if self.host_tier is not None:
            self.host_tier.synchronize()  # every load-back over: its lock released
        self.jitter.restart()
        self.radix_cache.reset()  # the disk tier's files deleted with their nodes
        assert self.disk_tier is None or not self.disk_tier.index, "disk pages outlived the radix cache"
        self.pools.restart()
        if self.host_tier is not None:
            self.host_tier.restart()
        if self.states is not None:
            self.states.restart()
        self.req_to_token_pool.restart()
        self.token_table.fill_(-1)
        self._token_notes.clear()
        self._steps = 0
        self._finished = 0
        self._row_owners.clear()

    def liveness(self) -> dict[str, int]:
        """What the engine's workloads exercised since it started, for a soak's liveness gate:
        requests admitted with a cached prefix, retractions, pauses, and per path the engine has, pages
        loaded back from host memory, pages loaded from disk, proposals the target rejected and, with
        async scheduling, decodes moved back behind a launched decode's rejected proposals."""
        counts = {"prefix hits": self.scheduler.num_prefix_hits, "retractions": self.scheduler.num_retracted,
                  "pauses": self.scheduler.num_paused}
        if self.host_tier is not None:
            counts["host loads"] = self.host_tier.num_loaded_back
        if self.disk_tier is not None:
            counts["disk loads"] = self.disk_tier.num_loaded
        if self.drafter is not None:
            counts["rejected proposals"] = self.drafter.proposed - self.drafter.accepted
            if self._async is not None:
                counts["in-flight rollbacks"] = self._async.num_moved_back
        return counts

    def request_at(self, row: int, step: int) -> tuple[int, str] | None:
        """The request (id, prompt text) that held mapping row `row` at forward `step` since the
        last reset; None when none did."""
        owner = self._row_owners.at(row, step)
        return None if owner is None else (owner.rid, self.tokenizer.decode(owner.prompt_ids))

    def finished_requests(self) -> int:
        """Requests that finished here since the last reset (in a prefill/decode pair, those the
        prefill side finished itself: the others finish on the decode side)."""
        return self._finished

    # GuardedEngine
    def canary_groups(self) -> Sequence[PoolGroup]:
        full, swa, draft, table = self.pools.full, self.pools.swa, self.pools.draft, self.req_to_token_pool.table
        ps = self.config.page_size  # the table is a block table of FULL pages when > 1
        groups = [PoolGroup(GroupKind.FULL, full.k_layers, full.v_layers, full.num_slots, SlotMapping(table, ps))]
        if swa is not None:
            groups.append(PoolGroup(GroupKind.SWA, swa.k_layers, swa.v_layers, swa.num_slots,
                                    SlotMapping(table, ps, full_to_group=swa.full_to_swa),
                                    window=self.config.model.window))
        if draft is not None:
            groups.append(PoolGroup(GroupKind.DRAFT, draft.k_layers, draft.v_layers, draft.num_slots,
                                    SlotMapping(table, ps, full_to_group=draft.full_to_draft)))
        if self.states is not None:
            groups.append(PoolGroup(GroupKind.STATE, self.states.buffers, [], self.states.num_slots, None))
        if self.pools.indexer:  # sparse attention: the indexer keys, slot for slot the FULL pool's
            groups.append(PoolGroup(GroupKind.INDEXER, self.pools.indexer, [], full.num_slots, SlotMapping(table, ps)))
        if (scales := self.model.kv_scales) is not None:  # FP8 KV: the scales every forward dequantizes with
            groups.append(PoolGroup(GroupKind.SCALES, [scales.k], [] if scales.v is None else [scales.v],
                                    scales.k.shape[0], None))
        return groups

    def canary_capacities(self) -> Capacities:
        c = self.config
        return Capacities(max_batch=c.max_running, max_tokens=max(c.max_batch_tokens, c.max_running),
                          max_context=c.model.max_context)

    def add_free_listener(self, listener: FreeListener) -> None:
        """listener(group, FULL slots, cause) hears of every free (optional GuardedEngine extra)."""
        self.pools.free_listeners.append(listener)

    def cache_walk(self) -> CacheWalk:
        return self.radix_cache.walk()

    def checkpoint_walk(self) -> CheckpointWalk | None:
        """The radix cache's checkpoints (a hybrid model's; optional GuardedEngine extra)."""
        return None if self.states is None else self.radix_cache.checkpoint_walk()

    def feed_token(self, view: ForwardView, index: int, token: int) -> None:
        """The forward about to run embeds `token` at view token `index` (optional GuardedEngine
        extra): the view's input_ids are the tensor the forward consumes."""
        view.input_ids[index] = token

    def _run(self, batch: Batch | None) -> list[Request]:
        """Forward and account one batch; returns the requests that finished in it. None: idle,
        which is a stall while requests wait (nothing running frees what they need)."""
        if batch is None:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        try:
            new_tokens = self._forward(batch)
        except BaseException:
            self.scheduler.abort(batch)
            raise
        return self._account(batch, new_tokens)

    def _account(self, batch: Batch, new_tokens: list[list[int]]) -> list[Request]:
        """Process a forward's results (Scheduler.process); returns the requests that finished."""
        if self.drafter is not None and not batch.is_prefill:
            self.drafter.count(batch.extend_lens, new_tokens)
        finished = self.scheduler.process(batch, new_tokens)
        if self.host_tier is not None:  # load-backs whose copies are over release their locks
            self.host_tier.acknowledge()
        self._finished += len(finished)
        return finished

    @torch.no_grad()
    def _forward(self, batch: Batch,
                 on_device: bool = False) -> list[list[int]] | tuple[torch.Tensor, torch.Tensor]:
        """The model forward over the batch (hooks around it; the draft model, if any, first,
        inside them); each request's new tokens: its greedy next token, or in a speculative decode
        the proposals the target accepted and its own next token. on_device: the same on the
        device, the host not waiting for them: the tokens padded ([B, max extend]) and how many are
        each request's ([B]). batch.input_ids, positions and out_cache_loc may be device tensors
        (async scheduling fills in what the host does not know)."""
        hooks = self._hooks
        if self.host_tier is not None:  # no forward reads a page before it is loaded back, nor
            self.host_tier.wait()  # rewrites one before it is written back
        self._note_rows(batch)
        if not batch.is_prefill and self._decode is not None:
            tokens = self._decode.run(hooks, batch.rows, batch.prefix_lens, batch.input_ids,
                                      batch.positions.tolist(), [r.context_key for r in batch.reqs],
                                      batch.state_slots)
            self._forwarded(hooks)
            return (tokens.clone()[:, None], torch.ones_like(tokens)) if on_device else [[t] for t in tokens.tolist()]
        view = self._view(batch)
        spin = self.jitter.spin_at  # a GPU's spin points (jitter.py); nothing on a CPU or when off
        spin(self.device)
        if hooks is not None:
            hooks.before_forward(view)
        spin(self.device)
        on_store = None if hooks is None else hooks.kv_stored
        contexts = view.context_keys.repeat_interleave(view.extend_lens)
        if self.drafter is not None:
            draft = view.group_inputs[GroupKind.DRAFT]
            run = self.drafter.prefill if batch.is_prefill else self.drafter.draft
            run(batch, draft.input_ids, view.positions, draft.positions, contexts, on_store)
        kv = PagedKV(self.pools, self.req_to_token_pool.table, batch.rows, batch.prefix_lens,
                     batch.extend_lens, view.positions, batch.out_cache_loc.to(self.device), on_store=on_store,
                     codec=self.model.kv_codec, scales=view.scales) if view.selected is None else PagedSparseKV(
            self.pools, self.req_to_token_pool.table, batch, view, batch.out_cache_loc.to(self.device), hooks)
        states = None if self.states is None else PooledState(
            self.states, batch.state_slots, batch.prefix_lens, batch.extend_lens, batch.checkpoint_slots,
            batch.checkpoint_lens)
        hidden = self.model(view.input_ids, view.positions, kv, contexts, states)
        spin(self.device)
        if hooks is not None:
            hooks.after_forward(view)
        spin(self.device)
        self._forwarded(hooks)
        if self.drafter is not None and not batch.is_prefill:
            predicted = self.model.compute_logits(hidden).argmax(-1)
            if on_device:
                return self.drafter.accept_on_device(batch, view.input_ids, predicted)
            return self.drafter.accept(batch, view.input_ids, predicted.tolist())
        last = torch.tensor(batch.extend_lens, device=self.device).cumsum(0) - 1
        tokens = self.model.compute_logits(hidden[last]).argmax(-1)
        return (tokens[:, None], torch.ones_like(tokens)) if on_device else [[t] for t in tokens.tolist()]

    def _forwarded(self, hooks: ForwardHooks | None) -> None:
        self.forward_count += 1
        self._steps += 1
        if hooks is not None:
            hooks.end_forward()

    def _note_rows(self, batch: Batch) -> None:
        """Who holds each row from this forward on (request_at), and each row's tokens in
        token_table: the tokens the host knows, -1 past them (a speculative decode's proposals stay
        -1 until the draft proposes them), but an async step's input, which the step before it
        sampled and wrote there on the device."""
        known = [req.token_ids[:prefix + extend] for req, prefix, extend in
                 zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
        for req, row in zip(batch.reqs, batch.rows):
            self._row_owners.note(row, self._steps, req)
        ends = ([p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)] if self._async is not None
                else [len(ids) for ids in known])
        self._token_notes.note(batch.rows, batch.reqs, known, ends)

    def _view(self, batch: Batch) -> ForwardView:
        """The batch on the engine's device. Its input_ids and positions are the tensors the
        forward consumes (the model and, in a prefill, the draft read them; a speculative decode's
        draft writes its proposals into input_ids), so TAIL checks what the forward used against
        the bookkeeping (token_table, prefix_lens). The draft's forwards (speculative decoding) run
        at positions of their own: they fill the DRAFT group's positions, from which its model reads
        them."""

        def on_device(values: list[int] | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64).to(self.device)

        input_ids, positions = on_device(batch.input_ids), on_device(batch.positions)
        draft = None
        if self.drafter is not None:  # -1: no draft forward ran there yet
            draft = {GroupKind.DRAFT: GroupInputs(input_ids, torch.full_like(positions, -1))}
        state = None
        if self.states is not None:  # the slots PooledState reads and writes
            width = max(1, *map(len, batch.checkpoint_slots))
            state = StateInputs(on_device(batch.state_slots),
                                on_device([s + [0] * (width - len(s)) for s in batch.checkpoint_slots]),
                                on_device([n + [0] * (width - len(n)) for n in batch.checkpoint_lens]))
        return ForwardView(
            rows=on_device(batch.rows),
            prefix_lens=on_device(batch.prefix_lens),
            extend_lens=on_device(batch.extend_lens),
            input_ids=input_ids,
            positions=positions,
            token_table=self.token_table,
            context_keys=on_device([r.context_key for r in batch.reqs]),
            group_inputs=draft,
            state=state,
            scales=self.model.kv_scales,
            selected=empty_selection(positions.shape[0], self.config.model.index_topk, self.device)
            if self.pools.indexer else None,  # sparse attention: each layer's indexer fills it
        )
