"""A radix tree over token ids whose nodes own FULL-pool pages (SGLang's RadixCache; with page_size
> 1 its paged variant: keys in page-size chunks, a match rounded down to whole pages, nodes split
and evicted at page boundaries, a request's partial last page never cached).

KV is shared only within one context (a cache salt or adapter id, the request's context_key): each
context has a tree of its own, so equal tokens under different contexts never match.

Ownership: a page is free, owned by exactly one tree node, or owned by exactly one running request
(the pages of its positions [prefix_len, kv_len); prefix_len is a multiple of the page size). Tree
pages reachable from a locked node are in use by a request and are never freed. SWA models: a node
is either SWA-resident (every slot it holds has an SWA slot) or a tombstone (none has; its FULL
slots are still cached).

Below the device pages (radix_tiers.py, `LowerTiers`, which this cache owns): with a host tier,
evicting a node writes its pages back to host memory and keeps it in the tree device-evicted (value
None); with a disk tier under it, a node host memory evicts stays disk-resident. A match runs on
through such nodes (`MatchResult.host_node`), disk-resident ones brought into host memory on the
way, and `load_back` gives them device pages again. This module keeps the trees, their device
pages and checkpoints; the tiers keep the copies below and reach the trees through `_nodes`,
`_drop`, `lock` / `unlock` and `_tokens`.

Hybrid models (a state pool): a node may own a checkpoint, the state slot holding the recurrent
state after its last token (`Node.state`); a match ends at the deepest node of its path that has
one, whose state a new request's running slot starts from. A request's checkpoint joins the tree
when its KV is inserted (`_insert_req`); a node that leaves the tree frees its checkpoint, and
`evict_states` drops unlocked nodes' checkpoints (their KV stays cached) when state slots run short.
With a host tier a match may end at a node whose checkpoint only the host holds (`Node.host_state`,
radix_tiers.py); `load_state` brings it back.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Callable, Iterator, NamedTuple

import torch

from kvcanary_kernels.records import PREV_CHAIN_HEAD
from pytest_kvcanary.canary.seam import CacheWalk, CheckpointWalk

from .disk_tier import DiskTier
from .host_tier import HostKVCache
from .kv_pool import KVPools, ReqToTokenPool, page_slots, slot_pages
from .radix_node import Node
from .radix_tiers import (  # the tiers' causes are re-exported: every cause this cache frees with, here
    CAUSE_DISK_REFUSED, CAUSE_HOST_DROPPED, CAUSE_HOST_EVICTED, CAUSE_STORED, CAUSE_WRITTEN_BACK, LowerTiers)
from .request import Request
from .state_pool import StatePool

__all__ = ["CAUSE_DISK_REFUSED", "CAUSE_EVICTED", "CAUSE_HOST_DROPPED", "CAUSE_HOST_EVICTED", "CAUSE_STATE_DUPLICATE",
           "CAUSE_STATE_EVICTED", "CAUSE_STORED", "CAUSE_WRITTEN_BACK", "InsertResult", "MatchResult", "RadixCache"]

CAUSE_EVICTED = "evicted from the radix cache"
CAUSE_STATE_EVICTED = "checkpoint evicted from the radix cache"
CAUSE_STATE_DUPLICATE = "radix dedup freed the duplicate checkpoint (the cache holds one there)"


class MatchResult(NamedTuple):
    """slots: FULL slots of the matched prefix on the device; node: where that ends (root when
    empty). host_node: with a host tier, where the match ends past node through device-evicted
    nodes (None: it ends at node); host_len: the tokens from node to host_node."""

    slots: torch.Tensor
    node: Node
    host_node: Node | None = None
    host_len: int = 0


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
    """window: the windowed layers' window for swa models (enables tombstones), else None.
    host_tier: where evicted pages are written back to, or None. states: a hybrid model's state
    pool (checkpoints), or None. disk_tier: where pages host memory evicts are stored (with a host
    tier), or None; both tiers are kept by `tiers`. Keys inserted are whole pages of
    pools.page_size tokens."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, window: int | None,
                 host_tier: HostKVCache | None = None, states: StatePool | None = None,
                 disk_tier: DiskTier | None = None) -> None:
        self.pools, self.req_to_token, self.window, self.states = pools, req_to_token, window, states
        self.num_states_evicted = 0  # checkpoints dropped by evict_states()
        self._checkpoints: CheckpointWalk | None = None  # the last checkpoint_walk, while the checkpoints stand
        self._walk: CacheWalk | None = None  # the last walk, while the trees, their slots and locks stand
        self.page_size = pools.page_size
        self.roots: dict[int, Node] = {}  # context key -> its tree's root
        self.num_evicted = 0  # FULL slots freed by evict()
        self.num_swa_evicted = 0  # SWA slots freed by evict_swa()
        self._clock = count(1)
        self.tiers = LowerTiers(self.page_size, host_tier, disk_tier, states, nodes=self._nodes, drop=self._drop,
                                lock=self.lock, unlock=self.unlock, tokens=self._tokens)

    def root(self, context: int = 0) -> Node:
        if context not in self.roots:
            self.roots[context] = Node([], torch.empty(0, dtype=torch.int64), None)
        return self.roots[context]

    def match_prefix(self, key: list[int], context: int = 0) -> MatchResult:
        """The longest cached prefix of key a new request may reuse, in whole pages (key is cut
        to whole pages first). The node is split so the match ends exactly at it. SWA models: the
        match is cut back to the last node end whose preceding `window` tokens (all of them, if
        fewer) are SWA-resident; tombstones earlier on the path are fine, only the full layers read
        them. The slots stay valid only while the node is locked (`lock`); call it before anything
        that may evict. With a host tier the match runs on through device-evicted nodes
        (host_node, host_len), which `load_back` brings back; with a disk tier, through
        disk-resident nodes too, which are brought into host memory here (up to the first that
        cannot come back)."""
        key = key[:len(key) - len(key) % self.page_size]
        path = list(self._descend(key, context))
        resident = [node for node in path if node.value is not None]  # a prefix of the path
        host, path = path[len(resident):], resident
        if self.tiers.disk_tier is not None and host:
            host = self.tiers.promote(host, key, context, sum(len(node.key) for node in resident))
        if self.window is not None:
            best, run, depth = 0, 0, 0
            for j, node in enumerate(path):
                depth += len(node.key)
                run = 0 if node.tombstone else run + len(node.key)
                if not node.tombstone and (run >= self.window or run == depth):
                    best = j + 1
            path = path[:best]
        if self.states is not None:  # a hybrid model reuses a prefix only where its state is cached
            both = path + host
            end = max((j + 1 for j, node in enumerate(both) if node.state is not None or node.host_state is not None),
                      default=0)
            path, host = both[:min(end, len(path))], both[len(path):end]
        tick = next(self._clock)
        for node in path + host:
            node.last_access = tick
        node = path[-1] if path else self.root(context)
        if not host:
            return MatchResult(self._path_slots(node), node)
        return MatchResult(self._path_slots(node), node, host[-1], sum(len(n.key) for n in host))

    def load_back(self, match: MatchResult, pages: torch.Tensor,
                  on_done: Callable[[], None] | None = None) -> MatchResult:
        """Give the device-evicted nodes of a match (node to host_node) these device pages and load
        their KV back from the host tier into them (launched; the engine's next forward waits for
        it), keeping the host copy. Returns the match ending at host_node. The caller holds a lock
        on host_node (allocating the pages may evict), to release in on_done, which the host tier
        runs once the copy is over."""
        nodes = []
        node = match.host_node
        while node is not match.node:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        slots = page_slots(pages, self.page_size)
        self.tiers.load_back(nodes, slots, on_done)
        for node, value in zip(nodes, slots.split([len(n.key) for n in nodes])):
            node.value = value
        self._changed()
        return MatchResult(self._path_slots(match.host_node), match.host_node)

    def insert(self, key: list[int], slots: torch.Tensor, swa_from: int = 0, context: int = 0) -> InsertResult:
        """Cache key (whole pages) with its FULL slots (whole pages). Where the tree already holds
        a prefix of key it keeps its own slots: the caller's slots for that prefix are duplicates,
        the caller's to free (those it got from the tree excepted); a device-evicted node on the
        way takes the caller's slots instead (they are no duplicates). swa_from (swa models, a page
        boundary): slots[i] has an SWA slot iff i >= swa_from; new tokens below it become
        tombstones, and a tombstone at or above it takes over the caller's SWA slot there (so the
        duplicate it then frees has none)."""
        assert len(key) % self.page_size == 0 and swa_from % self.page_size == 0, "insert of a partial page"
        if self.pools.swa is None:
            swa_from = 0
        tick, node, i, held = next(self._clock), self.root(context), 0, None
        for node in list(self._descend(key, context)):
            a, i = i, i + len(node.key)
            if node.value is None:  # device-evicted: the caller's slots hold its tokens now
                node.value, held = slots[a:i], a if held is None else held
                self._changed()
                self.tiers.delete_files(node)
            if node.tombstone and i > swa_from:
                if a < swa_from:
                    self._split(node, swa_from - a)
                self.pools.swa.move(self._pages(slots[max(a, swa_from):i]), self._pages(node.value))
                node.tombstone = False
            node.last_access = tick
        prefix_len = i if held is None else held
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
        self._changed()
        while node is not None and node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        self._changed()
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node = node.parent

    def evict(self, n: int) -> int:
        """Free the device pages of whole unlocked leaves (nodes no device-resident node hangs
        from), least recently used first (a parent left so and unlocked becomes a leaf), until at
        least n FULL slots are freed or none is left. With a host tier a leaf is written back to
        host memory first and stays in the tree, device-evicted; without one, or when host memory
        cannot hold it, it leaves the tree. Returns the number freed, which may exceed n; evict(0)
        does nothing."""
        heap = [self._lru_key(x) for x in self._nodes() if self._device_leaf(x) and not x.lock_ref]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            node = heapq.heappop(heap)[-1]
            freed += len(node.key)
            if self.tiers.back_up(node):
                self.pools.free(self._pages(node.value), CAUSE_WRITTEN_BACK)
                node.value = None
                self.tiers.back_up_state(node)
                self._changed()
            else:
                self.pools.free(self._pages(node.value), CAUSE_EVICTED)
                self._drop(node)
            parent = node.parent
            if parent.parent is not None and self._device_leaf(parent) and not parent.lock_ref:
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

    def load_state(self, node: Node, slot: int) -> None:
        """Load a node's checkpoint back from the host tier into device state slot `slot` (launched;
        the engine's stream waits for it before a state copy or forward reads it), keeping the host
        copy."""
        self.tiers.load_state(node, slot)
        self._changed()

    def evict_states(self, n: int) -> int:
        """Drop the checkpoints of unlocked nodes, least recently used first, until at least n
        state slots are freed or none is left (their KV stays cached). Returns the number freed."""
        nodes = sorted((self._lru_key(x) for x in self._nodes() if x.state is not None and not x.lock_ref),
                       key=lambda key: key[:2])
        freed = [node.state for *_, node in nodes[:n]]
        for *_, node in nodes[:n]:
            node.state = None
        self._changed()
        self.states.free(freed, CAUSE_STATE_EVICTED)
        self.num_states_evicted += len(freed)
        return len(freed)

    def checkpoint_walk(self) -> CheckpointWalk:
        """Every checkpoint the trees hold: its state slot, the tokens it summarizes, the FULL slot
        of its last token, whether a request holds its path locked, and its context. The same
        object while no checkpoint and no lock changed."""
        if self._checkpoints is None:
            self._checkpoints = self._walk_checkpoints()
        return self._checkpoints

    def _walk_checkpoints(self) -> CheckpointWalk:
        rows: list[tuple[int, int, int, bool, int]] = []
        stack = [(child, 0, context) for context, root in self.roots.items() for child in root.children.values()]
        while stack:
            node, start, context = stack.pop()
            end = start + len(node.key)
            if node.state is not None:
                rows.append((node.state, end, int(node.value[-1]), node.lock_ref > 0, context))
            stack.extend((c, end, context) for c in node.children.values())
        columns = list(zip(*rows)) if rows else [()] * 5
        return CheckpointWalk(*(torch.tensor(c, dtype=torch.int64) for c in columns[:3]),
                              torch.tensor(columns[3], dtype=torch.bool), torch.tensor(columns[4], dtype=torch.int64))

    def walk(self) -> CacheWalk:
        """Every slot the trees hold on the device with its position, previous slot on its path
        (PREV_CHAIN_HEAD at position 0), token, whether a request holds it locked, and its context.
        The same object while no node, slot or lock changed (a canary plans a walk it saw once)."""
        if self._walk is None:
            self._walk = self._walk_nodes()
        return self._walk

    def _changed(self) -> None:
        """A node, its slots, a lock or a checkpoint changed: the next walks are taken afresh."""
        self._walk = self._checkpoints = None

    def _walk_nodes(self) -> CacheWalk:
        parts: list[tuple[torch.Tensor, ...]] = []
        stack = [(child, 0, PREV_CHAIN_HEAD, context) for context, root in self.roots.items()
                 for child in root.children.values()]
        while stack:
            node, start, prev, context = stack.pop()
            if node.value is None:  # device-evicted, and so is everything below
                continue
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
        """Free every cached slot, on the device and in host memory. No request may hold a lock."""
        for node in self._nodes():
            assert not node.lock_ref, "reset while a request holds the cache"
            if node.value is not None:
                self.pools.free(self._pages(node.value), "radix cache flushed")
            self.tiers.free_host_value(node, "radix cache flushed")
            if node.state is not None:
                self.states.free([node.state], "radix cache flushed")
            self.tiers.free_host_state(node, "radix cache flushed")
            self.tiers.delete_files(node)
        self.roots.clear()
        self._changed()

    def _insert_req(self, req: Request) -> InsertResult:
        """Insert the request's KV tokens in whole pages; free its duplicates. A checkpoint the
        request's last forward wrote goes to the node ending at its length (split there), unless
        that node has one already."""
        cached = req.kv_len - req.kv_len % self.page_size
        slots = self.req_to_token.read(req.row, 0, cached)
        res = self.insert(req.token_ids[:cached], slots, swa_from=max(req.swa_from, req.prefix_len),
                          context=req.context_key)
        self.pools.free(self._pages(slots[req.prefix_len:res.prefix_len]),
                        "radix dedup freed the duplicate's slot (its row now points at the cached copy)")
        if req.checkpoint is not None:
            slot, length = req.checkpoint
            req.checkpoint = None
            self._changed()
            node = list(self._descend(req.token_ids[:length], req.context_key))[-1]
            if node.state is None:
                node.state = slot
            else:
                self.states.free([slot], CAUSE_STATE_DUPLICATE)
        return res

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slot_pages(slots, self.page_size)

    @staticmethod
    def _device_leaf(node: Node) -> bool:
        """Device-resident, and no device-resident node hangs from it."""
        return node.value is not None and all(c.value is None for c in node.children.values())

    def _tokens(self, node: Node) -> tuple[int, list[int]]:
        """The context of the node's tree and the tokens from its root to the node's end."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        context = next(c for c, root in self.roots.items() if root is node)
        return context, [t for k in reversed(keys) for t in k]

    def _drop(self, node: Node) -> None:
        """Take a node out of the tree, freeing its checkpoint and the host copies (and disk files)
        it and the device-evicted nodes below it hold."""
        del node.parent.children[self._child_key(node.key)]
        if node.state is not None:
            self.states.free([node.state], CAUSE_EVICTED)
            node.state = None
        self._changed()
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            self.tiers.free_copies(below)
            stack.extend(below.children.values())
        self.tiers.free_copies(node)

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
        def cut(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return (None, None) if slots is None else (slots[:n], slots[n:])

        (top_value, node.value), (top_host, node.host_value) = cut(node.value), cut(node.host_value)
        top = Node(node.key[:n], top_value, node.parent, node.tombstone)
        top.host_value = top_host
        if node.disk_keys is not None:
            top.disk_keys, node.disk_keys = node.disk_keys[:n // self.page_size], node.disk_keys[n // self.page_size:]
        top.lock_ref, top.last_access = node.lock_ref, node.last_access
        top.children = {self._child_key(node.key[n:]): node}
        node.parent.children[self._child_key(node.key)] = top
        node.key, node.parent = node.key[n:], top
        return top

    def _add(self, parent: Node, key: list[int], value: torch.Tensor, tombstone: bool, tick: int) -> Node:
        node = Node(key, value, parent, tombstone)
        node.last_access = tick
        parent.children[self._child_key(key)] = node
        self._changed()
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
