"""What transformers' prefix cache does not keep about its hashed blocks: where each sits in its
sequence, its tokens and its parent block. It is kept as the sweep's walk itself, a table indexed by
FULL block (the seam's PagedWalk): a block's row is written when it is logged and cleared when it
is forgotten, so a sweep after a prefill builds no walk of every cached block."""

from __future__ import annotations

from typing import AbstractSet, Container, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from ...canary.seam import PREV_CHAIN_HEAD, CacheWalk, PagedWalk, page_entries


class LoggedBlock(NamedTuple):
    index: int  # the block holds positions [index * page_size, (index + 1) * page_size)
    parent: int  # block id at index - 1; -1 at index 0


class BlockLog:
    """Logged FULL blocks by id, and the walk of them: ``num_slots`` slots in blocks of
    ``page_size``. A block's entry lives from the forward that completed it (the engine calls `note`
    once transformers hashed it) until the block goes back to the free pool (`forget`) or loses its
    hash. A block id outside the pool (a corrupted block table) is logged apart, and the walk is then
    handed over as a list of entries, where the sweep reports it."""

    def __init__(self, page_size: int, num_slots: int) -> None:
        self.page_size = page_size
        self.num_blocks = num_slots // page_size
        self.blocks: dict[int, LoggedBlock] = {}
        self._children: dict[int, set[int]] = {}  # block id -> the logged blocks that follow it
        self._outside: dict[int, tuple[int, np.ndarray]] = {}  # logged ids past the pool -> (prev slot, tokens)
        self._first = np.full(self.num_blocks, -1, dtype=np.int64)  # a block's first position; -1: not logged
        self._prev = np.full(self.num_blocks, PREV_CHAIN_HEAD, dtype=np.int64)
        self._tokens = np.zeros(self.num_blocks * page_size, dtype=np.int64)
        self._locked = np.zeros(self.num_blocks, dtype=bool)
        self._locked_blocks: AbstractSet[int] = frozenset()
        self._tensors = tuple(torch.from_numpy(a) for a in (self._first, self._prev, self._tokens, self._locked))
        self._version = 0  # counts every change to the walk but its locks

    def note(self, table: Sequence[int], tokens: Sequence[int], hashed: Container[int]) -> None:
        """Log the hashed blocks of one request's block table (`tokens`: its sequence so far) whose
        parent is logged and whose tokens the host all has. A block already logged is logged again
        when it now follows another parent (transformers re-created an evicted parent). A block
        past the tokens waits for a later note: under async batching transformers 5.17 hashes the
        block after a prompt it found whole in its prefix cache as soon as the first token is
        sampled (the block is already allocated for the next forward), though that forward and
        the 63 after it are still to write it."""
        page = self.page_size
        known = len(tokens) // page  # blocks whose tokens the host has
        for index, block in enumerate(table[:known]):
            if block not in hashed:
                continue
            parent = table[index - 1] if index else -1
            entry = self.blocks.get(block)
            if entry is not None and entry.parent == parent:
                continue
            if index and parent not in self.blocks:
                continue
            if entry is not None:
                self._unlink(block, entry)
            self._children.setdefault(parent, set()).add(block)
            self.blocks[block] = LoggedBlock(index, parent)
            prev = parent * page + page - 1 if index else PREV_CHAIN_HEAD
            written = tokens[index * page:(index + 1) * page]
            if 0 <= block < self.num_blocks:
                self._first[block], self._prev[block] = index * page, prev
                self._tokens[block * page:(block + 1) * page] = written
                self._version += 1
            else:
                self._outside[block] = (prev, np.array(written, dtype=np.int64))

    def forget(self, blocks: Iterable[int]) -> None:
        """Drop the blocks and their logged descendants: a child whose parent block was freed is
        no longer known to follow what its parent id holds next."""
        dropping = [b for b in blocks if b in self.blocks]
        while dropping:
            block = dropping.pop()
            entry = self.blocks.pop(block, None)
            if entry is not None:
                self._unlink(block, entry)
                dropping.extend(self._children.pop(block, ()))

    def _unlink(self, block: int, entry: LoggedBlock) -> None:
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(block)
        if 0 <= block < self.num_blocks:
            self._first[block] = -1
            self._version += 1
        else:
            del self._outside[block]

    def clear(self) -> None:
        self.blocks.clear()
        self._children.clear()
        self._outside.clear()
        self._first[:] = -1
        self._version += 1

    def walk(self, hashed: AbstractSet[int], locked: AbstractSet[int]) -> PagedWalk | CacheWalk:
        """The sweep's view of every logged block (`hashed`: the blocks transformers keeps a hash
        of; `locked`: those a live request holds): its first position, the slot before it (the
        parent's last), its tokens, locked. A logged block no longer hashed is forgotten first. The
        table indexed by block (the same tensors, updated in place; its version changes with any
        of them but the locks), or a list of entries while a logged block lies outside the pool."""
        if not self.blocks.keys() <= hashed:
            self.forget(self.blocks.keys() - hashed)
        if locked != self._locked_blocks:
            self._locked_blocks = frozenset(locked)
            held = np.fromiter(locked, dtype=np.int64, count=len(locked))
            self._locked[:] = False
            self._locked[held[(held >= 0) & (held < self.num_blocks)]] = True
        if self._outside:
            return self._listed()
        return PagedWalk(self.page_size, *self._tensors, version=self._version)

    def _listed(self) -> CacheWalk:
        """The walk as entries: the logged blocks' slots, those outside the pool last."""
        page = self.page_size
        inside = np.flatnonzero(self._first != -1)
        outside = np.fromiter(self._outside, dtype=np.int64, count=len(self._outside))
        return page_entries(
            page, np.concatenate([inside, outside]),
            np.concatenate([self._first[inside], [self.blocks[b].index * page for b in outside.tolist()]]),
            np.concatenate([self._prev[inside], [prev for prev, _ in self._outside.values()]]),
            np.concatenate([self._tokens.reshape(-1, page)[inside], *(t.reshape(1, -1) for _, t in
                                                                       self._outside.values())]),
            np.concatenate([self._locked[inside], [b in self._locked_blocks for b in outside.tolist()]]))
