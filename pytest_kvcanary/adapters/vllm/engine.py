"""VllmEngine: an in-process vLLM ``LLM`` (its CPU or CUDA build) as an EngineUnderTest.

The canary reaches vLLM through vLLM's KV-connector interface (connector.py: the step's scheduled
requests, frees, the prefix cache) and a forward pre-hook on its model (forward_inputs.py: what
the forward consumes); vLLM itself schedules, allocates blocks, caches prefixes and computes, and
the adapter watches. Pools: a FULL group over the full-attention layers, for a model with
sliding-window layers an SWA group over those (pools.py), one buffer per (layer, KV head), each
half's byte order probed at start-up (layout.py); slot = ``block * block_size + offset``, block 0
(vLLM's null block) the reserved slot. The mapping is a block table the adapter owns, refilled
before every forward from the one the forward's attention reads (the SWA group maps through it and
a full-to-window slot map, window_map.py); the slots the forward stores to are checked through
write-through. A hybrid model's recurrent state is a STATE group over vLLM's mamba blocks (states.py);
an FP8 cache's dequantization scales are a SCALES group, each forward's in its view (kv_scales.py).
Every vLLM object the adapter patches (the model's pre-hook, each layer impl's cache write, the
sliding-window managers' drops) is recorded in the engine's Patches (../patches.py), which
`VllmEngine.close` undoes. docs/vllm.md says how each part is wired and what is and is not guarded.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pytest_kvcanary.canary.seam import (
    Arrival, CacheWalk, Capacities, CheckpointWalk, ForwardHooks, ForwardView, FreeListener, GroupKind, PoolGroup,
    TokenScores,
)

from ..patches import Patches
from . import forward_inputs
from .blocks import BlockBook, RowPlan
from .connector import CONFIG_KEY, registry
from .fp8 import check_kv_cache_dtype, default_kv_cache_dtype, quantized
from .isa import attention_isa, check_attention_isa, default_attention_isa, latent_backend
from .kv_scales import KvScales
from .platform import (
    check_device, check_graph_mode, check_model_runner, default_attention_backend, default_cuda_graphs,
    engine_arguments, engine_environment,
)
from .pools import pool_groups
from .states import States
from .versions import unbound_kv_cache_manager
from .write_through import WriteThrough, rows_by_slot


def _expert_group() -> None:
    """vLLM creates its expert-parallel group when the process's first LLM initializes its
    model-parallel groups, and only for a mixture-of-experts model: one built later in the same
    process (the hybrid kind's Qwen3-Next after a Llama) would find none. Create it then, over the
    world group's ranks, as vLLM does for one rank."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return
    world = parallel_state.get_world_group()
    parallel_state._EP = parallel_state.init_model_parallel_group(
        [list(range(world.world_size))], world.local_rank, torch.distributed.get_backend(world.device_group),
        group_name="ep")


@dataclass(frozen=True)
class VllmSettings:
    """The LLM the adapter starts. block_size: what it asks for (vLLM's CPU attention needs a
    multiple of 32; its CPU MLA backend sets 16 itself). num_blocks includes vLLM's null block and
    must hold one max_model_len request (for a sliding-window model, its sliding-window blocks too:
    vLLM's hybrid KV cache manager draws both from one pool); dtype as vLLM's ``dtype`` argument. attention_isa: the
    instruction-set path of vLLM's CPU attention, which decides its KV layout (isa.py: readable,
    vllm, amx, vec, vec16; default the environment variable KVCANARY_VLLM_ATTENTION_ISA, else
    readable; under pytest the run's --kv-canary-vllm-attention-isa, which vllm_hooks.py resolves
    and hands over). device: cpu (vLLM's CPU build) or cuda (its CUDA build, platform.py); cuda_graphs
    (CUDA only; default KVCANARY_VLLM_CUDA_GRAPHS): PIECEWISE CUDA graphs instead of eager;
    attention_backend (CUDA only; default KVCANARY_VLLM_ATTENTION_BACKEND): FLASH_ATTN or
    FLASHINFER, None for vLLM's choice. kv_cache_dtype: what vLLM's KV cache stores (fp8.py: auto, the
    model's dtype, or fp8, fp8_e4m3, fp8_e5m2; default the environment variable
    KVCANARY_VLLM_KV_CACHE_DTYPE, else auto; under pytest the run's --kv-canary-vllm-kv-cache-dtype)."""

    block_size: int = 32
    max_num_seqs: int = 8
    max_model_len: int = 512
    max_num_batched_tokens: int = 512
    num_blocks: int = 128
    prefix_caching: bool = True
    dtype: str = "auto"
    attention_isa: str = field(default_factory=default_attention_isa)
    device: str = "cpu"
    cuda_graphs: bool = field(default_factory=default_cuda_graphs)
    attention_backend: str | None = field(default_factory=default_attention_backend)
    kv_cache_dtype: str = field(default_factory=default_kv_cache_dtype)

    def __post_init__(self) -> None:
        check_attention_isa(self.attention_isa)
        check_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "device", check_device(self.device))

    def llm_arguments(self, model: str | Path, seed: int) -> dict[str, Any]:
        """vLLM ``LLM(...)`` keyword arguments for this model, without the canary's connector."""
        # The pool is num_blocks; a KV budget (any that fits in memory) keeps vLLM's CPU worker from
        # reserving a fraction of the machine's memory instead (platform.py).
        platform = engine_arguments(self.device, self.cuda_graphs, self.attention_backend)
        latent = latent_backend(self.attention_isa) if self.device == "cpu" else {}
        return dict(model=str(model), tokenizer=str(model), seed=seed, dtype=self.dtype,
                    async_scheduling=False, block_size=self.block_size, max_model_len=self.max_model_len,
                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    num_gpu_blocks_override=self.num_blocks, enable_prefix_caching=self.prefix_caching,
                    kv_cache_dtype=self.kv_cache_dtype, disable_log_stats=False, **platform, **latent)


class VllmEngine:
    """Attributes for tools that reach inside: ``llm`` (the vLLM LLM), ``book`` (the BlockBook),
    ``forwards`` (forwards seen since start-up), ``patches`` (every patch of vLLM objects installed,
    undone by `close`)."""

    def __init__(self, model: str | Path, seed: int, settings: VllmSettings | None = None) -> None:
        """settings: VllmSettings() as of this call (the environment read now) when None."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's two sides share this process
        self.settings = s = settings if settings is not None else VllmSettings()
        os.environ.update(engine_environment(s.device))
        self.patches = Patches()  # before the LLM: vLLM 0.30+ binds the book's manager while it builds
        self.book = BlockBook(self._freed, self.patches)
        self.forwards = 0
        self._hooks: ForwardHooks | None = None
        self._listeners: list[FreeListener] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._plan: dict[str, RowPlan] | None = None  # the bound step's rows by vLLM request id
        self._view: ForwardView | None = None
        self._inputs: forward_inputs.ForwardInputs | None = None  # what the forward under way consumes
        self._steps: list[list[int]] = []  # per forward since the last reset: the book id of each row
        self._write_through = WriteThrough(self._kv_stored, self.patches)
        self._key = uuid.uuid4().hex
        registry.add(self._key, self)
        try:
            self._start(model, seed)
        except BaseException:
            self.close()  # a failed start-up leaves vLLM's objects as they were
            raise

    def _start(self, model: str | Path, seed: int) -> None:
        """Build the LLM with the canary's connector, then the pools and the model's pre-hook."""
        from vllm import LLM

        s = self.settings
        _expert_group()
        registry.building = self
        try:
            with attention_isa(s.attention_isa) if s.device == "cpu" else contextlib.nullcontext():
                self.llm = LLM(**s.llm_arguments(model, seed), kv_transfer_config={
                    "kv_connector": "CanaryConnector", "kv_role": "kv_both",
                    "kv_connector_module_path": "pytest_kvcanary.adapters.vllm.connector",
                    "kv_connector_extra_config": {CONFIG_KEY: self._key}})
        finally:
            registry.building = None
        if (manager := unbound_kv_cache_manager(self.llm)) is not None:
            self.book.bind(manager)
        self.block_size = bs = self.llm.llm_engine.vllm_config.cache_config.block_size  # vLLM may change it
        self._runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        check_model_runner(self._runner)
        self.device = dev = torch.device(s.device)
        # The CUDA-graph mode vLLM runs (NONE on CPU); a mode the canary cannot follow is refused.
        self.graph_mode = "NONE" if s.device == "cpu" else check_graph_mode(self.llm.llm_engine.vllm_config,
                                                                             self._runner.model)
        self._table = torch.zeros(s.max_num_seqs, -(-s.max_model_len // bs), dtype=torch.int64, device=dev)
        self._token_table = torch.full((s.max_num_seqs, s.max_model_len), -1, dtype=torch.int64, device=dev)
        kv_groups = self._runner.kv_cache_config.kv_cache_groups
        self._group_layers = [group.layer_names[0] for group in kv_groups]  # a layer per vLLM KV cache group
        self._full_group = self.book.full_group
        layers = self.llm.llm_engine.vllm_config.compilation_config.static_forward_context
        recurrent = self.book.state_groups
        attention = {name: cache for name, cache in self._kv_caches.items()
                     if not any(name in kv_groups[g].layer_names for g in recurrent)}
        # the CUDA cache layout found (layout.PagedLayout; None on CPU) and the SWA group's slot map
        self._groups, self._window, self.layout = pool_groups(
            layers, attention, self._table, bs, self._runner.kv_cache_config.num_blocks, self._hybrid,
            self._write_through)
        # a hybrid model's recurrent states (states.py): the first recurrent group's, guarded as the STATE group
        self._states = None if not recurrent else States(
            layers, kv_groups[recurrent[0]].layer_names, recurrent[0], self._runner.kv_cache_config, self.patches, dev)
        if self._states is not None:
            self._groups.append(self._states.group)
        # an FP8 cache's dequantization scales (kv_scales.py): the SCALES group
        self._scales = KvScales([layers[name] for name in attention], self.patches) if quantized(
            s.kv_cache_dtype) else None
        if self._scales is not None:
            self._groups.append(self._scales.group)
        hook = self._runner.model.register_forward_pre_hook(self._model_called, with_kwargs=True)
        self.patches.on_uninstall(hook.remove)

    def close(self) -> None:
        """Undo every patch the engine installed on vLLM's objects (the model's pre-hook, the
        layers' cache writes, the sliding-window managers' drops), last first, and drop the engine
        from the connector's registry. vLLM's LLM itself is not shut down: its objects are left as
        vLLM built them, but it serves no request after (its connector finds no engine under its
        key). Neither is used after; a second call does nothing. The harness calls it when the
        engine's side closes (handles/sided.py); a start-up that fails calls it too."""
        self.patches.uninstall()
        registry.discard(self._key)

    # What the connector calls ---------------------------------------------------------------

    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def bind(self, rows: list[RowPlan]) -> None:
        """The scheduler's rows of the step whose forward comes next."""
        self._plan = {row.request_id: row for row in rows}

    def _model_called(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """vLLM calls its model (a forward pre-hook): map what it hands the forward into the table
        and the view, then HEAD. A forward without a bound step is vLLM's own (profiling, warm-up)."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        self._inputs = inputs = forward_inputs.read(self._runner, kwargs, self._group_layers)
        rows = [plan[rid] for rid in inputs.request_ids]
        self._view, index = self._map(inputs, rows)
        if self._scales is not None:
            self._view = replace(self._view, scales=self._scales.inputs())
        if self._states is not None:
            self._view = replace(self._view, state=self._states.inputs(len(rows)))
            self._states.announce(self._hooks)  # the state copies made for this forward, before its HEAD
        if self._hybrid:
            self._window.pair(inputs, self._view, self._full_group, self.book.window_groups[0], self._groups[1].window,
                              self.book.window_pairs())
        self._steps.append([row.request for row in rows])
        self._write_through.start_forward(index)
        if self._hooks is not None:
            self._hooks.before_forward(self._view)
        if self._scales is not None:
            self._scales.feed()  # the scales HEAD checked are the ones the ops receive

    def _map(self, inputs: forward_inputs.ForwardInputs, rows: list[RowPlan]
             ) -> tuple[ForwardView, torch.Tensor | None]:
        """The view of the forward and, per view token, its row in vLLM's batch (write-through's
        index; None when it cannot be told). vLLM's CPU build keeps its inputs on the host: reading
        their values here costs no device sync; on CUDA, reading the prefix lengths waits for the
        step's input preparation (one sync a forward)."""
        n, dev = len(rows), self.device
        full = inputs.block_tables[self._full_group]
        width = min(full.shape[1], self._table.shape[1])
        self._table[:n, :width].copy_(full[:, :width])
        self._table[:n, width:] = 0
        tokens = np.full((n, self._token_table.shape[1]), -1, dtype=np.int64)
        for b, row in enumerate(rows):  # a list into numpy: no tensor a row
            tokens[b, :len(row.tokens)] = row.tokens
        self._token_table[:n].copy_(torch.from_numpy(tokens))
        qsl = inputs.query_start_loc.to(torch.int64)
        extend = qsl[1:] - qsl[:-1]
        prefix = inputs.seq_lens.to(torch.int64) - extend
        view = ForwardView(rows=torch.arange(n, dtype=torch.int64, device=dev), prefix_lens=prefix,
                           extend_lens=extend, input_ids=inputs.input_ids.to(torch.int64),
                           positions=inputs.positions.to(torch.int64), token_table=self._token_table)
        if all(p <= row.first for p, row in zip(prefix.tolist(), rows)):
            return view, torch.arange(int(qsl[-1]), device=dev)
        return self._with_shared(view, inputs, rows)

    def _with_shared(self, view: ForwardView, inputs: forward_inputs.ForwardInputs, rows: list[RowPlan]
                     ) -> tuple[ForwardView, torch.Tensor | None]:
        """A row that hits blocks another row of this step computes counts them as written by
        itself too (blocks.py: the canary can verify them only once that row wrote them), with
        the tokens the scheduler holds; their write-through rows are the other row's."""
        bs, ends, prefixes = self.block_size, view.extend_lens.cumsum(0).tolist(), view.prefix_lens.tolist()
        dev = self.device
        ids, positions, index, shared = [], [], [], []
        for b, row in enumerate(rows):
            span = torch.arange(row.first, prefixes[b], device=dev)
            own = slice(ends[b] - int(view.extend_lens[b]), ends[b])
            ids += [torch.tensor(row.tokens[row.first:prefixes[b]], dtype=torch.int64, device=dev), view.input_ids[own]]
            positions += [span, view.positions[own]]
            index += [torch.full((span.numel(),), -1, device=dev), torch.arange(own.start, own.stop, device=dev)]
            shared.append(self._table[b, span // bs] * bs + span % bs)
        by_slot = rows_by_slot(inputs.slot_mappings[self._full_group], torch.cat(shared))
        order = torch.cat(index)
        if by_slot is not None:
            order[order < 0] = by_slot
        firsts = torch.minimum(torch.tensor([row.first for row in rows], dtype=torch.int64, device=dev),
                               view.prefix_lens)
        view = ForwardView(rows=view.rows, prefix_lens=firsts, extend_lens=view.extend_lens + view.prefix_lens - firsts,
                           input_ids=torch.cat(ids), positions=torch.cat(positions), token_table=self._token_table)
        return view, None if by_slot is None else order

    def feed_token(self, view: ForwardView, index: int, token: int) -> None:
        """The forward about to run embeds `token` at view token `index` (optional GuardedEngine extra,
        from a forward observer in before_forward): written into the model call's own input ids,
        and into the view's copy of them. Raises ValueError for a view token of a position the
        forward does not compute for that row (another row's, blocks.py)."""
        inputs = self._inputs
        assert inputs is not None, "feed_token outside a forward"
        ends = view.extend_lens.cumsum(0)
        b = int(torch.searchsorted(ends, torch.tensor(index, device=ends.device), right=True))
        position = int(view.prefix_lens[b]) + index - int(ends[b] - view.extend_lens[b])
        qsl = inputs.query_start_loc
        first = int(inputs.seq_lens[b]) - int(qsl[b + 1] - qsl[b])  # the first position row b computes
        if position < first:
            raise ValueError(f"view token {index} (row {b}, position {position}) is not fed to this forward: row "
                             f"{b} computes positions from {first}")
        inputs.input_ids[int(qsl[b]) + position - first] = token
        view.input_ids[index] = token

    def after_forward(self) -> None:
        """The forward wrote its K/V: RECHECK and TAIL, then the host side of the forward."""
        view, self._view = self._view, None
        self._inputs = None
        if view is None and self._plan is not None:
            self._plan = None
            raise RuntimeError(f"vLLM ran a forward without calling its model in Python (CUDA graph mode "
                               f"{self.graph_mode}): the canary's pre-hook saw nothing of it")
        assert view is not None, "wait_for_save without a bound step"
        self._write_through.end_forward()
        if self._scales is not None:
            self._scales.restore()
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

    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """Greedy output ids per arrival (EOS ignored): each added once this call ran `at_forward`
        forwards (at once when nothing is left to run), aborted `abort_after` forwards after that
        (keeping the tokens vLLM had produced); runs vLLM's engine step by step until every request
        is done or aborted."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_forward)
        request_ids: list[str] = [""] * len(arrivals)
        outputs: dict[str, list[int]] = {}
        aborts: list[tuple[int, str]] = []  # (the forward to abort at, the request)
        start, idle = self.forwards, 0
        while order or engine.has_unfinished_requests():
            now = self.forwards - start + idle
            if order and not engine.has_unfinished_requests() and arrivals[order[0]].at_forward > now:
                idle, now = idle + arrivals[order[0]].at_forward - now, arrivals[order[0]].at_forward
            while order and arrivals[order[0]].at_forward <= now:
                i = order.pop(0)
                a = arrivals[i]
                params = SamplingParams(max_tokens=a.max_new_tokens, temperature=0.0, ignore_eos=True)
                request_ids[i] = f"kvcanary-serve-{uuid.uuid4().hex}"
                outputs[request_ids[i]] = []
                engine.add_request(request_ids[i], TokensPrompt(prompt_token_ids=[int(t) for t in a.prompt]), params)
                if a.abort_after is not None:
                    aborts.append((now + a.abort_after, request_ids[i]))
            due = [x for x in aborts if x[0] <= now]
            for x in due:
                aborts.remove(x)
            if due:
                engine.abort_request([request_id for _, request_id in due])
            for output in engine.step():  # cumulative outputs: each request's tokens so far
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        return [outputs[r] for r in request_ids]

    def score_uncached(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TokenScores]:
        """What greedy decoding picks after each prefix of each (prompt, output): one vLLM request per
        (prompt, output) over prompt + output with prompt log-probabilities, which vLLM computes
        without reading its prefix cache (it caches the blocks it computes, as any request's).
        Log-probability differences are logit differences. Where the output's token is not the
        best, it is the one measured against (vLLM reports each prompt token's own
        log-probability): in bfloat16 three tokens can tie within a rounding step. A request that
        filled max_model_len leaves no room for the token vLLM generates: its last output token is
        then scored from that token's top two, and measured against the runner-up."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        scored = [i for i, (_, output) in enumerate(requests) if output]
        whole = {i: len(requests[i][0]) + len(requests[i][1]) < self.settings.max_model_len for i in scored}
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, logprobs=2, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=[*map(int, requests[i][0]),
                                                 *map(int, requests[i][1] if whole[i] else requests[i][1][:-1])])
                  for i in scored]
        results = self.llm.generate(inputs, params, use_tqdm=False) if inputs else []
        scores = [TokenScores([], [], []) for _ in requests]
        for i, result in zip(scored, results):
            prompt_len = len(requests[i][0])
            dists = result.prompt_logprobs[prompt_len:]
            if not whole[i]:
                dists = [*dists, result.outputs[0].logprobs[0]]
            best, measured = [], []
            for token, dist in zip(requests[i][1], dists):
                ranked = sorted(dist.items(), key=lambda item: item[1].rank)
                best.append(ranked[0])
                measured.append((token, dist[token]) if token != ranked[0][0] and token in dist else ranked[1])
            scores[i] = TokenScores([b[0] for b in best], [m[0] for m in measured],
                                    [b[1].logprob - m[1].logprob for b, m in zip(best, measured)])
        return scores

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

    @property
    def routed_experts(self) -> bool:
        """Whether the model sends each token to some of its experts (Qwen3-Next's num_experts,
        DeepSeek's n_routed_experts): the soak's oracle then allows a router's near tie."""
        config = self.llm.llm_engine.vllm_config.model_config.hf_text_config
        return max(getattr(config, "num_experts", 0) or 0, getattr(config, "n_routed_experts", 0) or 0) > 1

    def liveness(self) -> dict[str, int]:
        """Requests vLLM's scheduler admitted with a cached prefix since start-up ("prefix hits")."""
        return {"prefix hits": self.book.prefix_hits}

    def request_at(self, row: int, step: int) -> tuple[int, str] | None:
        """The request (the book's id, prompt text) at mapping row `row` in forward `step` since
        the last reset."""
        if not (0 <= step < len(self._steps) and 0 <= row < len(self._steps[step])):
            return None
        request = self._steps[step][row]
        return request, self.llm.get_tokenizer().decode(self.book.prompt(request))

    # GuardedEngine ------------------------------------------------------------------------------

    def canary_groups(self) -> Sequence[PoolGroup]:
        return self._groups

    def canary_capacities(self) -> Capacities:
        s = self.settings
        # A row may also count as computing prefix blocks another row computes (blocks.py), so
        # a forward's view can hold up to a whole context per row.
        return Capacities(max_batch=s.max_num_seqs, max_tokens=s.max_num_seqs * s.max_model_len,
                          max_context=s.max_model_len)

    def cache_walk(self) -> CacheWalk | None:
        walk = self.book.walk()
        if self._hybrid:
            self._window.refill(self.book.window_pairs())
        return walk

    def checkpoint_walk(self) -> CheckpointWalk | None:
        """The recurrent-state checkpoints vLLM's prefix cache holds (a hybrid model's; states.py)."""
        return None if self._states is None else self._states.walk(self.book, self._full_group, self.block_size)

    # Internals -------------------------------------------------------------------------------

    @property
    def _hybrid(self) -> bool:
        """vLLM keeps the sliding-window layers' blocks in a KV cache group of their own."""
        return bool(self.book.window_groups)

    def _kv_stored(self, kind: GroupKind, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        if self._hooks is not None:
            self._hooks.kv_stored(kind, layer, k, v)

    def _freed(self, blocks: list[int], cause: str) -> None:
        """Listeners hear the blocks' slots in each group's mapping space: for the SWA group the
        full-attention slots its map sends there, for the STATE group the blocks themselves (a
        block belongs to one vLLM group at a time, so for the other groups the slots hold nothing
        of their own)."""
        bs = self.block_size
        slots = (torch.tensor(blocks, dtype=torch.int64)[:, None] * bs + torch.arange(bs)).flatten()
        spaces = {group.kind: torch.tensor(blocks, dtype=torch.int64) if group.mapping is None
                  else slots if group.mapping.full_to_group is None
                  else torch.isin(group.mapping.full_to_group, slots.to(self.device)).nonzero().flatten().cpu()
                  for group in self._groups if group.kind is not GroupKind.SCALES}  # scales: no slots freed
        for listener in self._listeners:
            for kind, space in spaces.items():
                listener(kind, space, cause)
