"""view_kernels.py's Triton kernels (on the GPU, or the Triton interpreter on a CPU) write what the torch forms
they replace write, on fresh random batches: the view's lengths and each full-attention group's
table rows (DerivedView.derive), and the sampled tokens in the token table (put_sampled)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from .support import DEVICE, INSTALL

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb.batch_buffers import BatchBuffers  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb.cache_groups import (  # noqa: E402
    FULL_ATTENTION, SLIDING_ATTENTION, GroupCache,
)
from pytest_kvcanary.adapters.transformers_cb.forward_view import DerivedView, empty_tables, empty_view  # noqa: E402
from pytest_kvcanary.canary.seam import Capacities, GroupKind  # noqa: E402

CAPACITIES = Capacities(max_batch=6, max_tokens=48, max_context=64)
LANES = 2 * CAPACITIES.max_batch


def group(kind: GroupKind, io_index: int, page_size: int, ring: int = 0) -> GroupCache:
    return GroupCache(kind=kind, layers=(0,), k_layers=(), v_layers=(), num_blocks=32, page_size=page_size,
                      window=ring or None, ring=ring, key=None, io_index=io_index, index_stride=page_size)


def random_forward(rng: random.Random, dtype: torch.dtype, cached: bool) -> tuple[SimpleNamespace, list, list, int]:
    """transformers' IO buffers for a random batch (stale values past it), its read and write
    indices per group (full, sliding), and the batch size."""
    b, t = CAPACITIES.max_batch, CAPACITIES.max_tokens
    n = rng.randint(0, b)
    extends = [rng.randint(1, t // b) for _ in range(n)]
    prefixes = [rng.randint(0, 20) if cached else 0 for _ in range(n)]
    stale = [rng.randint(0, 99) for _ in range(b - n)]
    cu_q = torch.tensor([0, *torch.tensor(extends, dtype=torch.int64).cumsum(0).tolist(), *stale], dtype=dtype)
    totals = [p + e for p, e in zip(prefixes, extends)]
    cu_k = torch.tensor([0, *torch.tensor(totals, dtype=torch.int64).cumsum(0).tolist(), *stale], dtype=dtype)
    io = SimpleNamespace(cumulative_seqlens_q=cu_q.to(DEVICE),
                         cumulative_seqlens_k={FULL_ATTENTION: cu_k.to(DEVICE), SLIDING_ATTENTION: cu_k.to(DEVICE)},
                         input_ids=torch.randint(0, 256, (t,), device=DEVICE),
                         position_ids=torch.randint(0, 64, (t,), dtype=dtype, device=DEVICE))

    def index(length: int) -> torch.Tensor:
        values = [rng.randrange(32) * 4 + rng.randrange(4) for _ in range(length)]
        padded = [v if rng.random() > 0.05 else -1 for v in values]  # -1: padding
        return torch.tensor(padded, dtype=dtype, device=DEVICE)

    reads = [index(sum(totals)) if cached else index(0) for _ in range(2)]
    writes = [index(max(sum(extends), 1)) for _ in range(2)]
    return io, reads, writes, n


def derived_pair(io: SimpleNamespace, groups: list[GroupCache], batch: torch.Tensor, lanes: list[int]):
    """Two DerivedViews over the same IO buffers, the torch forms' and the kernels', each with a view
    and tables of its own (zeros, or what an earlier forward left: the same random values)."""
    views = []
    for fused in (False, True):
        rows = torch.zeros(CAPACITIES.max_batch, dtype=torch.int64, device=DEVICE)
        rows[:len(lanes)] = torch.tensor(lanes, dtype=torch.int64)
        token_table = torch.zeros(LANES, CAPACITIES.max_context, dtype=torch.int64, device=DEVICE)
        view = empty_view(CAPACITIES, rows, token_table)
        tables = empty_tables(groups, CAPACITIES, LANES, torch.device(DEVICE))
        for table in tables.values():
            table.copy_(torch.arange(table.numel()).view_as(table) % 7)
        views.append(DerivedView(io, CAPACITIES, batch, view, groups, tables, fused=fused))
    return views


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", ["full", "full+sliding", "sliding"])
def test_derive_by_the_kernel_matches_the_torch_form(seed, layout):
    rng = random.Random(seed)
    groups = {"full": [group(GroupKind.FULL, 0, 4)],
              "full+sliding": [group(GroupKind.FULL, 0, 4), group(GroupKind.SWA, 1, 4, ring=16)],
              "sliding": [group(GroupKind.SWA, 1, 4, ring=16)]}[layout]
    for dtype in (torch.int32, torch.int64):
        io, reads, writes, n = random_forward(rng, dtype, cached=bool(seed % 3))
        batch = torch.tensor([n], device=DEVICE)
        torch_form, kernel = derived_pair(io, groups, batch, rng.sample(range(LANES), n))
        for derived in (torch_form, kernel):
            derived.derive(reads, writes)
        assert torch.equal(kernel.view.extend_lens, torch_form.view.extend_lens)
        assert torch.equal(kernel.view.prefix_lens, torch_form.view.prefix_lens)
        for g in groups:  # the scratch row is written by rows past the batch in an undefined order
            assert torch.equal(kernel.tables[g.kind][:LANES], torch_form.tables[g.kind][:LANES]), (g.kind, dtype)


@pytest.mark.parametrize("seed", range(8))
def test_put_sampled_by_the_kernel_matches_the_torch_form(seed):
    rng = random.Random(seed)
    dtype = (torch.int32, torch.int64)[seed % 2]
    io, _, _, n = random_forward(rng, dtype, cached=True)
    sampled = rng.randint(0, n) if seed % 3 else n
    lanes = rng.sample(range(LANES), n)
    cu_q = io.cumulative_seqlens_q
    last = [int(cu_q[r + 1]) - 1 for r in range(n)]  # each row's last query token: its logits
    logits = torch.tensor(last + [rng.randrange(CAPACITIES.max_tokens) for _ in range(CAPACITIES.max_tokens - n)],
                          dtype=dtype, device=DEVICE)
    if n:
        io.position_ids[last[0]] = CAPACITIES.max_context - 1  # the token after it: past the table
    tokens = torch.randint(0, 256, (CAPACITIES.max_tokens,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    tables = []
    for derived in derived_pair(io, [group(GroupKind.FULL, 0, 4)], torch.tensor([n], device=DEVICE), lanes):
        buffers = BatchBuffers(CAPACITIES, LANES, torch.device(DEVICE), 1)
        buffers.device_views["batch"][0, :2] = torch.tensor([n, sampled])
        derived.batch = buffers.batch
        derived.put_sampled(logits, tokens, buffers)
        tables.append(buffers.token_table.clone())
    assert torch.equal(tables[1], tables[0])
    inside = [i for i in range(sampled) if int(io.position_ids[last[i]]) + 1 < CAPACITIES.max_context]
    assert int((tables[0] != -1).sum()) == len(inside)  # each sampled token inside the table, nothing else


@pytest.mark.parametrize("seed", range(4))
def test_copy_inputs_by_the_kernel_matches_the_torch_form(seed):
    """Into the whole view (even seeds) or one cut to a span (odd): as many tokens as it holds, the
    view's tokens past the span untouched."""
    io, _, _, n = random_forward(random.Random(seed), (torch.int32, torch.int64)[seed % 2], cached=True)
    torch_form, kernel = derived_pair(io, [group(GroupKind.FULL, 0, 4)], torch.tensor([n], device=DEVICE), [])
    span = CAPACITIES.max_tokens if seed % 2 == 0 else 16 + seed
    for derived in (torch_form, kernel):
        derived.view.input_ids.fill_(-7)
        cut = dataclasses.replace(derived.view, input_ids=derived.view.input_ids[:span],
                                  positions=derived.view.positions[:span])
        derived.copy_inputs(cut)
    assert torch.equal(kernel.view.input_ids, torch_form.view.input_ids)
    assert torch.equal(kernel.view.positions, torch_form.view.positions)
    assert torch.equal(kernel.view.positions[:span], io.position_ids[:span].long())
    assert torch.equal(kernel.view.input_ids[:span], io.input_ids[:span].long())
    assert bool((kernel.view.input_ids[span:] == -7).all()) and bool(kernel.view.positions.any())


@pytest.mark.parametrize("seed", range(4))
def test_apply_tokens_by_the_kernel_matches_the_torch_form(seed):
    """Three forwards' entries, staged through the host's runs: many, then fewer (the rest of the
    staged entries unused), then none."""
    rng = random.Random(seed)
    buffers = [BatchBuffers(CAPACITIES, LANES, torch.device(DEVICE), 1, fused=fused) for fused in (False, True)]
    for n_runs in (4, 2, 0):
        lanes = rng.sample(range(LANES), n_runs)
        counts = [rng.randint(1, CAPACITIES.max_tokens // 4) for _ in lanes]
        starts = [rng.randint(0, CAPACITIES.max_context - c) for c in counts]
        tokens = [rng.randrange(256) for _ in range(sum(counts))]
        for buffer in buffers:
            buffer.set_batch(len(lanes), len(lanes))
            buffer.set_entries(lanes, starts, counts, tokens)
            buffer.upload()
            buffer.apply_tokens()
        assert torch.equal(buffers[1].token_table, buffers[0].token_table)
    assert int((buffers[0].token_table != -1).sum()) > 0
