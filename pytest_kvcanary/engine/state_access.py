"""A recurrent mixer's state from the engine's state pool: a forward batch (`PooledState`) or a
padded decode step (`PaddedDecodeState`). The no-cache reference, `DenseState`, and the access's
contract, `StateAccess`, live with the mixer (model.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .model import RecurrentMixer
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
    run from the state in its slot, which then holds the state after them; where a checkpoint slot
    is given (not 0), it gets the state after checkpoint_len tokens of the request's sequence.
    Nothing is checked here: a slot of another request, or one never written, is silently read,
    which is what the canary is for."""

    def __init__(self, pool: StatePool, slots: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int],
                 checkpoint_slots: Sequence[int], checkpoint_lens: Sequence[int]) -> None:
        self.pool = pool
        self.seqs = list(zip(slots, prefix_lens, extend_lens, checkpoint_slots, checkpoint_lens))

    def __call__(self, mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
        conv, ssm = self.pool.layer(mixer.layer)
        outs, t = [], 0
        for slot, prefix, extend, checkpoint, checkpoint_len in self.seqs:
            at = checkpoint_len - prefix if checkpoint else 0
            y, end, mid = mixer.scan(u[t:t + extend], conv[slot], ssm[slot], at)
            conv[slot], ssm[slot] = end
            if mid is not None:
                conv[checkpoint], ssm[checkpoint] = mid
            outs.append(y)
            t += extend
        return torch.cat(outs)
