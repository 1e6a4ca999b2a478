"""Decode on fixed, padded batches, replayed from CUDA graphs as real engines do.

A decode batch of n requests runs at the smallest captured size B >= n (powers of two up to
max_running). Everything the step reads lives in static buffers refilled in place before each run:
input ids, positions (the scheduler's, as an eager forward gets them), the rows' mapping rows and
prefix lengths (a hybrid model's: their state slots; quantized KV's: the model's scales). The canary's ForwardView is those same tensors, so its write-input checks see what
the model consumed, replayed or not (padding rows: prefix 0, extend 0, writing nothing). With
graphs, before_forward + the model + after_forward are captured at a size's first step and
replayed from then on; end_forward runs after each. Observers of the canary (the fault injector)
do not run inside a graph. In "padded" mode the same step runs eagerly (the path a graph replays,
runnable on a CPU).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from pytest_kvcanary.canary.seam import ForwardHooks, ForwardView, ScaleInputs, StateInputs

from .attention import layer_scales
from .kv_pool import KVPools, token_slots
from .kv_quant import KVCodec
from .model import CausalLM
from .state_access import PaddedDecodeState
from .state_pool import StatePool


class PaddedDecodeKV:
    """One decode token per batch row over the paged pools, shapes fixed by the batch size and
    max_context. Each layer writes the rows' new K/V (a latent layer: K only) into their slots (a
    padding row writes slot 0's own bytes back, leaving the reserved slot as it was), tells the store
    listener, then attends to positions [0, prefix] (a windowed layer: [prefix - window, prefix])
    gathered through each row's table row. K/V are stored and read back through codec, FP8 and FP4
    through the layer's row of scales (the step's view's), as attention.PagedKV does."""

    def __init__(self, pools: KVPools, table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                 extend_lens: torch.Tensor, on_store: Callable | None, codec: KVCodec,
                 scales: ScaleInputs | None) -> None:
        self.pools, self.table = pools, table
        self.rows, self.prefix_lens, self.valid = rows, prefix_lens, extend_lens > 0
        self.on_store = on_store
        self.codec, self.scales = codec, scales

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 window: int | None) -> torch.Tensor:
        buf = self.pools.layer(layer)
        slots = token_slots(self.table[self.rows], self.pools.page_size)  # [B, positions] FULL slots
        loc = slots.gather(1, self.prefix_lens[:, None])[:, 0]
        if buf.slot_map is not None:
            slots, loc = buf.slot_map[slots], buf.slot_map[loc]
        loc = torch.where(self.valid, loc, 0)
        keep = self.valid[:, None, None]
        k_scale, v_scale = layer_scales(self.scales, layer)
        k, v = self.codec.store(k, k_scale), None if v is None else self.codec.store(v, v_scale)
        buf.k[loc] = torch.where(keep, k, buf.k[loc])
        if buf.v is not None:
            buf.v[loc] = torch.where(keep, v, buf.v[loc])
        if self.on_store is not None:
            self.on_store(buf.group, buf.index, k, v)
        k_pos = torch.arange(slots.shape[1], device=q.device)
        delta = self.prefix_lens[:, None] - k_pos[None, :]  # query position - key position
        mask = delta >= 0
        if window is not None:
            mask &= delta <= window
        rep = q.shape[1] // k.shape[1]
        keys = self.codec.load(buf.k[slots], k_scale).repeat_interleave(rep, dim=2)  # [B, C, H, D]
        values = keys if buf.v is None else self.codec.load(buf.v[slots], v_scale).repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None, None, :])
        return out[:, :, 0, :]


class DecodeStep:
    """The static buffers of one batch size and the step over them (captured on demand)."""

    def __init__(self, size: int, model: CausalLM, pools: KVPools, table: torch.Tensor,
                 token_table: torch.Tensor, device: torch.device, states: StatePool | None,
                 spin: Callable[[], object] = lambda: None) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int64, device=device)

        self.size, self.model, self.pools, self.table, self.states = size, model, pools, table, states
        self.spin = spin
        # What fill() copies from the host, one row each, in one buffer (one copy a step): rows,
        # prefix_lens, positions, context_keys, extend_lens, and a hybrid model's state slots.
        self._filled = torch.zeros((5 if states is None else 6, size), dtype=torch.int64, device=device)
        rows, prefix_lens, positions, context_keys, extend_lens = self._filled[:5]
        state = None if states is None else StateInputs(self._filled[5], zeros(), zeros())  # a decode writes no checkpoint
        self.view = ForwardView(rows=rows, prefix_lens=prefix_lens, extend_lens=extend_lens, input_ids=zeros(),
                                positions=positions, token_table=token_table, context_keys=context_keys, state=state,
                                scales=model.kv_scales)
        self.next_tokens = zeros()
        self.graph: torch.cuda.CUDAGraph | None = None
        self._side: torch.cuda.Stream | None = None  # after_forward's stream (CUDA), made at the first fork

    def fill(self, rows: list[int], prefix_lens: list[int], input_ids: torch.Tensor, positions: list[int],
             context_keys: list[int], state_slots: list[int]) -> None:
        """Refill the static buffers in place (copies in stream order; input_ids, on the host or the
        device, never read by the host)."""
        pad = [0] * (self.size - len(rows))  # padding rows: zeros
        v = self.view
        v.input_ids[len(rows):].zero_()
        v.input_ids[:len(rows)].copy_(input_ids, non_blocking=True)
        filled = [rows, prefix_lens, positions, context_keys, [1] * len(rows)]
        if v.state is not None:
            filled.append(state_slots)
        self._filled.copy_(torch.tensor([values + pad for values in filled], dtype=torch.int64), non_blocking=True)

    def forward(self, hooks: ForwardHooks | None) -> None:
        """before_forward, the model, after_forward, greedy tokens into next_tokens (no end_forward);
        spin() at the four spin points around them (jitter.py). On CUDA, after_forward (with the
        two spins around it) runs on a side stream forked after the model and joined after the
        tokens: it reads and stamps KV the logits never touch, so the two overlap."""
        v = self.view
        self.spin()
        if hooks is not None:
            hooks.before_forward(v)
        self.spin()
        kv = PaddedDecodeKV(self.pools, self.table, v.rows, v.prefix_lens, v.extend_lens,
                            None if hooks is None else hooks.kv_stored, self.model.kv_codec, v.scales)
        states = None if self.states is None else PaddedDecodeState(self.states, v.state.slots, v.extend_lens)
        hidden = self.model(v.input_ids, v.positions, kv, v.context_keys, states)
        tail = None if hooks is None else self._fork()
        with contextlib.nullcontext() if tail is None else torch.cuda.stream(tail):
            self.spin()
            if hooks is not None:
                hooks.after_forward(v)
            self.spin()
        self.next_tokens.copy_(self.model.compute_logits(hidden).argmax(-1))
        if tail is not None:
            torch.cuda.current_stream().wait_stream(tail)  # joined before the step ends

    def _fork(self) -> torch.cuda.Stream | None:
        """On CUDA, the side stream, made to wait for the current one's work so far; None elsewhere."""
        if self.next_tokens.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.next_tokens.device)
        self._side.wait_stream(torch.cuda.current_stream())
        return self._side

    def run_and_capture(self, hooks: ForwardHooks | None) -> None:
        """Run this step eagerly on a side stream (which compiles and allocates what the step
        needs), then capture it; capturing executes nothing, so the step ran exactly once."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(hooks)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.forward(hooks)


class DecodeGraphs:
    """Padded decode steps per captured size; graphs captured lazily, dropped when the hooks change."""

    def __init__(self, model: CausalLM, pools: KVPools, table: torch.Tensor, token_table: torch.Tensor,
                 max_running: int, device: torch.device, use_graphs: bool, states: StatePool | None = None,
                 spin: Callable[[], object] = lambda: None) -> None:
        """spin: called at each step's spin points (the engine's seeded jitter on a GPU)."""
        sizes = [1 << i for i in range(max_running.bit_length()) if 1 << i < max_running] + [max_running]
        self.steps = [DecodeStep(s, model, pools, table, token_table, device, states, spin) for s in sizes]
        self.use_graphs = use_graphs

    def invalidate(self) -> None:
        for step in self.steps:
            step.graph = None

    def run(self, hooks: ForwardHooks | None, rows: list[int], prefix_lens: list[int], input_ids: torch.Tensor,
            positions: list[int], context_keys: list[int], state_slots: list[int]) -> torch.Tensor:
        """One decode forward of len(rows) requests (one token each: input_ids, at positions; a
        hybrid model's from their state slots); returns each one's greedy next token, on the device
        (a view of the size's static buffer, which its next run overwrites). The caller calls
        hooks.end_forward() after it."""
        step = next(s for s in self.steps if s.size >= len(rows))
        step.fill(rows, prefix_lens, input_ids, positions, context_keys, state_slots)
        if not self.use_graphs:
            step.forward(hooks)
        elif step.graph is None:
            step.run_and_capture(hooks)
        else:
            step.graph.replay()
        return step.next_tokens[:len(rows)]
