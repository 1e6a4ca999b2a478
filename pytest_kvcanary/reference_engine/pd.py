"""Prefill/decode disaggregation: two reference engines and the KV transfer between them.

    prefill.prefill_for_transfer   one forward over the prompts, first token sampled, then
                                   cache_unfinished_req (a duplicate prompt of the batch is
                                   rewritten to the first copy's slots, its own freed)
    -> transfer                    snapshot the request's row, copy the prompt's KV of every
                                   layer of every pool group into slots the decode side allocated
                                   (a hybrid model: and its recurrent state, into a state slot)
    -> prefill scheduler.finish    the prefill copy stays in the prefill radix cache
    -> decode.step ...             until max_new_tokens

The decode side does not cache the transferred prompt: the request owns those slots, so its first
decode forward reads (and a canary's HEAD re-verifies) the whole transferred prefix.

PDPair implements the PrefillDecodePair seam (canary/seam.py) that the kv_pd fixture drives.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import ContextManager, Sequence

import torch

from ..canary.seam import TransferListener, UnsupportedAttention
from .engine import Engine
from .kv_pool import KVPool, slot_pages
from .request import Request


def _copy_kv(src: KVPool, dst: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Every layer's K and V of src_slots into dst_slots (the pools may be on different devices)."""
    for s, d in zip(src.k_layers + src.v_layers, dst.k_layers + dst.v_layers, strict=True):
        d[dst_slots.to(d.device)] = s[src_slots.to(s.device)].to(d.device)


def _current(engine: Engine) -> ContextManager[object]:
    """The engine's GPU as the current CUDA device while it runs a forward, so work launched on
    the current device (the canary's Triton kernels among it) runs where its tensors live, also
    when the two sides are on different GPUs."""
    return torch.cuda.device(engine.device) if engine.device.type == "cuda" else contextlib.nullcontext()


class PDPair:
    """A prefill engine and a decode engine of the same model, each on its own device (or one)."""

    def __init__(self, prefill: Engine, decode: Engine) -> None:
        if (prefill.config.model, prefill.config.checkpoint) != (decode.config.model, decode.config.checkpoint):
            raise ValueError("a prefill/decode pair needs the same model (config and weights) on both sides")
        if prefill.config.model.attention == "sparse":
            raise UnsupportedAttention("the reference prefill/decode pair has no attention kind 'sparse': its transfer "
                                       "moves no indexer keys; run a single engine")
        self.prefill, self.decode = prefill, decode
        self._transfer_listeners: list[TransferListener] = []
        self.num_transferred = 0  # requests moved to the decode side since the pair started
        self._state_listeners: list[TransferListener] = []

    def add_transfer_listener(self, listener: TransferListener) -> None:
        """listener(prefill FULL slots, decode FULL slots) hears every transfer (a canary moves
        the slots' records there)."""
        self._transfer_listeners.append(listener)

    def add_state_transfer_listener(self, listener: TransferListener) -> None:
        """listener(prefill state slots, decode state slots) hears every transfer of a hybrid
        model's recurrent state (a canary moves the states' records there)."""
        self._state_listeners.append(listener)

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int,
                 context_keys: Sequence[int] | None = None) -> list[list[int]]:
        """Greedy output token ids per prompt, in order; context_keys: one per prompt (default:
        none), kept across the transfer. A prefilled request waits on the prefill side (holding
        its KV there) until the decode side has a row and memory for it; the next prefill runs
        once every prefilled request has been transferred."""
        keys = [0] * len(prompts) if context_keys is None else list(context_keys)
        if len(keys) != len(prompts):
            raise ValueError(f"context_keys must hold one key per prompt ({len(prompts)}); got {len(keys)}")
        reqs = [self.prefill.submit(p, max_new_tokens, k) for p, k in zip(prompts, keys)]
        on_decode: dict[Request, Request] = {}
        held: deque[Request] = deque()
        jitter = self.prefill.jitter
        while held or self.prefill.scheduler.waiting or self.decode.scheduler.has_work:
            # jitter: the held transfers may wait while the decode side steps, and any may go first
            late = bool(held) and self.decode.scheduler.has_work and bool(jitter.delay())
            while held and not late and (moved := self._transfer(held[first := jitter.pick(len(held))])) is not None:
                on_decode[held[first]] = moved
                self.prefill.scheduler.finish(held[first])
                del held[first]
            if late:
                with _current(self.decode):
                    self.decode.step()
            elif not held and self.prefill.scheduler.waiting:
                with _current(self.prefill):
                    held.extend(self.prefill.prefill_for_transfer())
            elif self.decode.scheduler.has_work:
                with _current(self.decode):
                    self.decode.step()
            elif held:
                raise RuntimeError("the decode engine cannot hold a transferred request even when idle")
        return [on_decode.get(r, r).output_ids for r in reqs]

    def liveness(self) -> dict[str, int]:
        """Both sides' `Engine.liveness` counts added up, and the requests transferred."""
        counts = self.prefill.liveness()
        for name, n in self.decode.liveness().items():
            counts[name] = counts.get(name, 0) + n
        return {**counts, "transfers": self.num_transferred}

    def _transfer(self, req: Request) -> Request | None:
        """Admit a prefilled request on the decode side with a copy of its prompt's KV; None
        (nothing changed) when the decode side has no room. SWA: only the positions still
        SWA-resident on the prefill side are sent; the decode side gives the others no SWA slot."""
        moved = Request(req.rid, req.prompt_ids, req.max_new_tokens, context_key=req.context_key,
                        output_ids=list(req.output_ids), kv_len=req.kv_len)
        dst = self.decode.scheduler.admit_transferred(moved)
        if dst is None:
            return None
        src = self.prefill.req_to_token_pool.read(req.row, 0, req.kv_len)  # the row as dedup left it
        sender, receiver = self.prefill.pools, self.decode.pools
        _copy_kv(sender.full, receiver.full, src, dst)
        if sender.draft is not None:  # a speculative pair: the draft's KV lives at the same FULL slots
            _copy_kv(sender.draft, receiver.draft, src, dst)
        if sender.swa is not None:
            src_swa = sender.swa.full_to_swa[src.to(sender.swa.full_to_swa.device)].cpu()
            resident = src_swa != 0
            receiver.swa.unmap(slot_pages(dst[~resident], receiver.page_size),
                               "not SWA-resident on the prefill side, so not transferred")
            dst_swa = receiver.swa.full_to_swa[dst[resident].to(receiver.swa.full_to_swa.device)].cpu()
            _copy_kv(sender.swa, receiver.swa, src_swa[resident], dst_swa)
        for listener in self._transfer_listeners:
            listener(src, dst)
        self.num_transferred += 1
        if self.prefill.states is not None:  # the state after the prompt, which the first decode starts from
            src_state, dst_state = (torch.tensor([s], dtype=torch.int64) for s in (req.state_slot, moved.state_slot))
            for s, d in zip(self.prefill.states.buffers, self.decode.states.buffers, strict=True):
                d[dst_state.to(d.device)] = s[src_state.to(s.device)].to(d.device)
            for listener in self._state_listeners:
                listener(src_state, dst_state)
        return moved
