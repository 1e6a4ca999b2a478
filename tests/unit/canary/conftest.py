"""A hand-driven GuardedEngine: tests play the engine, forward by forward."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD, GroupKind
from pytest_kvcanary.canary.seam import CacheWalk, Capacities, ForwardView, PoolGroup, SlotMapping

from fake_host_limits import DEVICE, MAX_CONTEXT, MAX_ROWS, MAX_TOKENS



class FakeHost:
    """A FULL pool (and optionally an SWA pool mapping every FULL slot 1:1) behind a per-token table
    (page 1) or a block table (page > 1, one block per row in turn); `forward` writes random KV for
    the new tokens between the runtime's hooks, and hands it over through kv_stored when
    write_through is on."""

    def __init__(self, num_slots: int = 64, layers: int = 2, row_bytes: int = 64, window: int | None = None,
                 page: int = 1, write_through: bool = False, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        words = row_bytes // 8
        self.page = page
        self.k = [torch.zeros(num_slots // page, page, words, dtype=torch.int64, device=DEVICE) for _ in range(layers)]
        self.v = [torch.zeros(num_slots // page, page, words, dtype=torch.int64, device=DEVICE) for _ in range(layers)]
        self.table = torch.zeros(MAX_ROWS, MAX_CONTEXT // page, dtype=torch.int64, device=DEVICE)
        self.token_table = torch.full((MAX_ROWS, MAX_CONTEXT), -1, dtype=torch.int64, device=DEVICE)
        self.tokens: dict[int, list[int]] = {}
        self.next_entry = 1  # next free slot (page 1) or block (page > 1); entry 0 is reserved
        self.window = window
        self.write_through = write_through
        full = SlotMapping(self.table, page_size=page)
        groups = [PoolGroup(GroupKind.FULL, self.k, self.v, num_slots, full, page_size=page)]
        if window is not None:
            self.swa_k = [torch.zeros(num_slots, words, dtype=torch.int64, device=DEVICE)]
            self.swa_v = [torch.zeros(num_slots, words, dtype=torch.int64, device=DEVICE)]
            self.full_to_swa = torch.arange(num_slots, device=DEVICE)
            swa = SlotMapping(self.table, page_size=page, full_to_group=self.full_to_swa)
            groups.append(PoolGroup(GroupKind.SWA, self.swa_k, self.swa_v, num_slots, swa, window=window))
        self.groups = groups
        self.runtime = None
        self.cached: list[tuple[int, int]] = []  # (row, length) prefixes the "prefix cache" holds

    def canary_groups(self):
        return self.groups

    def canary_capacities(self) -> Capacities:
        return Capacities(max_batch=MAX_ROWS, max_tokens=MAX_TOKENS, max_context=MAX_CONTEXT)

    def slot(self, row: int, position: int) -> int:
        return int(self.table[row, position // self.page]) * self.page + position % self.page

    def cache_walk(self) -> CacheWalk:
        slots, pos, prev, toks = [], [], [], []
        for row, length in self.cached:
            for p in range(length):
                if self.slot(row, p) in slots:  # a shared prefix: a cache holds each slot once
                    continue
                slots.append(self.slot(row, p))
                pos.append(p)
                prev.append(self.slot(row, p - 1) if p else PREV_CHAIN_HEAD)
                toks.append(self.tokens[row][p])
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return CacheWalk(t(slots), t(pos), t(prev), t(toks), torch.zeros(len(slots), dtype=torch.bool))

    def layers(self) -> list[tuple[GroupKind, int, torch.Tensor, torch.Tensor]]:
        out = [(GroupKind.FULL, i, k, v) for i, (k, v) in enumerate(zip(self.k, self.v))]
        if self.window is not None:
            out += [(GroupKind.SWA, i, k, v) for i, (k, v) in enumerate(zip(self.swa_k, self.swa_v))]
        return out

    def forward(self, batch: dict[int, list[int]], share: dict[int, int] | None = None, pad_to: int = 0,
                context_keys: dict[int, int] | None = None,
                during: Callable[[list[int]], None] | None = None) -> ForwardView:
        """Append tokens to rows. `share={row: src_row}` first gives the row src_row's cached prefix:
        its whole blocks (a partly filled block is not shared, as block engines do). pad_to: pad the batch with empty rows
        and the token arrays with junk, as a graph-replaying engine does. during(written slots):
        called inside the forward, after its KV writes (to damage something there)."""
        for row, src in (share or {}).items():
            blocks = len(self.tokens[src]) // self.page
            n = blocks * self.page
            self.table[row, :blocks] = self.table[src, :blocks]
            self.tokens[row] = self.tokens[src][:n]
            self.token_table[row, :n] = self.token_table[src, :n]
        rows, prefix, extend, ids, pos, written = [], [], [], [], [], []
        for row, new in batch.items():
            have = self.tokens.setdefault(row, [])
            rows.append(row), prefix.append(len(have)), extend.append(len(new))
            for tok in new:
                p = len(have)
                if p % self.page == 0:
                    self.table[row, p // self.page] = self.next_entry
                    self.next_entry += 1
                self.token_table[row, p] = tok
                ids.append(tok), pos.append(p), written.append(self.slot(row, p))
                have.append(tok)
        keys = [(context_keys or {}).get(r, 0) for r in rows]
        pad = max(0, pad_to - len(rows))
        rows, prefix, extend, keys = rows + [0] * pad, prefix + [0] * pad, extend + [0] * pad, keys + [0] * pad
        junk = [0] * max(0, pad_to - len(ids))
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
        view = ForwardView(t(rows), t(prefix), t(extend), t(ids + junk), t(pos + junk),
                           token_table=self.token_table, context_keys=t(keys))
        self.runtime.before_forward(view)
        loc = t(written)
        for kind, i, k, v in self.layers():
            new_k, new_v = (torch.randint(-2**62, 2**62, (len(loc), layer.shape[-1]), generator=self.gen).to(DEVICE)
                            for layer in (k, v))
            for layer, new in ((k, new_k), (v, new_v)):
                layer.view(-1, layer.shape[-1])[loc] = new  # SWA slots equal FULL slots here
            if self.write_through:
                self.runtime.kv_stored(kind, i, new_k, new_v)
        if during is not None:
            during(written)
        self.runtime.after_forward(view)
        self.runtime.end_forward()
        return view


@pytest.fixture
def make_host():
    from pytest_kvcanary.canary.runtime import CanaryRuntime
    from pytest_kvcanary.config import CanaryConfig

    def make(window: int | None = None, jsonl_path=None, page: int = 1, write_through: bool = False,
             **config) -> FakeHost:
        config.setdefault("drain_interval", 1)
        config.setdefault("kernels", "torch")
        host = FakeHost(window=window, page=page, write_through=write_through)
        host.runtime = CanaryRuntime(CanaryConfig(**config), host, jsonl_path=jsonl_path)
        return host

    return make
