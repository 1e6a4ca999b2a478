import random

import pytest
import torch

from kvcanary_kernels import ViolationRing
from kvcanary_kernels.records import COL_EXPECTED, COL_POSITION, COL_REASONS, COL_SLOT, COL_STEP, COL_STORED, \
    COL_TAG, PREV_CHAIN_HEAD, Reason
from pytest_kvcanary.canary.seam import CacheWalk, PagedWalk
from pytest_kvcanary.canary import walk as walk_module
from pytest_kvcanary.canary.walk import check_walk, paged_entries


def _walk(slots: list[int], positions: list[int], prev: list[int]) -> CacheWalk:
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return CacheWalk(t(slots), t(positions), t(prev), t([7] * len(slots)), torch.zeros(len(slots), dtype=torch.bool))


def _rows(rows: torch.Tensor) -> list[tuple[int, ...]]:
    return [(r[COL_REASONS], r[COL_SLOT], r[COL_POSITION], r[COL_STORED], r[COL_EXPECTED]) for r in rows.tolist()]


def test_a_well_formed_walk_passes_whole():
    walk = _walk([3, 4, 5, 9], [0, 1, 2, 0], [-1, 3, 4, -1])
    checked = check_walk(walk, space=16)
    assert checked.rows.shape[0] == 0
    assert checked.walk.slots.tolist() == [3, 4, 5, 9]


def test_each_malformed_entry_is_a_row_with_its_reason_and_only_checkable_entries_are_kept():
    # slot 4 listed twice (the second at a gap), slot 20 outside 16 slots, a predecessor outside
    # them, a negative position
    walk = _walk([3, 4, 5, 4, 20, 6, 7], [0, 1, 2, 5, 3, 1, -1], [-1, 3, 4, 5, 5, 99, -1])
    checked = check_walk(walk, space=16)
    dup, oob, gap = int(Reason.WALK_DUPLICATE_SLOT), int(Reason.WALK_SLOT_OUT_OF_RANGE), int(Reason.WALK_POSITION_GAP)
    assert _rows(checked.rows) == [
        (dup, 4, 1, 2, 1),
        (dup | gap, 4, 5, 2, 1),  # the primary reason's values: 2 listings, 1 expected
        (oob, 20, 3, 20, 16),
        (oob, 6, 1, 99, 16),  # its predecessor is out of range
        (gap, 7, -1, -1, -2),
    ]
    assert checked.walk.slots.tolist() == [3, 4, 5, 7]


def _random_walk(rng: random.Random, space: int) -> CacheWalk:
    """Chains of consecutive positions over distinct random slots, then at most one malformation."""
    slots = rng.sample(range(1, space), rng.randrange(1, space // 2))
    positions, prev, at = [], [], 0
    for i, slot in enumerate(slots):
        if i == 0 or rng.random() < 0.2:
            at, before = rng.randrange(3), -1 if rng.random() < 0.5 else rng.randrange(space)
        else:
            at, before = at + 1, slots[i - 1]
        positions.append(at)
        prev.append(-1 if at == 0 else before)
    fault = rng.randrange(8)
    i = rng.randrange(len(slots))
    if fault == 0:
        slots[i] = rng.choice([-1, space, space + 5])
    elif fault == 1:
        prev[i] = rng.choice([-2, space])
    elif fault == 2:
        slots[i] = slots[rng.randrange(len(slots))]
    elif fault == 3:
        positions[i] += rng.choice([-5, 1])
    return _walk(slots, positions, prev)


@pytest.mark.parametrize("seed", range(40))
def test_the_host_fast_path_passes_exactly_the_walks_the_full_check_passes_whole(seed, monkeypatch):
    rng = random.Random(seed)
    for _ in range(20):
        walk = _random_walk(rng, space=24)
        fast = walk_module._well_formed_on_host(walk, 24)
        with monkeypatch.context() as patched:
            patched.setattr(walk_module, "_well_formed_on_host", lambda walk, space: False)
            full = check_walk(walk, 24)
        whole = full.rows.shape[0] == 0 and torch.equal(full.walk.slots, walk.slots)
        assert fast == whole, walk
        if fast:
            assert check_walk(walk, 24).rows.shape[0] == 0


def test_a_walk_larger_than_the_space_is_one_walk_too_large_row():
    walk = _walk(list(range(1, 9)), list(range(8)), [-1] + list(range(1, 8)))
    checked = check_walk(walk, space=4)
    assert _rows(checked.rows)[0] == (int(Reason.WALK_TOO_LARGE), -1, -1, 8, 4)
    assert checked.walk.slots.tolist() == [1, 2, 3]


def test_ring_append_claims_rows_like_the_kernels_and_keeps_the_last_capacity():
    ring = ViolationRing(4, "cpu")
    ring.step.fill_(5)
    rows = torch.zeros(6, 8, dtype=torch.int64)
    rows[:, COL_SLOT] = torch.arange(6)
    ring.append(rows[:3], tag=7)
    ring.append(rows[3:], tag=7)
    assert int(ring.count) == 6
    assert ring.rows[:, COL_SLOT].tolist() == [4, 5, 2, 3]
    assert set(ring.rows[:, COL_TAG].tolist()) == {7} and set(ring.rows[:, COL_STEP].tolist()) == {5}
    ring.append(rows, tag=1)  # more than capacity: the last 4 land, all 6 are counted
    assert int(ring.count) == 12
    assert sorted(ring.rows[:, COL_SLOT].tolist()) == [2, 3, 4, 5]


def _random_paged(rng: random.Random, pages: int, page: int) -> PagedWalk:
    """Chains of random pages (each page after the last slot of the one before, or a chain head),
    then at most one malformation."""
    first, prev = [-1] * pages, [PREV_CHAIN_HEAD] * pages
    order = rng.sample(range(pages), rng.randrange(1, pages))
    for i, p in enumerate(order):
        if i and rng.random() < 0.7:
            first[p], prev[p] = first[order[i - 1]] + page, order[i - 1] * page + page - 1
        else:
            first[p] = 0
    p = rng.choice(order)
    fault = rng.randrange(6)
    if fault == 0:
        prev[p] = rng.choice([-2, pages * page, pages * page + 3])
    elif fault == 1:
        first[p] += rng.choice([-1, 1, 2])
    elif fault == 2:
        first[p] = rng.choice([-3, -page])
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return PagedWalk(page, t(first), t(prev), torch.arange(pages * page), torch.tensor([rng.random() < 0.5
                                                                                         for _ in range(pages)]), 1)


@pytest.mark.parametrize("seed", range(30))
def test_a_paged_walk_is_checked_page_by_page_with_the_rows_of_its_entries(seed):
    rng = random.Random(seed)
    pages, page = 12, 4
    for _ in range(20):
        paged = _random_paged(rng, pages, page)
        entries = paged_entries(paged)
        as_entries, as_pages = check_walk(entries, pages * page), check_walk(paged, pages * page)
        assert _rows(as_pages.rows) == _rows(as_entries.rows), paged
        if as_entries.rows.shape[0] == 0:
            assert as_pages.walk is paged
        else:
            assert all(torch.equal(a, b) for a, b in zip(as_pages.walk[:5], as_entries.walk[:5]))


def test_paged_entries_lists_each_listed_pages_slots_in_order():
    paged = PagedWalk(2, torch.tensor([-1, 4, 0]), torch.tensor([-1, 5, -1]), torch.arange(6) + 10,
                      torch.tensor([False, True, False]), 3)
    entries = paged_entries(paged)
    assert entries.slots.tolist() == [2, 3, 4, 5]
    assert entries.positions.tolist() == [4, 5, 0, 1]
    assert entries.prev_slots.tolist() == [5, 2, -1, 4]
    assert entries.tokens.tolist() == [12, 13, 14, 15] and entries.locked.tolist() == [True, True, False, False]


def test_a_paged_walk_of_another_size_than_the_pool_names_the_field():
    paged = PagedWalk(2, torch.full((3,), -1), torch.full((3,), -1), torch.zeros(5, dtype=torch.int64),
                      torch.zeros(3, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match=r"PagedWalk.tokens covers 5 slots in pages of 2; the FULL group has 6"):
        check_walk(paged, 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_paged_walk_on_the_device_names_the_host():
    paged = PagedWalk(2, *(torch.full((3,), -1, device="cuda") for _ in range(2)), torch.zeros(6, dtype=torch.int64),
                      torch.zeros(3, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match=r"a PagedWalk is kept on the host \(CPU tensors\); got cuda:0"):
        check_walk(paged, 6)
