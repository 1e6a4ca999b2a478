"""A radix tree over token ids whose nodes own FULL-pool pages (SGLang's RadixCache; with page_size
> 1 its paged variant: keys in page-size chunks, a match rounded down to whole pages, nodes split
and evicted at page boundaries, a request's partial last page never cached).

KV is shared only within one context (a cache salt or adapter id, the request's context_key): each
context has a tree of its own, so equal tokens under different contexts never match.

Ownership: a page is free, owned by exactly one tree node, or owned by exactly one running request
(the pages of its positions [prefix_len, kv_len); prefix_len is a multiple of the page size). Tree
pages reachable from a locked node are in use by a request and are never freed. SWA models: a node is either SWA-resident (every slot it holds has an
SWA slot) or a tombstone (none has; its FULL slots are still cached).
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Iterator, NamedTuple

import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD
from pytest_kvcanary.canary.seam import CacheWalk

from .kv_pool import KVPools, ReqToTokenPool, slot_pages
from .radix_node import Node
from .request import Request


class MatchResult(NamedTuple):
    """slots: FULL slots of the matched prefix; node: where the match ends (root when empty)."""

    slots: torch.Tensor
    node: Node


class InsertResult(NamedTuple):
    """prefix_len: leading tokens of the key the tree already held (their slots are the tree's);
    node: the node ending at the end of the key."""

    prefix_len: int
    node: Node


def _common_len(a: list[int], b: list[int], page_size: int) -> int:
    """Length of the common prefix of a and b, in whole pages."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n - n % page_size


class RadixCache:
    """window: the windowed layers' window for swa models (enables tombstones), else None. Keys
    inserted are whole pages of pools.page_size tokens."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, window: int | None) -> None:
        self.pools, self.req_to_token, self.window = pools, req_to_token, window
        self.page_size = pools.page_size
        self.roots: dict[int, Node] = {}  # context key -> its tree's root
        self.num_evicted = 0  # FULL slots freed by evict()
        self.num_swa_evicted = 0  # SWA slots freed by evict_swa()
        self._clock = count(1)

    def root(self, context: int = 0) -> Node:
        if context not in self.roots:
            self.roots[context] = Node([], torch.empty(0, dtype=torch.int64), None)
        return self.roots[context]

    def match_prefix(self, key: list[int], context: int = 0) -> MatchResult:
        """The longest cached prefix of key a new request may reuse, in whole pages (key is cut
        to whole pages first). The node is split so the match ends exactly at it. SWA models: the match is cut back to the last node end whose
        preceding `window` tokens (all of them, if fewer) are SWA-resident; tombstones earlier on
        the path are fine, only the full layers read them. The slots stay valid only while the
        node is locked (`lock`); call it before anything that may evict."""
        path = list(self._descend(key, context))
        if self.window is not None:
            best, run, depth = 0, 0, 0
            for j, node in enumerate(path):
                depth += len(node.key)
                run = 0 if node.tombstone else run + len(node.key)
                if not node.tombstone and (run >= self.window or run == depth):
                    best = j + 1
            path = path[:best]
        tick = next(self._clock)
        for node in path:
            node.last_access = tick
        node = path[-1] if path else self.root(context)
        return MatchResult(self._path_slots(node), node)

    def insert(self, key: list[int], slots: torch.Tensor, swa_from: int = 0, context: int = 0) -> InsertResult:
        """Cache key (whole pages) with its FULL slots (whole pages). Where the tree already holds
        a prefix of key it keeps its own slots: the caller's slots for that prefix are duplicates,
        the caller's to free (those it got from the tree excepted). swa_from (swa models, a page
        boundary): slots[i] has an SWA slot iff i >= swa_from; new tokens below it become
        tombstones, and a tombstone at or above it takes over the caller's SWA slot there (so the
        duplicate it then frees has none)."""
        assert len(key) % self.page_size == 0 and swa_from % self.page_size == 0, "insert of a partial page"
        if self.pools.swa is None:
            swa_from = 0
        tick, node, i = next(self._clock), self.root(context), 0
        for node in list(self._descend(key, context)):
            a, i = i, i + len(node.key)
            if node.tombstone and i > swa_from:
                if a < swa_from:
                    self._split(node, swa_from - a)
                self.pools.swa.move(self._pages(slots[max(a, swa_from):i]), self._pages(node.value))
                node.tombstone = False
            node.last_access = tick
        prefix_len = i
        if i < min(swa_from, len(key)):
            node = self._add(node, key[i:swa_from], slots[i:swa_from], tombstone=True, tick=tick)
            i = min(swa_from, len(key))
        if i < len(key):
            node = self._add(node, key[i:], slots[i:], tombstone=False, tick=tick)
        return InsertResult(prefix_len, node)

    def cache_unfinished_req(self, req: Request) -> None:
        """After a prefill: cache the request's KV tokens in whole pages and make it share the
        tree's copy. Where the tree already held some of them (a duplicate prompt inserted first in
        the same batch), the request's row is rewritten to the tree's slots and its own duplicates
        are freed. The request then owns only its partial last page, if any: prefix_len = kv_len
        rounded down to a page, locked through the new last_node."""
        res = self._insert_req(req)
        tree_slots = self._path_slots(res.node)
        self.req_to_token.write(req.row, req.prefix_len, tree_slots[req.prefix_len:])
        self.lock(res.node)
        self.unlock(req.last_node)
        req.prefix_len, req.last_node = tree_slots.numel(), res.node

    def cache_finished_req(self, req: Request) -> None:
        """When a request finishes: cache its KV tokens in whole pages, free its duplicates and its
        partial last page, unlock its path. Its row no longer owns any slot (the caller frees the
        row)."""
        cached = self._path_slots(self._insert_req(req).node).numel()
        self.pools.free(self.req_to_token.pages(req.row, cached, req.kv_len), "a finished request's partial last page")
        self.unlock(req.last_node)
        req.prefix_len, req.last_node = 0, None

    def lock(self, node: Node | None) -> None:
        """Protect node and its ancestors from eviction (one reference per holder)."""
        while node is not None and node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node = node.parent

    def evict(self, n: int) -> int:
        """Free whole unlocked leaves, least recently used first (a parent left childless and
        unlocked becomes a leaf), until at least n FULL slots are freed or none is left. Returns
        the number freed, which may exceed n; evict(0) does nothing."""
        heap = [self._lru_key(x) for x in self._nodes() if not x.children and not x.lock_ref]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            node = heapq.heappop(heap)[-1]
            self.pools.free(self._pages(node.value), "evicted from the radix cache")
            freed += len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if parent.parent is not None and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, self._lru_key(parent))
        self.num_evicted += freed
        return freed

    def evict_swa(self, n: int) -> int:
        """Tombstone unlocked SWA-resident nodes, least recently used first, until at least n SWA
        slots are freed; their FULL slots stay cached. Returns the number of SWA slots freed."""
        assert self.pools.swa is not None
        freed = 0
        for *_, node in sorted(self._lru_key(x) for x in self._nodes() if not x.lock_ref and not x.tombstone):
            if freed >= n:
                break
            freed += self.pools.swa.unmap(self._pages(node.value), "SWA slots evicted from the radix cache")
            node.tombstone = True
        self.num_swa_evicted += freed
        return freed

    def walk(self) -> CacheWalk:
        """Every slot the trees hold with its position, previous slot on its path (PREV_CHAIN_HEAD
        at position 0), token, whether a request holds it locked, and its context."""
        parts: list[tuple[torch.Tensor, ...]] = []
        stack = [(child, 0, PREV_CHAIN_HEAD, context) for context, root in self.roots.items()
                 for child in root.children.values()]
        while stack:
            node, start, prev, context = stack.pop()
            n = len(node.key)
            parts.append((node.value, torch.arange(start, start + n), torch.cat([torch.tensor([prev]), node.value[:-1]]),
                          torch.tensor(node.key, dtype=torch.int64), torch.full((n,), node.lock_ref > 0),
                          torch.full((n,), context, dtype=torch.int64)))
            stack.extend((c, start + n, int(node.value[-1]), context) for c in node.children.values())
        if not parts:
            empty = torch.empty(0, dtype=torch.int64)
            return CacheWalk(empty, empty, empty, empty, torch.empty(0, dtype=torch.bool), empty)
        return CacheWalk(*(torch.cat(col) for col in zip(*parts)))

    def reset(self) -> None:
        """Free every cached slot. No request may hold a lock."""
        for node in self._nodes():
            assert not node.lock_ref, "reset while a request holds the cache"
            self.pools.free(self._pages(node.value), "radix cache flushed")
        self.roots.clear()

    def _insert_req(self, req: Request) -> InsertResult:
        """Insert the request's KV tokens in whole pages; free its duplicates."""
        cached = req.kv_len - req.kv_len % self.page_size
        slots = self.req_to_token.read(req.row, 0, cached)
        res = self.insert(req.token_ids[:cached], slots, swa_from=max(req.swa_from, req.prefix_len),
                          context=req.context_key)
        self.pools.free(self._pages(slots[req.prefix_len:res.prefix_len]),
                        "radix dedup freed the duplicate's slot (its row now points at the cached copy)")
        return res

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slot_pages(slots, self.page_size)

    def _child_key(self, key: list[int]) -> int | tuple[int, ...]:
        """What a node's parent files it under: its first token, or with pages its first page."""
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    def _descend(self, key: list[int], context: int) -> Iterator[Node]:
        """The nodes matching key from the context's root, the last one split to end at the match."""
        node, i = self.root(context), 0
        while i < len(key) and (child := node.children.get(self._child_key(key[i:]))) is not None:
            node = child
            n = _common_len(node.key, key[i:], self.page_size)
            if n < len(node.key):
                node = self._split(node, n)
            yield node
            i += n

    def _split(self, node: Node, n: int) -> Node:
        """Cut node after its first n tokens; returns the new upper part (same locks, age, state)."""
        top = Node(node.key[:n], node.value[:n], node.parent, node.tombstone)
        top.lock_ref, top.last_access = node.lock_ref, node.last_access
        top.children = {self._child_key(node.key[n:]): node}
        node.parent.children[self._child_key(node.key)] = top
        node.key, node.value, node.parent = node.key[n:], node.value[n:], top
        return top

    def _add(self, parent: Node, key: list[int], value: torch.Tensor, tombstone: bool, tick: int) -> Node:
        node = Node(key, value, parent, tombstone)
        node.last_access = tick
        parent.children[self._child_key(key)] = node
        return node

    def _path_slots(self, node: Node) -> torch.Tensor:
        values = [node.value]
        while node.parent is not None:
            node = node.parent
            values.append(node.value)
        return torch.cat(values[::-1])

    def _nodes(self) -> Iterator[Node]:
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _lru_key(node: Node) -> tuple[int, int, Node]:
        return node.last_access, int(node.value[0]), node
