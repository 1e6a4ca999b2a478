"""The reference engine: model + KV pools + radix cache + scheduler, one forward per step.

    step -> Scheduler.schedule -> hooks.before_forward -> model (PagedKV) -> hooks.after_forward
         -> greedy sample -> Scheduler.process

It is a `CanaryHost`: the canary runtime attaches through `canary_groups` / `req_to_token` /
`radix_walk` and is called around every forward through `set_forward_hooks`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.host import ForwardHooks, ForwardView, PoolGroup, RadixWalk

from .attention import PagedKV
from .config import EngineConfig
from .kv_pool import FreeListener, KVPools, ReqToTokenPool
from .model import CausalLM
from .radix_cache import RadixCache
from .request import Request
from .scheduler import Batch, Scheduler
from .tokenizer import ByteTokenizer
from .weights import load_weights


class Engine:
    """Attributes for tools that reach inside: ``model``, ``pools`` (FULL ``pools.full`` and SWA
    ``pools.swa`` KV pools, ``pools.swa.full_to_swa``), ``req_to_token_pool`` (``.table``),
    ``radix_cache``, ``scheduler`` (``running`` / ``waiting`` requests; each running request has
    ``row``, ``kv_len``, ``prefix_len``, ``token_ids``), ``forward_count``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model = CausalLM(config.model)
        if config.checkpoint is not None:
            load_weights(self.model, config.checkpoint)
        self.model.to(self.device)
        self.tokenizer = ByteTokenizer()
        self.pools = KVPools(config)
        self.req_to_token_pool = ReqToTokenPool(config.max_running, config.model.max_context, self.device)
        window = config.model.window if self.pools.swa is not None else None
        self.radix_cache = RadixCache(self.pools, self.req_to_token_pool, window)
        self.scheduler = Scheduler(config, self.pools, self.req_to_token_pool, self.radix_cache)
        self.forward_count = 0
        self._hooks: ForwardHooks | None = None
        self._next_rid = 0

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self._hooks = hooks

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int) -> Request:
        """Queue a request; raises ValueError for an empty or too long prompt, a bad token id or
        max_new_tokens, or a request the pools could not hold even alone."""
        m = self.config.model
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
        if bad := [t for t in ids if not 0 <= t < m.vocab_size]:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={m.vocab_size}); got {bad[0]}")
        total = len(ids) + max_new_tokens
        if total > m.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                             f"exceeds max_context ({m.max_context})")
        for name, pool in (("num_slots", self.pools.full), ("swa_num_slots", self.pools.swa)):
            if pool is not None and total - 1 > pool.num_slots - 1:  # slot 0 is reserved
                raise ValueError(f"pool too small for a single request: it needs {total - 1} KV slots, "
                                 f"{name}={pool.num_slots} holds {pool.num_slots - 1}")
        req = Request(self._next_rid, ids, max_new_tokens)
        self._next_rid += 1
        self.scheduler.waiting.append(req)
        return req

    def step(self) -> list[Request]:
        """Run one forward; returns the requests that finished in it ([] when idle). If the
        forward raises (a hook, say), its requests go back to waiting and the error propagates."""
        return self._run(self.scheduler.schedule())

    def prefill_for_transfer(self) -> list[Request]:
        """The prefill side of a disaggregated pair: one prefill forward over waiting requests
        (never a decode; [] when none is waiting). Returns the prefilled requests that still need
        decoding: they stay running here, their KV cached by the radix cache (a duplicate prompt of
        the batch shares the first copy's slots, its own freed), until `scheduler.finish(req)`.
        Raises RuntimeError when requests wait but none fits beside those still held."""
        batch = self.scheduler.schedule_prefill()
        finished = self._run(batch)
        return [] if batch is None else [r for r in batch.reqs if r not in finished]

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy output token ids per prompt, in order (runs until every queued request is done)."""
        reqs = [self.submit(p, max_new_tokens) for p in prompts]
        while self.scheduler.has_work:
            self.step()
        return [r.output_ids for r in reqs]

    def reset(self) -> None:
        """Drop all requests and flush the radix cache: every slot and row is free again, handed
        out in a new engine's order (forward_count keeps counting)."""
        self.scheduler.reset()
        self.radix_cache.reset()
        self.pools.restart()
        self.req_to_token_pool.restart()

    # CanaryHost
    def canary_groups(self) -> Sequence[PoolGroup]:
        full, swa = self.pools.full, self.pools.swa
        groups = [PoolGroup(GroupKind.FULL, full.k_layers, full.v_layers, full.num_slots)]
        if swa is not None:
            groups.append(PoolGroup(GroupKind.SWA, swa.k_layers, swa.v_layers, swa.num_slots,
                                    window=self.config.model.window, full_to_group=swa.full_to_swa))
        return groups

    def add_free_listener(self, listener: FreeListener) -> None:
        """listener(group, FULL slots, cause) hears of every free (optional CanaryHost extra)."""
        self.pools.free_listeners.append(listener)

    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.table

    def radix_walk(self) -> RadixWalk:
        return self.radix_cache.walk()

    def _run(self, batch: Batch | None) -> list[Request]:
        """Forward and account one batch; returns the requests that finished in it. None: idle,
        which is a stall while requests wait (nothing running frees what they need)."""
        if batch is None:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        try:
            next_tokens = self._forward(batch)
        except BaseException:
            self.scheduler.abort(batch)
            raise
        return self.scheduler.process(batch, next_tokens)

    @torch.no_grad()
    def _forward(self, batch: Batch) -> list[int]:
        """The model forward over the batch (hooks around it); greedy next token per request."""
        hooks = self._hooks
        view = self._view(batch) if hooks is not None else None
        if hooks is not None:
            hooks.before_forward(view)
        positions = batch.positions.to(self.device)
        kv = PagedKV(self.pools, self.req_to_token_pool.table, [r.row for r in batch.reqs], batch.prefix_lens,
                     batch.extend_lens, positions, batch.out_cache_loc.to(self.device))
        hidden = self.model(batch.input_ids.to(self.device), positions, kv)
        self.forward_count += 1
        if hooks is not None:
            hooks.after_forward(view)
        last = torch.tensor(batch.extend_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last]).argmax(-1).tolist()

    def _view(self, batch: Batch) -> ForwardView:
        return ForwardView(
            rows=torch.tensor([r.row for r in batch.reqs], dtype=torch.int64),
            prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.int64),
            extend_lens=torch.tensor(batch.extend_lens, dtype=torch.int64),
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            prefix_token_ids=[torch.tensor(r.token_ids[:p], dtype=torch.int64)
                              for r, p in zip(batch.reqs, batch.prefix_lens)],
        )
