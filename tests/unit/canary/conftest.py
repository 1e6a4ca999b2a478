"""A hand-driven CanaryHost: tests play the engine, forward by forward."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD, GroupKind
from pytest_kvcanary.canary.host import ForwardView, PoolGroup, RadixWalk


class FakeHost:
    """A FULL pool (and optionally an SWA pool mapping every FULL slot 1:1) with a req_to_token
    table; `forward` writes random KV for the new tokens between the runtime's hooks."""

    def __init__(self, num_slots: int = 64, layers: int = 2, row_bytes: int = 64, window: int | None = None,
                 seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        words = row_bytes // 8
        self.k = [torch.zeros(num_slots, words, dtype=torch.int64) for _ in range(layers)]
        self.v = [torch.zeros(num_slots, words, dtype=torch.int64) for _ in range(layers)]
        self.table = torch.zeros(8, 32, dtype=torch.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_slot = 1
        self.window = window
        groups = [PoolGroup(GroupKind.FULL, self.k, self.v, num_slots)]
        if window is not None:
            self.swa_k = [torch.zeros(num_slots, words, dtype=torch.int64)]
            self.swa_v = [torch.zeros(num_slots, words, dtype=torch.int64)]
            self.full_to_swa = torch.arange(num_slots)
            groups.append(PoolGroup(GroupKind.SWA, self.swa_k, self.swa_v, num_slots, window=window,
                                    full_to_group=self.full_to_swa))
        self.groups = groups
        self.runtime = None
        self.cached: list[tuple[int, int]] = []  # (row, length) prefixes the "radix cache" holds

    def canary_groups(self):
        return self.groups

    def req_to_token(self):
        return self.table

    def radix_walk(self):
        slots, pos, prev, toks = [], [], [], []
        for row, length in self.cached:
            for p in range(length):
                slots.append(int(self.table[row, p]))
                pos.append(p)
                prev.append(int(self.table[row, p - 1]) if p else PREV_CHAIN_HEAD)
                toks.append(self.tokens[row][p])
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return RadixWalk(t(slots), t(pos), t(prev), t(toks), torch.zeros(len(slots), dtype=torch.bool))

    def forward(self, batch: dict[int, list[int]], share: dict[int, int] | None = None) -> ForwardView:
        """Append tokens to rows. `share={row: src_row}` first copies src_row's mapping (a cached
        prefix) for the positions the row does not have yet."""
        for row, src in (share or {}).items():
            n = len(self.tokens[src])
            self.table[row, :n] = self.table[src, :n]
            self.tokens[row] = list(self.tokens[src])
        rows, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        for row, new in batch.items():
            have = self.tokens.setdefault(row, [])
            rows.append(row), prefix.append(len(have)), extend.append(len(new))
            for tok in new:
                slot = self.next_slot
                self.next_slot += 1
                self.table[row, len(have)] = slot
                ids.append(tok), pos.append(len(have)), loc.append(slot)
                have.append(tok)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        prefix_ids = [t(self.tokens[r][:p]) for r, p in zip(rows, prefix)]
        view = ForwardView(t(rows), t(prefix), t(extend), t(ids), t(pos), t(loc), prefix_ids)
        self.runtime.before_forward(view)
        for layer in self.k + self.v + getattr(self, "swa_k", []) + getattr(self, "swa_v", []):
            layer[view.out_cache_loc] = torch.randint(-2**62, 2**62, (len(loc), layer.shape[1]), generator=self.gen)
        self.runtime.after_forward(view)
        return view


@pytest.fixture
def make_host():
    from pytest_kvcanary.canary.runtime import CanaryRuntime
    from pytest_kvcanary.config import CanaryConfig

    def make(window: int | None = None, jsonl_path=None, **config) -> FakeHost:
        host = FakeHost(window=window)
        host.runtime = CanaryRuntime(CanaryConfig(**config), host, jsonl_path=jsonl_path)
        return host

    return make
