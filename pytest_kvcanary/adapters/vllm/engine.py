"""VllmEngine: an in-process vLLM ``LLM`` (the CPU build) as an EngineUnderTest.

The canary reaches vLLM only through vLLM's KV-connector interface (connector.py): vLLM itself
schedules, allocates blocks, caches prefixes and computes; the adapter watches.

- Pools: one FULL group over the full-attention layers and, for a model with sliding-window layers,
  one SWA group over those (window: the positions before a token that its attention reads, the
  sliding window minus the token itself). Both address slots as vLLM does, ``block * block_size +
  offset``; with the canary's connector vLLM runs without its hybrid allocator (its rule for
  connectors without hybrid support), so both groups share one block table and sliding-window
  layers keep every block. Per group and half, one buffer per (layer, KV head): vLLM's CPU cache
  keeps heads apart. Each half's order is probed (layout.py): on vLLM's portable CPU paths V is
  stored token by token and K dimension-major inside a block; the fingerprint reads both (K
  element by element).
- Mapping: a block table the adapter owns, ``[max_num_seqs, blocks per context]``; row b holds
  the block ids of the step's b-th scheduled request, refilled before every forward.
- Views: per forward, from the scheduler's own step (blocks.py): prefix_len = vLLM's computed
  tokens, extend_len = its scheduled tokens, the tokens the scheduler holds, and a token table.
- Block 0 is vLLM's null block: its pool never hands it to a request, so slot 0 (the canary's
  reserved sentinel) is never written.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from kvcanary_kernels.records import GroupKind, Half
from pytest_kvcanary.canary.seam import (
    CacheWalk, Capacities, ForwardHooks, ForwardView, FreeListener, PoolGroup, SlotMapping,
)

from .blocks import BlockBook, RowPlan
from .connector import CONFIG_KEY, registry
from .isa import attention_isa, check_attention_isa, default_attention_isa
from .layout import half_views, probe, probe_latent
from .write_through import WriteThrough


@dataclass(frozen=True)
class VllmSettings:
    """The LLM the adapter starts. block_size: what it asks for (vLLM's CPU attention needs a
    multiple of 32; its CPU MLA backend sets 16 itself). num_blocks includes vLLM's null block and
    must hold one max_model_len request; dtype as vLLM's ``dtype`` argument. attention_isa: the
    instruction-set path of vLLM's CPU attention, which decides its KV layout (isa.py: readable,
    vllm, amx, vec, vec16; default the environment variable KVCANARY_VLLM_ATTENTION_ISA, else
    readable)."""

    block_size: int = 32
    max_num_seqs: int = 8
    max_model_len: int = 512
    max_num_batched_tokens: int = 512
    num_blocks: int = 128
    prefix_caching: bool = True
    dtype: str = "auto"
    attention_isa: str = field(default_factory=default_attention_isa)

    def __post_init__(self) -> None:
        check_attention_isa(self.attention_isa)

    def llm_arguments(self, model: str | Path, seed: int) -> dict[str, Any]:
        """vLLM ``LLM(...)`` keyword arguments for this model, without the canary's connector."""
        return dict(model=str(model), tokenizer=str(model), seed=seed, dtype=self.dtype, enforce_eager=True,
                    async_scheduling=False, block_size=self.block_size, max_model_len=self.max_model_len,
                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    num_gpu_blocks_override=self.num_blocks, enable_prefix_caching=self.prefix_caching,
                    # The pool is num_blocks; a KV budget (any that fits in memory) keeps vLLM's CPU
                    # worker from reserving a fraction of the machine's memory instead.
                    kv_cache_memory_bytes=1 << 26, disable_log_stats=False)


class VllmEngine:
    """Attributes for tools that reach inside: ``llm`` (the vLLM LLM), ``book`` (the BlockBook),
    ``forwards`` (forwards seen since start-up)."""

    def __init__(self, model: str | Path, seed: int, settings: VllmSettings | None = None) -> None:
        """settings: VllmSettings() as of this call (the environment read now) when None."""
        from vllm import LLM

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's two sides share this process
        self.settings = s = settings if settings is not None else VllmSettings()
        self.book = BlockBook(self._freed)
        self.forwards = 0
        self._hooks: ForwardHooks | None = None
        self._listeners: list[FreeListener] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._view: ForwardView | None = None
        self._steps: list[list[int]] = []  # per forward since the last reset: the book id of each row
        self._write_through = WriteThrough(self._kv_stored)
        key = uuid.uuid4().hex
        registry.add(key, self)
        registry.building = self
        try:
            with attention_isa(s.attention_isa):
                self.llm = LLM(**s.llm_arguments(model, seed), kv_transfer_config={
                    "kv_connector": "CanaryConnector", "kv_role": "kv_both",
                    "kv_connector_module_path": "pytest_kvcanary.adapters.vllm.connector",
                    "kv_connector_extra_config": {CONFIG_KEY: key}})
        finally:
            registry.building = None
        self.block_size = bs = self.llm.llm_engine.vllm_config.cache_config.block_size  # vLLM may change it
        self._table = torch.zeros(s.max_num_seqs, -(-s.max_model_len // bs), dtype=torch.int64)
        self._token_table = torch.full((s.max_num_seqs, s.max_model_len), -1, dtype=torch.int64)
        self._groups = self._pool_groups()

    # What the connector calls ---------------------------------------------------------------

    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def before_forward(self, rows: list[RowPlan]) -> None:
        """Map the step's rows into the table and the view, then HEAD."""
        for b, row in enumerate(rows):
            self._table[b, :len(row.blocks)] = torch.tensor(row.blocks, dtype=torch.int64)
            self._table[b, len(row.blocks):] = 0
            self._token_table[b, :len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.int64)
            self._token_table[b, len(row.tokens):] = -1
        bs = self.block_size
        # Per written token, in view order: position, token, slot.
        positions, input_ids, slots = torch.tensor(
            [(p, row.tokens[p], row.blocks[p // bs] * bs + p % bs)
             for row in rows for p in range(row.prefix_len, row.prefix_len + row.extend_len)],
            dtype=torch.int64).reshape(-1, 3).T.contiguous()
        self._view = ForwardView(
            rows=torch.arange(len(rows), dtype=torch.int64),
            prefix_lens=torch.tensor([row.prefix_len for row in rows], dtype=torch.int64),
            extend_lens=torch.tensor([row.extend_len for row in rows], dtype=torch.int64),
            input_ids=input_ids,
            positions=positions,
            token_table=self._token_table,
        )
        self._steps.append([row.request for row in rows])
        self._write_through.start_forward(slots)
        if self._hooks is not None:
            self._hooks.before_forward(self._view)

    def after_forward(self) -> None:
        """The forward wrote its K/V: RECHECK and TAIL, then the host side of the forward."""
        view, self._view = self._view, None
        assert view is not None, "wait_for_save without a bound step"
        self._write_through.end_forward()
        self.forwards += 1
        if self._hooks is not None:
            self._hooks.after_forward(view)
            self._hooks.end_forward()

    # EngineUnderTest -------------------------------------------------------------------------

    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self._hooks = hooks

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy output ids per prompt (vLLM's own generate, EOS ignored so each runs
        max_new_tokens)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        planned = self.book.planned
        seen = self.forwards
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        if self.book.planned - planned != self.forwards - seen:
            raise RuntimeError(f"vLLM ran {self.book.planned - planned} forwards but the canary's connector saw "
                               f"{self.forwards - seen}: its worker side is not this process's KV connector")
        return [list(o.outputs[0].token_ids) for o in outputs]

    def reset(self) -> None:
        """Abort what is left of any request and flush vLLM's prefix cache (listeners hear every
        block's data go)."""
        engine = self.llm.llm_engine
        engine.abort_request(list(engine.output_processor.request_states))
        if not self.llm.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM could not reset its prefix cache: blocks are still held")
        self._steps.clear()

    def add_free_listener(self, listener: FreeListener) -> None:
        self._listeners.append(listener)

    @property
    def prefix_caching(self) -> bool:
        """Whether vLLM runs with its prefix cache (its CPU build turns it off for latent (MLA)
        attention whatever the settings ask)."""
        return bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)

    def request_at(self, row: int, step: int) -> tuple[int, str] | None:
        """The request (the book's id, prompt text) at mapping row `row` in forward `step` since
        the last reset."""
        if not (0 <= step < len(self._steps) and 0 <= row < len(self._steps[step])):
            return None
        request = self._steps[step][row]
        return request, self.llm.get_tokenizer().decode(self.book.prompt(request))

    # CanaryHost ------------------------------------------------------------------------------

    def canary_groups(self) -> Sequence[PoolGroup]:
        return self._groups

    def canary_capacities(self) -> Capacities:
        s = self.settings
        # A row may also count as computing prefix blocks another row computes (blocks.py), so
        # a forward's view can hold up to a whole context per row.
        return Capacities(max_batch=s.max_num_seqs, max_tokens=s.max_num_seqs * s.max_model_len,
                          max_context=s.max_model_len)

    def cache_walk(self) -> CacheWalk | None:
        return self.book.walk()

    # Internals -------------------------------------------------------------------------------

    def _pool_groups(self) -> list[PoolGroup]:
        layers = self.llm.llm_engine.vllm_config.compilation_config.static_forward_context
        names = list(self._kv_caches)
        if not names:
            raise RuntimeError("vLLM registered no KV caches with the canary's connector")
        first, cache = layers[names[0]], self._kv_caches[names[0]]
        bs = self.block_size
        num_slots = cache.shape[0] * bs
        backend = first.attn_backend.get_name()
        if backend == "CPU_MLA":  # one latent row per token: a pool with a single half
            latent = [self._kv_caches[n].view(cache.shape[0], bs, cache.shape[-1]) for n in names]
            fingerprintable = probe_latent(first, latent[0])
            for i, name in enumerate(names):
                self._write_through.wrap_latent(layers[name], GroupKind.FULL, i)
            return [PoolGroup(GroupKind.FULL, latent, [], num_slots, SlotMapping(self._table, page_size=bs),
                              page_size=bs, fingerprintable=fingerprintable)]
        if backend != "CPU_ATTN":
            raise NotImplementedError(f"the vLLM adapter knows the KV layouts of vLLM's CPU_ATTN and CPU_MLA "
                                      f"attention backends; got {backend}")
        orders = probe(first, cache)
        if None in orders.values():
            raise NotImplementedError(
                f"vLLM's CPU attention runs its {first.isa!r} path here, whose KV layout the adapter does not know "
                f"(orders found: {orders}); attention_isa='readable' (the default) runs a path it knows")
        windows = {layers[n].sliding_window for n in names} - {None}
        if len(windows) > 1:
            raise NotImplementedError(f"one sliding window per model; got {sorted(windows)}")
        groups = []
        for kind, window in [(GroupKind.FULL, None)] + [(GroupKind.SWA, w) for w in windows]:
            views = half_views([self._kv_caches[n] for n in names if layers[n].sliding_window == window], orders)
            opaque = frozenset(h for h, v in views.items() if not v.readable)
            # Sliding-window layers use the FULL slots themselves: saying so (an identity map)
            # lets the prefix-cache walk reach them.
            mapping = SlotMapping(self._table, page_size=bs,
                                  full_to_group=None if window is None else torch.arange(num_slots))
            groups.append(PoolGroup(
                kind, views[Half.K].views, views[Half.V].views, num_slots, mapping, page_size=bs,
                window=None if window is None else window - 1, fingerprintable=len(opaque) < len(views),
                opaque_halves=opaque))
            heads = cache.shape[1]
            named = [n for n in names if layers[n].sliding_window == window]
            parts = {half: len(v.views) // (len(named) * heads) for half, v in views.items()}  # views per head
            for i, name in enumerate(named):
                self._write_through.wrap(layers[name], kind, i * heads, parts)
        return groups

    def _kv_stored(self, kind: GroupKind, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        if self._hooks is not None:
            self._hooks.kv_stored(kind, layer, k, v)

    def _freed(self, blocks: list[int], cause: str) -> None:
        bs = self.block_size
        slots = (torch.tensor(blocks, dtype=torch.int64)[:, None] * bs + torch.arange(bs)).flatten()
        for listener in self._listeners:
            for group in self._groups:
                listener(group.kind, slots, cause)
