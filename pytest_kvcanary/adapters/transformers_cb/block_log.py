"""What transformers' prefix cache does not keep about its hashed blocks: where each sits in its
sequence, its tokens and its parent block. The sweep's cache walk is built from it."""

from __future__ import annotations

from typing import Container, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ...canary.host import CacheWalk
from kvcanary_kernels.records import PREV_CHAIN_HEAD


class LoggedBlock(NamedTuple):
    index: int  # the block holds positions [index * page_size, (index + 1) * page_size)
    parent: int  # block id at index - 1; -1 at index 0
    tokens: bytes  # the block's tokens as native int64s (a walk joins them without reading each one)


class _Walked(NamedTuple):
    """The last walk, and what it was built from."""

    changes: int  # BlockLog._changes then
    hashed: dict[int, bool]
    blocks: list[int]  # its blocks, in walk order
    walk: CacheWalk


class BlockLog:
    """Logged FULL blocks by id. A block's entry lives from the forward that completed it (the
    engine calls `note` once transformers hashed it) until the block goes back to the free pool
    (`forget`)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.blocks: dict[int, LoggedBlock] = {}
        self._children: dict[int, set[int]] = {}  # block id -> the logged blocks that follow it
        self._levels: list[dict[int, int]] = []  # [index]: block id -> parent, in the order logged
        self._changes = 0  # counts every change to `blocks`
        self._walked: _Walked | None = None

    def note(self, table: Sequence[int], tokens: Sequence[int], hashed: Container[int]) -> None:
        """Log the hashed blocks of one request's block table (`tokens`: its sequence so far). A
        block already logged is logged again when it now follows another parent (transformers
        re-created an evicted parent)."""
        page = self.page_size
        for index, block in enumerate(table):
            if block not in hashed:
                continue
            parent = table[index - 1] if index else -1
            entry = self.blocks.get(block)
            if entry is None or entry.parent != parent:
                self._changes += 1
                if entry is not None:
                    self._unlink(block, entry)
                self._children.setdefault(parent, set()).add(block)
                while len(self._levels) <= index:
                    self._levels.append({})
                self._levels[index][block] = parent
                self.blocks[block] = LoggedBlock(index, parent, np.array(tokens[index * page:(index + 1) * page],
                                                                          dtype=np.int64).tobytes())

    def forget(self, blocks: Iterable[int]) -> None:
        """Drop the blocks and their logged descendants: a child whose parent block was freed is
        no longer known to follow what its parent id holds next."""
        dropping = [b for b in blocks if b in self.blocks]
        self._changes += bool(dropping)
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
        del self._levels[entry.index][block]

    def clear(self) -> None:
        self.blocks.clear()
        self._children.clear()
        self._levels.clear()
        self._changes += 1
        self._walked = None

    def intact(self, hashed: Mapping[int, bool]) -> list[int]:
        """Logged blocks still hashed whose whole ancestry is too, parents before children: the
        blocks whose slots and predecessors hold what the log says."""
        return self._intact(hashed)[0]

    def _intact(self, hashed: Mapping[int, bool]) -> tuple[list[int], list[int], list[int]]:
        """`intact`'s blocks, with each one's index and parent."""
        kept: set[int] = set()
        order, indices, parents = [], [], []
        for index, level in enumerate(self._levels):
            for block, parent in level.items():
                if block in hashed and (index == 0 or parent in kept):
                    kept.add(block)
                    order.append(block)
                    indices.append(index)
                    parents.append(parent)
        return order, indices, parents

    def walk(self, hashed: Mapping[int, bool]) -> CacheWalk:
        """The sweep's view of every intact block, on the host: slot, position, previous slot (the
        parent's last slot at a block's first position), token, locked (a live request holds it).
        The same walk object again while neither the log nor `hashed` changed (a decode step mostly
        changes neither), and the same columns but a new ``locked`` while only which blocks live
        requests hold changed (requests finished): the sweep then neither checks nor plans again."""
        last = self._walked
        if last is not None and last.changes == self._changes and last.hashed.keys() == hashed.keys():
            if last.hashed == hashed:
                return last.walk
            blocks, walk = last.blocks, last.walk._replace(locked=self._locked(last.blocks, hashed))
        else:
            blocks, walk = self._walk(hashed)
        self._walked = _Walked(self._changes, dict(hashed), blocks, walk)
        return walk

    def _locked(self, blocks: list[int], hashed: Mapping[int, bool]) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.array([hashed[b] for b in blocks], dtype=bool), self.page_size))

    def _walk(self, hashed: Mapping[int, bool]) -> tuple[list[int], CacheWalk]:
        """(its blocks, the walk), built with numpy (torch's thread pool made small host tensors
        slow on a busy GPU host)."""
        page = self.page_size
        blocks, indices, parents = self._intact(hashed)
        offsets = np.arange(page, dtype=np.int64)
        index = np.array(indices, dtype=np.int64).reshape(-1, 1)
        parent = np.array(parents, dtype=np.int64)
        slots = np.array(blocks, dtype=np.int64).reshape(-1, 1) * page + offsets
        prev = slots - 1
        prev[:, 0] = np.where(index[:, 0] == 0, PREV_CHAIN_HEAD, parent * page + page - 1)
        logged = self.blocks
        tokens = np.frombuffer(b"".join([logged[b].tokens for b in blocks]), dtype=np.int64).copy()
        columns = (slots, index * page + offsets, prev, tokens)  # CacheWalk's fields, in order
        return blocks, CacheWalk(*(torch.from_numpy(column.reshape(-1)) for column in columns),
                                 locked=self._locked(blocks, hashed))
