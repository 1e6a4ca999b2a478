"""BlockLog: what the adapter remembers of transformers' hashed blocks, and the walk it gives the
sweep (no transformers needed)."""

from __future__ import annotations

from pytest_kvcanary.adapters.transformers_cb.block_log import BlockLog
from kvcanary_kernels.records import PREV_CHAIN_HEAD

PAGE = 4
TOKENS = list(range(100, 112))  # three pages


def logged(table, hashed) -> BlockLog:
    log = BlockLog(PAGE)
    log.note(table, TOKENS, hashed)
    return log


def test_walk_chains_each_block_to_its_parents_last_slot():
    log = logged([7, 3, 9], {7: False, 3: True, 9: True})
    walk = log.walk({7: False, 3: True, 9: True})
    assert walk.slots.tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37, 38, 39]
    assert walk.positions.tolist() == list(range(12))
    assert walk.prev_slots.tolist() == [PREV_CHAIN_HEAD, 28, 29, 30, 31, 12, 13, 14, 15, 36, 37, 38]
    assert walk.tokens.tolist() == TOKENS
    assert walk.locked.tolist() == [False] * 4 + [True] * 8


def test_only_hashed_blocks_are_logged_and_walked_while_hashed():
    log = logged([7, 3, 9], {7: False, 3: False})  # block 9 not complete yet
    assert set(log.blocks) == {7, 3}
    assert log.intact({7: False}) == [7]  # 3 lost its hash: gone from the walk


def test_a_block_whose_parent_was_freed_is_forgotten_with_its_descendants():
    log = logged([7, 3, 9], dict.fromkeys([7, 3, 9], False))
    log.note([7, 3, 4], TOKENS, dict.fromkeys([7, 3, 4], False))  # a second child of block 3
    log.forget([3])
    assert set(log.blocks) == {7}
    log.forget([7])
    assert log.blocks == {}


def test_a_block_logged_under_a_new_parent_is_not_forgotten_with_its_old_one():
    log = logged([7, 3, 9], dict.fromkeys([7, 3, 9], False))
    log.note([5, 3], TOKENS, {5: True, 3: True})
    log.forget([7])
    assert set(log.blocks) == {5, 3, 9}
    log.forget([5])
    assert log.blocks == {}


def test_a_block_following_a_new_parent_is_logged_again():
    log = logged([7, 3], {7: False, 3: False})
    log.note([5, 3], TOKENS, {5: True, 3: True})  # the parent's content was recomputed into block 5
    assert log.blocks[3].parent == 5
    assert log.intact({5: True, 3: True, 7: False}) == [7, 5, 3]


def test_the_walk_is_the_same_object_until_the_log_or_the_hashed_blocks_change():
    hashed = {7: False, 3: True}
    log = logged([7, 3], hashed)
    first = log.walk(dict(hashed))
    assert log.walk(dict(hashed)) is first
    log.note([7, 3], TOKENS, hashed)  # nothing new
    assert log.walk(dict(hashed)) is first
    released = log.walk({7: False, 3: False})  # the request holding block 3 released it
    assert released is not first and released.locked.tolist() == [False] * 8
    # Only the locks changed: the columns the sweep plans from are the very same tensors.
    assert all(a is b for a, b in zip(released[:4], first[:4]))
    hashed[9] = True  # hashed before the log heard of it
    assert log.walk(dict(hashed)).slots.numel() == 8
    log.note([7, 3, 9], TOKENS, hashed)
    assert log.walk(dict(hashed)).slots.numel() == 12
    log.forget([9])
    assert log.walk(dict(hashed)).slots.numel() == 8


def test_a_chain_whose_ancestor_lost_its_hash_leaves_the_walk_below_it():
    log = logged([7, 3, 9], dict.fromkeys([7, 3, 9], True))
    walk = log.walk({7: True, 9: True})  # block 3 lost its hash, still logged
    assert walk.slots.tolist() == [28, 29, 30, 31]
    assert log.intact({3: True, 9: True}) == []  # the chain's first block is gone
