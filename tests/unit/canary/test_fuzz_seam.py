"""Seeded fuzz of the seam's inputs: malformed cache walks, mapping tables and forward views go
through the runtime on a CPU (the torch reference kernels, a few iterations on the Triton
interpreter). The canary reports each with a named reason or rejects it with a ValueError that
names the argument; it never raises anything else and never hangs."""

from __future__ import annotations

import random

import pytest
import torch

from kvcanary_kernels.records import Reason
from pytest_kvcanary.canary.seam import CacheWalk, ForwardView

from fake_host_limits import DEVICE, MAX_CONTEXT, MAX_ROWS

NUM_SLOTS = 64  # FakeHost's default pool
LABELS = {r.label for r in Reason}
# ValueError messages of the launch checks name one of these
VIEW_ARGS = ("rows", "prefix_lens", "extend_lens", "input_ids", "positions", "token_table", "context_keys")


def _prefilled(make_host, kernels: str):
    host = make_host(kernels=kernels, real_data="partial", sweep_interval=0)
    host.forward({0: [5, 6, 7, 8, 9], 1: [10, 11, 12]})
    host.forward({0: [13], 1: [14]})
    host.cached = [(0, 6), (1, 4)]
    return host


def _bad_walk(rng: random.Random, walk: CacheWalk) -> tuple[CacheWalk, set[str]]:
    """One or more malformations of a good walk, and the reasons each must raise."""
    slots, pos, prev = walk.slots.clone(), walk.positions.clone(), walk.prev_slots.clone()
    expect = set()
    kinds = rng.sample(["duplicate", "out_of_range", "prev_out_of_range", "gap", "too_large"], rng.randint(1, 2))
    i = rng.randrange(slots.numel())
    if "out_of_range" in kinds:
        slots[i] = rng.choice([-5, NUM_SLOTS, NUM_SLOTS + rng.randrange(1, 1 << 40)])
        expect.add("walk_slot_out_of_range")
    if "prev_out_of_range" in kinds:
        prev[rng.randrange(slots.numel())] = rng.choice([-3, NUM_SLOTS + 7])
        expect.add("walk_slot_out_of_range")
    if "gap" in kinds:
        j = int((pos > 1).nonzero()[rng.randrange(int((pos > 1).sum()))])
        pos[j] += rng.randrange(1, 5)
        expect.add("walk_position_gap")
    walk = walk._replace(slots=slots, positions=pos, prev_slots=prev)
    if "duplicate" in kinds:
        j = rng.randrange(walk.slots.numel())
        walk = CacheWalk(*(t if t is None else torch.cat([t, t[j:j + 1]]) for t in walk))
        expect.add("walk_duplicate_slot")
    if "too_large" in kinds:
        walk = CacheWalk(*(t if t is None else t.repeat(NUM_SLOTS // walk.slots.numel() + 1) for t in walk))
        expect |= {"walk_too_large", "walk_duplicate_slot"}
    return walk, expect


def _bad_view(rng: random.Random, host) -> tuple[ForwardView, set[str]]:
    """A decode view of rows 0 and 1 with one field malformed, and the reasons it must raise
    (a length outside what the canary checks: view_out_of_range)."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    fields = dict(rows=t([0, 1]), prefix_lens=t([6, 4]), extend_lens=t([1, 1]), input_ids=t([15, 16]),
                  positions=t([6, 4]), token_table=host.token_table, context_keys=t([0, 0]))
    field = rng.choice(["rows", "prefix_lens", "extend_lens", "positions", "shape"])
    huge = rng.choice([MAX_CONTEXT, MAX_CONTEXT + 3, 1 << 40])
    expect: set[str] = set()
    if field == "rows":
        fields["rows"] = t([0, rng.choice([-1, MAX_ROWS, 1 << 40])])
    elif field == "prefix_lens":
        fields["prefix_lens"] = t([rng.choice([-7, huge]), 4])
        expect = {"view_out_of_range"} if not 0 <= int(fields["prefix_lens"][0]) <= MAX_CONTEXT else set()
    elif field == "extend_lens":
        fields["extend_lens"] = t([rng.choice([-1, 0, 2, huge]), 1])
        expect = {"view_out_of_range"} if not 0 <= int(fields["extend_lens"][0]) <= 2 else set()
    elif field == "positions":
        fields["positions"] = t([rng.choice([-1, huge]), 4])
    else:
        name = rng.choice(["input_ids", "positions", "context_keys", "rows"])
        fields[name] = fields[name][:1] if rng.random() < 0.5 else fields[name].float()
    return ForwardView(**fields), expect


def _corrupt_table(rng: random.Random, host) -> None:
    """A mapping entry HEAD reads points outside the pool, at a negative slot or at another slot."""
    col = rng.randrange(6)
    host.table[0, col] = rng.choice([-1, NUM_SLOTS, NUM_SLOTS + 11, 1 << 40, int(host.table[1, col % 4])])


def _reasons(runtime) -> set[str]:
    return {r for v in runtime.log.violations for r in v.reasons}


def _one_case(make_host, seed: int, kernels: str) -> None:
    rng = random.Random(seed)
    host = _prefilled(make_host, kernels)
    runtime = host.runtime
    kind = rng.choice(["walk", "table", "view"])
    if kind == "walk":
        walk, expect = _bad_walk(rng, host.cache_walk())
        host.cache_walk = lambda: walk
        runtime.sweep()
        runtime.drain()
        assert expect <= _reasons(runtime), (seed, walk)
    elif kind == "table":
        _corrupt_table(rng, host)
        host.forward({0: [15]})
        runtime.drain()
        assert runtime.log.violations, seed  # HEAD reads the whole prefix through the table
    else:
        view, expect = _bad_view(rng, host)
        try:
            runtime.before_forward(view)
            runtime.after_forward(view)
            runtime.end_forward()
            runtime.drain()
        except ValueError as e:
            assert any(name in str(e) for name in VIEW_ARGS), (seed, str(e))
        else:
            assert expect <= _reasons(runtime), (seed, view)
    assert all(set(v.reasons) <= LABELS for v in runtime.log.violations)


@pytest.mark.parametrize("seed", range(60))
def test_malformed_seam_inputs_are_reported_or_rejected_with_torch_kernels(make_host, seed):
    _one_case(make_host, seed, "torch")


@pytest.mark.parametrize("seed", range(2))
def test_malformed_seam_inputs_are_reported_or_rejected_with_triton_kernels(make_host, seed):
    _one_case(make_host, 1000 + seed, "triton")
