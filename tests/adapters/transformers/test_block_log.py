"""BlockLog: what the adapter remembers of transformers' hashed blocks, kept as the sweep's paged
walk (no transformers needed)."""

from __future__ import annotations

import torch

from kvcanary_kernels.records import COL_REASONS, COL_SLOT, PREV_CHAIN_HEAD, Reason
from pytest_kvcanary.adapters.transformers_cb.block_log import BlockLog
from pytest_kvcanary.canary.seam import PagedWalk
from pytest_kvcanary.canary.walk import check_walk, paged_entries

PAGE, BLOCKS = 4, 12
TOKENS = list(range(100, 112))  # three pages


def logged(table, hashed) -> BlockLog:
    log = BlockLog(PAGE, PAGE * BLOCKS)
    log.note(table, TOKENS, hashed)
    return log


def listed(walk) -> dict[int, tuple[int, int, int, bool]]:
    """slot -> (position, previous slot, token, locked) of every slot the walk lists."""
    entries = paged_entries(walk) if isinstance(walk, PagedWalk) else walk
    return {s: tuple(rest) for s, *rest in zip(*(c.tolist() for c in entries[:5]))}


def test_the_walk_is_paged_and_chains_each_block_to_its_parents_last_slot():
    log = logged([7, 3, 9], {7, 3, 9})
    walk = log.walk({7, 3, 9}, {3, 9})
    assert isinstance(walk, PagedWalk) and walk.first_positions.numel() == BLOCKS
    slots = [28, 29, 30, 31, 12, 13, 14, 15, 36, 37, 38, 39]
    assert listed(walk) == {slot: (i, [PREV_CHAIN_HEAD, *slots][i], TOKENS[i], i >= PAGE)
                            for i, slot in enumerate(slots)}
    assert check_walk(walk, PAGE * BLOCKS).walk is walk  # well formed: planned as it is


def test_only_hashed_blocks_whose_parent_is_logged_are_logged():
    log = logged([7, 3, 9], {7, 9})  # block 3 not hashed: 9 follows nothing logged
    assert set(log.blocks) == {7}
    log.note([7, 3, 9], TOKENS, {7, 3, 9})
    assert set(log.blocks) == {7, 3, 9}


def test_a_block_that_lost_its_hash_leaves_the_walk_with_its_descendants():
    log = logged([7, 3, 9], {7, 3, 9})
    walk = log.walk({7, 9}, set())  # block 3 lost its hash
    assert sorted(listed(walk)) == [28, 29, 30, 31] and set(log.blocks) == {7}


def test_a_block_whose_parent_was_freed_is_forgotten_with_its_descendants():
    log = logged([7, 3, 9], {7, 3, 9})
    log.note([7, 3, 4], TOKENS, {7, 3, 4})  # a second child of block 3
    log.forget([3])
    assert set(log.blocks) == {7} and sorted(listed(log.walk({7}, set()))) == [28, 29, 30, 31]
    log.forget([7])
    assert log.blocks == {} and not listed(log.walk(set(), set()))


def test_a_block_logged_under_a_new_parent_is_not_forgotten_with_its_old_one():
    log = logged([7, 3, 9], {7, 3, 9})
    log.note([5, 3], TOKENS, {5, 3})
    assert log.blocks[3].parent == 5 and listed(log.walk({7, 5, 3, 9}, set()))[12][1] == 5 * PAGE + PAGE - 1
    log.forget([7])
    assert set(log.blocks) == {5, 3, 9}
    log.forget([5])
    assert log.blocks == {}


def test_the_version_changes_with_the_blocks_and_not_with_the_locks():
    log = logged([7, 3], {7, 3})
    first = log.walk({7, 3}, {3})
    again = log.walk({7, 3}, {3})
    assert again.version == first.version and all(a is b for a, b in zip(again, first))
    log.note([7, 3], TOKENS, {7, 3})  # nothing new
    released = log.walk({7, 3}, set())  # the request holding block 3 released it
    assert released.version == first.version and not released.locked.any()
    assert all(a is b for a, b in zip(released, first))  # the same tensors, updated in place
    log.note([7, 3, 9], TOKENS, {7, 3, 9})
    grown = log.walk({7, 3, 9}, set())
    assert grown.version != first.version and len(listed(grown)) == 12
    log.forget([9])
    assert log.walk({7, 3, 9}, set()).version != grown.version and len(listed(log.walk({7, 3}, set()))) == 8


def test_a_block_outside_the_pool_is_handed_over_as_entries_the_sweep_reports():
    log = logged([7, BLOCKS + 2, 9], {7, BLOCKS + 2, 9})  # a block id past the pool
    walk = log.walk({7, BLOCKS + 2, 9}, set())
    assert not isinstance(walk, PagedWalk) and walk.slots.numel() == 3 * PAGE
    assert listed(walk) == {**listed(logged([7], {7}).walk({7}, set())), **{
        (BLOCKS + 2) * PAGE + i: (PAGE + i, [31, *range((BLOCKS + 2) * PAGE, (BLOCKS + 3) * PAGE)][i], TOKENS[PAGE + i],
                                  False) for i in range(PAGE)}, **{
        36 + i: (2 * PAGE + i, (BLOCKS + 3) * PAGE - 1 if i == 0 else 35 + i, TOKENS[2 * PAGE + i], False)
        for i in range(PAGE)}}
    rows = check_walk(walk, PAGE * BLOCKS).rows[:, [COL_REASONS, COL_SLOT]].tolist()
    outside = [(BLOCKS + 2) * PAGE + i for i in range(PAGE)]
    # 36: the head of its child, whose predecessor lies outside too
    assert sorted(rows) == [[int(Reason.WALK_SLOT_OUT_OF_RANGE), slot] for slot in [36, *outside]]
    log.forget([BLOCKS + 2])
    assert isinstance(log.walk({7}, set()), PagedWalk)


def test_a_hashed_block_past_the_known_tokens_is_logged_once_they_are_known():
    log = BlockLog(PAGE, PAGE * BLOCKS)
    log.note([7, 3, 9], TOKENS[:PAGE + 1], {7, 3, 9})  # block 3 hashed with one of its tokens known
    assert set(log.blocks) == {7}
    log.note([7, 3, 9], TOKENS[:2 * PAGE], {7, 3, 9})
    assert set(log.blocks) == {7, 3}
    assert {s: rest[2] for s, rest in listed(log.walk({7, 3, 9}, set())).items()} == dict(
        zip([28, 29, 30, 31, 12, 13, 14, 15], TOKENS[:2 * PAGE]))
