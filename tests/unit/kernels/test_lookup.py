"""The slot lookup's two twins: the Triton ``lookup.map_slot`` and the torch
``reference.map_slot_ref`` (which the canary's host-side tools use) agree on random tables, rows
and positions, in range and out of it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kvcanary_kernels as K
from kvcanary_kernels.launch import mapping_args
from kvcanary_kernels.lookup import map_slot

from kv_world import DEVICE

BLOCK = 256


@triton.jit
def _map_slot_kernel(mapping, MAP: tl.constexpr, rows_ptr, positions_ptr, mask_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + offs)
    positions = tl.load(positions_ptr + offs)
    mask = tl.load(mask_ptr + offs) != 0
    tl.store(out_ptr + offs, map_slot(mapping, MAP, rows, positions, mask))


def _randint(gen: torch.Generator, low: int, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("page_size", "ring", "through_full_to_group"), [
    (1, 0, False), (4, 0, False), (1, 8, False), (4, 16, True), (2, 0, True),
])
def test_jit_and_torch_lookups_agree_on_random_inputs(seed, page_size, ring, through_full_to_group):
    gen = torch.Generator().manual_seed(seed * 100 + page_size * 10 + ring)
    num_slots = 48
    rows, cols = 6, 5
    # Entries past the pool, zero (not resident) and negative; rows and positions past the table
    # and negative; a mask that drops lanes.
    table = _randint(gen, -2, num_slots // page_size + 3, rows, cols)
    table[_randint(gen, 0, 4, rows, cols) == 0] = 0
    f2g = _randint(gen, -1, num_slots + 4, num_slots + 8) if through_full_to_group else None
    mapping = K.SlotMapping(table.to(DEVICE), page_size, ring, None if f2g is None else f2g.to(DEVICE))
    row_ids = _randint(gen, -1, rows + 2, BLOCK)
    positions = _randint(gen, -3, cols * page_size + 6, BLOCK)
    mask = _randint(gen, 0, 5, BLOCK) != 0
    records = torch.zeros(num_slots, 4, dtype=torch.int64, device=DEVICE)

    out = torch.full((BLOCK,), -7, dtype=torch.int64, device=DEVICE)
    args, consts = mapping_args(mapping, records)
    _map_slot_kernel[(1,)](args, consts, row_ids.to(DEVICE), positions.to(DEVICE), mask.to(DEVICE, torch.int64),
                           out, BLOCK=BLOCK)

    want = K.map_slot_ref(mapping, row_ids.to(DEVICE), positions.to(DEVICE), num_slots)
    want = torch.where(mask.to(DEVICE), want, 0)
    assert torch.equal(out, want)
    assert 0 < int((want != 0).sum()) < BLOCK  # the draw reaches resident and non-resident slots
