"""A recurrent mixer's state from the engine's state pool: a forward batch (`PooledState`), a
padded decode step (`PaddedDecodeState`), a speculative draft's private copy (`DraftState`). The
no-cache reference, `DenseState`, and the access's contract, `StateAccess`, live with the mixer
(model.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .model import RecurrentMixer, StateAccess
from .state_pool import StatePool


class PaddedDecodeState:
    """One decode token per batch row over the state pool, shapes fixed by the batch size: each
    valid row steps from the state in its slot and writes the state after it back; a padding row
    (extend 0, slot 0) computes and writes nothing back, leaving reserved slot 0 as it was."""

    def __init__(self, pool: StatePool, slots: torch.Tensor, extend_lens: torch.Tensor) -> None:
        self.pool, self.slots, self.valid = pool, slots, extend_lens > 0

    def __call__(self, mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
        conv, ssm = self.pool.layer(mixer.layer)
        y, (new_conv, new_ssm) = mixer.step(u, conv[self.slots], ssm[self.slots])
        keep = self.valid[:, None, None]
        conv[self.slots] = torch.where(keep, new_conv, conv[self.slots])
        ssm[self.slots] = torch.where(keep[..., None], new_ssm, ssm[self.slots])
        return y


class PooledState:
    """One forward batch over the state pool. Per request (in batch order): its extend_len tokens
    run from the state in its slot, which then holds the state after them; each of its extra
    slots (a prefill's checkpoint, a speculative decode's state after each proposal but the last)
    gets the state after the matching number of tokens of the request's sequence. Nothing is
    checked here: a slot of another request, or one never written, is silently read, which is what
    the canary is for."""

    def __init__(self, pool: StatePool, slots: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int],
                 extra_slots: Sequence[Sequence[int]], extra_lens: Sequence[Sequence[int]]) -> None:
        self.pool = pool
        self.seqs = list(zip(slots, prefix_lens, extend_lens, extra_slots, extra_lens))

    def __call__(self, mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
        conv, ssm = self.pool.layer(mixer.layer)
        outs, t = [], 0
        for slot, prefix, extend, extras, lengths in self.seqs:
            y, end, states = mixer.scan(u[t:t + extend], conv[slot], ssm[slot], [n - prefix for n in lengths])
            conv[slot], ssm[slot] = end
            for extra, (c, s) in zip(extras, states):
                conv[extra], ssm[extra] = c, s
            outs.append(y)
            t += extend
        return torch.cat(outs)


class DraftState:
    """A speculative draft's recurrent state over one forward. The draft's layers are the target's
    first, so it starts from each request's running state in the pool (the state of its prefix)
    and advances a private copy; the pool is never written. `segments` runs each request's tokens
    at once (a prefill), `steps` one token of some batch rows (a draft forward of a decode)."""

    def __init__(self, pool: StatePool, slots: Sequence[int]) -> None:
        self.pool = pool
        self.slots = torch.tensor(list(slots), dtype=torch.int64, device=pool.conv[0].device)
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.own:
            conv, ssm = self.pool.layer(layer)
            self.own[layer] = conv[self.slots], ssm[self.slots]  # gathered: copies
        return self.own[layer]

    def segments(self, extend_lens: Sequence[int]) -> StateAccess:
        def run(mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
            conv, ssm = self._state(mixer.layer)
            outs, t = [], 0
            for b, extend in enumerate(extend_lens):
                outs.append(mixer.scan(u[t:t + extend], conv[b], ssm[b])[0])
                t += extend
            return torch.cat(outs)
        return run

    def steps(self, rows: torch.Tensor) -> StateAccess:
        def run(mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
            conv, ssm = self._state(mixer.layer)
            y, (conv[rows], ssm[rows]) = mixer.step(u, conv[rows], ssm[rows])
            return y
        return run
