"""The smallest engine behind the canary seam (docs/adapters.md): one layer, one FULL pool
of one-token slots, one request at a time, no prefix cache; K/V derive from each token's id and
position. Run `pytest --kv-canary --kv-canary-engine=toy -p toy_engine` with this file importable."""

from functools import partial
from typing import Sequence

import torch

from pytest_kvcanary.adapters import EngineSpec
from pytest_kvcanary.canary.seam import (Capabilities, Capacities, ForwardHooks, ForwardView, GroupKind, PoolGroup,
                                         SlotMapping, UnsupportedAttention)


class ToyEngine:
    def __init__(self, device: str = "cpu", num_slots: int = 1024, max_context: int = 128) -> None:
        self.k = torch.zeros(num_slots, 2, 8, device=device)  # [slot, heads, head_dim]; slot 0 reserved
        self.v = torch.zeros_like(self.k)
        self.table = torch.zeros(1, max_context, dtype=torch.int64, device=device)  # row 0: position -> slot
        self.hooks: ForwardHooks | None = None
        self.next_slot = 1

    # The GuardedEngine seam: what to guard, how big a forward gets, what a prefix cache holds (nothing).
    def canary_groups(self) -> list[PoolGroup]:
        return [PoolGroup(GroupKind.FULL, [self.k], [self.v], self.k.shape[0], SlotMapping(self.table))]

    def canary_capacities(self) -> Capacities:
        return Capacities(max_batch=1, max_tokens=self.table.shape[1], max_context=self.table.shape[1])

    def cache_walk(self) -> None:
        return None

    # What it has: the stock examples that need a prefix cache (or a walk of one) skip on it.
    def capabilities(self) -> Capabilities:
        return Capabilities(prefix_cache=False, cache_walk=False, concurrent=False)

    # What the fixtures drive.
    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None:
        self.hooks = hooks

    def reset(self) -> None:
        self.next_slot = 1

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        outputs = []
        for prompt in prompts:
            tokens = list(prompt.encode() if isinstance(prompt, str) else prompt)
            for step in range(max_new_tokens):
                prefix = len(tokens) - 1 if step else 0
                tokens.append(self._forward(prefix, tokens[prefix:]))
            outputs.append(tokens[-max_new_tokens:])
        return outputs

    def _forward(self, prefix: int, new: list[int]) -> int:
        n, pad, dev = len(new), self.table.shape[1] - len(new), self.k.device
        self.next_slot = 1 if self.next_slot + n > self.k.shape[0] else self.next_slot  # recycle the pool
        slots = torch.arange(self.next_slot, self.next_slot + n, device=dev)
        self.next_slot += n
        self.table[0, prefix:prefix + n] = slots  # mapped before before_forward: the seam's rule
        t = partial(torch.tensor, device=dev)
        view = ForwardView(rows=t([0]), prefix_lens=t([prefix]), extend_lens=t([n]), input_ids=t(new + [0] * pad),
                           positions=t(list(range(prefix, prefix + n)) + [0] * pad))
        if self.hooks:
            self.hooks.before_forward(view)  # HEAD: verify what this forward reads
        ids, pos, dims = view.input_ids[:n, None, None], view.positions[:n, None, None], torch.arange(8, device=dev)
        self.k[slots] = torch.sin(ids * 0.37 + pos * 0.11 + dims)  # computed from the forward's own inputs
        self.v[slots] = torch.cos(ids * 0.53 - pos * 0.07 + dims)
        read = self.table[0, :prefix + n]
        if self.hooks:
            self.hooks.after_forward(view)  # TAIL: stamp what it wrote, recheck what it read
            self.hooks.end_forward()
        return int((self.k[read].sum() + self.v[read].sum()).abs() * 997) % 256


def pytest_kvcanary_make_engine(spec: EngineSpec) -> ToyEngine | None:
    if spec.name != "toy":
        return None
    if spec.attention != "mha":
        raise UnsupportedAttention(f"the toy engine has no {spec.attention} attention")
    return ToyEngine(spec.device)
