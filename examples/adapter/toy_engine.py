"""The smallest engine behind the canary seam: what an adapter must do, in one file.

One layer, one FULL pool of one-token slots (page_size 1: a per-token table, SGLang's layout),
one request at a time, no prefix cache; the "model" derives a token's K/V from its id and
position and picks the next token from everything it read. Run `pytest --kv-canary
--kv-canary-engine=toy -p toy_engine` with this file importable.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pytest_kvcanary.canary.seam import (Capacities, ForwardHooks, ForwardView, GroupKind, PoolGroup, SlotMapping,
                                         UnsupportedAttention)


class ToyEngine:
    def __init__(self, device: str = "cpu", num_slots: int = 1024, max_context: int = 128) -> None:
        self.k = torch.zeros(num_slots, 2, 8, device=device)  # [slot, heads, head_dim]; slot 0 reserved
        self.v = torch.zeros_like(self.k)
        self.table = torch.zeros(1, max_context, dtype=torch.int64, device=device)  # row 0: position -> slot
        self.capacities = Capacities(max_batch=1, max_tokens=max_context, max_context=max_context)
        self.hooks: ForwardHooks | None = None
        self.next_slot = 1

    # The CanaryHost seam: what to guard, how big a forward gets, what a prefix cache holds.
    def canary_groups(self) -> list[PoolGroup]:
        return [PoolGroup(GroupKind.FULL, [self.k], [self.v], self.k.shape[0], SlotMapping(self.table))]

    def canary_capacities(self) -> Capacities:
        return self.capacities

    def cache_walk(self) -> None:
        return None  # no prefix cache: the sweep has nothing to walk

    # What the fixtures drive.
    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self.hooks = hooks

    def reset(self) -> None:
        self.next_slot = 1

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return [self._complete(list(p.encode()) if isinstance(p, str) else list(p), max_new_tokens) for p in prompts]

    def _complete(self, tokens: list[int], max_new_tokens: int) -> list[int]:
        prefix, out = 0, []
        for _ in range(max_new_tokens):
            out.append(self._forward(prefix, tokens[prefix:]))
            prefix = len(tokens)
            tokens.append(out[-1])
        return out

    def _forward(self, prefix: int, new: list[int]) -> int:
        n, pad = len(new), self.capacities.max_tokens - len(new)
        if self.next_slot + n > self.k.shape[0]:
            self.next_slot = 1  # recycle the pool (no request outlives its generate call)
        slots = torch.arange(self.next_slot, self.next_slot + n, device=self.k.device)
        self.next_slot += n
        self.table[0, prefix:prefix + n] = slots  # mapped before before_forward: the seam's rule
        tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.k.device)  # noqa: E731
        view = ForwardView(rows=tensor([0]), prefix_lens=tensor([prefix]), extend_lens=tensor([n]),
                           input_ids=tensor(new + [0] * pad), positions=tensor(list(range(prefix, prefix + n)) + [0] * pad))
        if self.hooks:
            self.hooks.before_forward(view)  # HEAD: verify what this forward reads
        ids, positions = view.input_ids[:n, None, None], view.positions[:n, None, None]  # the forward's own inputs
        self.k[slots] = torch.sin(ids * 0.37 + positions * 0.11 + torch.arange(8, device=self.k.device))
        self.v[slots] = torch.cos(ids * 0.53 - positions * 0.07 + torch.arange(8, device=self.k.device))
        read = self.table[0, :prefix + n]
        next_token = int((self.k[read].sum() + self.v[read].sum()).abs() * 997) % 256
        if self.hooks:
            self.hooks.after_forward(view)  # TAIL: stamp what it wrote, recheck what it read
            self.hooks.end_forward()
        return next_token


def pytest_kvcanary_make_engine(name: str, attention: str, device: str) -> ToyEngine | None:
    if name != "toy":
        return None
    if attention != "mha":
        raise UnsupportedAttention(f"the toy engine has no {attention} attention")
    return ToyEngine(device)
