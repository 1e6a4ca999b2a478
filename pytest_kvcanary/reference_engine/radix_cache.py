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

With a host tier (host_tier.py), evicting a node writes its pages back to host memory first (unless
the tier holds a copy already) and keeps the node, device-evicted (value None), in the tree; a host
page is free or owned by exactly one node (host_value). Eviction goes bottom-up, so a device-evicted
node's descendants are device-evicted too. A match may run on through device-evicted nodes; the
scheduler then gives them device pages and loads their KV back (`load_back`). When host memory runs
short, device-evicted leaves are dropped, least recently used first (their host copy freed).

With a disk tier under the host tier (disk_tier.py), host memory running short stores those leaves'
pages to disk instead (one file per page) and keeps the node, disk-resident (value and host_value
None, disk_keys set); a node is device-resident, host-resident or disk-resident, in that order down
any path (host eviction takes host-resident nodes whose children are all disk-resident). A match
runs on through disk-resident nodes: `match_prefix` brings them into host memory (their files read,
checked and deleted, the canary's records coming back with the bytes), the rest as from the host
tier. A page refused at load (disk_tier.py says why) ends the match there, and its node leaves the
tree. When the disk is full, disk-resident leaves are dropped, least recently used first.

Hybrid models (a state pool): a node may own a checkpoint, the state slot holding the recurrent
state after its last token (`Node.state`); a match ends at the deepest node of its path that has
one, whose state a new request's running slot starts from. A request's checkpoint joins the tree
when its KV is inserted (`_insert_req`); a node that leaves the tree frees its checkpoint, and
`evict_states` drops unlocked nodes' checkpoints (their KV stays cached) when state slots run short.
With a host tier, a node written back takes its checkpoint to a host state slot (`Node.host_state`),
and a match may end at a node whose checkpoint is only there; `load_state` brings it back.
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
from .request import Request
from .state_pool import StatePool

CAUSE_WRITTEN_BACK = "written back to host memory (device copy freed)"
CAUSE_EVICTED = "evicted from the radix cache"
CAUSE_HOST_EVICTED = "host copy evicted from host memory"
CAUSE_HOST_DROPPED = "host copy freed: its node left the radix cache"
CAUSE_STORED = "host copy stored to disk (host pages freed)"
CAUSE_DISK_REFUSED = "a page loaded back from disk was refused"
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
    tier), or None. Keys inserted are whole pages of pools.page_size tokens."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, window: int | None,
                 host_tier: HostKVCache | None = None, states: StatePool | None = None,
                 disk_tier: DiskTier | None = None) -> None:
        self.pools, self.req_to_token, self.window, self.host_tier = pools, req_to_token, window, host_tier
        self.disk_tier = disk_tier
        self.states = states
        self.num_states_evicted = 0  # checkpoints dropped by evict_states()
        self._checkpoints: CheckpointWalk | None = None  # the last checkpoint_walk, while the checkpoints stand
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
        if self.disk_tier is not None and host:
            host = self._promote(host, key, context, sum(len(node.key) for node in resident))
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
        self.host_tier.load_back(torch.cat([n.host_value for n in nodes]), slots, on_done)
        for node, value in zip(nodes, slots.split([len(n.key) for n in nodes])):
            node.value = value
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
                self._delete_files(node)
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
        self._checkpoints = None
        while node is not None and node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        self._checkpoints = None
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
            if self._back_up(node):
                self.pools.free(self._pages(node.value), CAUSE_WRITTEN_BACK)
                node.value = None
                self._back_up_state(node)
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

    def _back_up_state(self, node: Node) -> None:
        """A node written back takes its checkpoint to the host tier (where it has none there and
        a host state slot is free); its device state slot is freed either way."""
        if node.state is None:
            return
        if node.host_state is None:
            node.host_state = self.host_tier.alloc_state()
            if node.host_state is not None:
                self.host_tier.write_back_state(node.state, node.host_state)
        self.states.free([node.state], CAUSE_WRITTEN_BACK)
        node.state, self._checkpoints = None, None

    def load_state(self, node: Node, slot: int) -> None:
        """Load a node's checkpoint back from the host tier into device state slot `slot` (launched;
        the engine's stream waits for it before a state copy or forward reads it), keeping the host
        copy."""
        self.host_tier.load_back_state(node.host_state, slot)
        node.state, self._checkpoints = slot, None

    def evict_states(self, n: int) -> int:
        """Drop the checkpoints of unlocked nodes, least recently used first, until at least n
        state slots are freed or none is left (their KV stays cached). Returns the number freed."""
        nodes = sorted((self._lru_key(x) for x in self._nodes() if x.state is not None and not x.lock_ref),
                       key=lambda key: key[:2])
        freed = [node.state for *_, node in nodes[:n]]
        for *_, node in nodes[:n]:
            node.state = None
        self._checkpoints = None
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
        (PREV_CHAIN_HEAD at position 0), token, whether a request holds it locked, and its context."""
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
            if node.host_value is not None:
                self.host_tier.free(self._pages(node.host_value), "radix cache flushed")
            if node.state is not None:
                self.states.free([node.state], "radix cache flushed")
            if node.host_state is not None:
                self.host_tier.free_state(node.host_state, "radix cache flushed")
            self._delete_files(node)
        self.roots.clear()
        self._checkpoints = None

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
            req.checkpoint, self._checkpoints = None, None
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

    def _back_up(self, node: Node) -> bool:
        """Whether the host tier holds a copy of the node's KV, writing it back first when it holds
        none (dropping device-evicted leaves for room when host memory is short); False without a
        host tier or room."""
        if self.host_tier is None:
            return False
        if node.host_value is None:
            pages = self._alloc_host(len(node.key) // self.page_size)
            if pages is None:
                return False
            node.host_value = page_slots(pages, self.page_size)
            self.host_tier.write_back(node.value, node.host_value)
        return True

    def _alloc_host(self, n: int) -> torch.Tensor | None:
        """n host pages, dropping host copies (`_evict_host`) for room; None when host memory cannot
        free them (more than it holds: the copies it has are kept)."""
        if n > self.host_tier.num_pages:
            return None
        if n > self.host_tier.free_pages.numel():
            self._evict_host(n)
        return self.host_tier.alloc(n)

    def _evict_host(self, n: int) -> None:
        """Free the host copies of unlocked device-evicted leaves (no node below holds a host copy),
        least recently used first (a parent left so becomes one), until n host pages are free or
        none is left: stored to disk, the node staying disk-resident, where a disk tier takes
        them; else dropped, the node leaving the tree."""
        def host_leaf(x: Node) -> bool:
            return (x.parent is not None and x.value is None and x.host_value is not None and not x.lock_ref
                    and all(c.host_value is None for c in x.children.values()))

        heap = [(x.last_access, int(x.host_value[0]), x) for x in self._nodes() if host_leaf(x)]
        heapq.heapify(heap)
        while self.host_tier.free_pages.numel() < n and heap:
            node = heapq.heappop(heap)[-1]
            stored = self._store(node)
            self.host_tier.free(self._pages(node.host_value), CAUSE_STORED if stored else CAUSE_HOST_EVICTED)
            node.host_value = None
            self._free_host_state(node, CAUSE_HOST_EVICTED)
            parent = node.parent
            if not stored:
                self._drop(node)
            if host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, int(parent.host_value[0]), parent))

    def _store(self, node: Node) -> bool:
        """Whether the disk tier took a copy of the node's host pages (their files written, the keys
        in disk_keys), dropping disk-resident leaves for room when the disk is full; False without a
        disk tier, room, or when a store failed (the pages stored before it are deleted)."""
        disk = self.disk_tier
        n = len(node.key) // self.page_size
        if disk is None or n > disk.num_pages:
            return False
        if n > disk.num_free:
            self._evict_disk(n)
        if n > disk.num_free:
            return False
        context, tokens = self._tokens(node)
        start, keys = len(tokens) - len(node.key), []
        for i, page in enumerate(node.host_value.split(self.page_size)):
            key = disk.store(context, tokens[:start + (i + 1) * self.page_size], page)
            if key is None:
                disk.delete(keys)
                return False
            keys.append(key)
        node.disk_keys = keys
        return True

    def _evict_disk(self, n: int) -> None:
        """Drop unlocked disk-resident leaves, least recently used first (a parent left so becomes
        one), their files deleted, until the disk tier has room for n pages or none is left."""
        def disk_leaf(x: Node) -> bool:
            return x.parent is not None and x.disk_keys is not None and not x.children and not x.lock_ref

        order = count()
        heap = [(x.last_access, next(order), x) for x in self._nodes() if disk_leaf(x)]
        heapq.heapify(heap)
        while self.disk_tier.num_free < n and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            self._drop(node)
            if disk_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def _promote(self, nodes: list[Node], key: list[int], context: int, start: int) -> list[Node]:
        """Bring the disk-resident nodes of a match's device-evicted part (nodes, from token start
        of key) into host memory, top-down; the part up to the first that did not come back (no
        host room, or a page refused at load: that node leaves the tree with what hangs below)."""
        self.lock(nodes[-1])  # making host room must not take what is on the way
        done, refused = len(nodes), None
        for j, node in enumerate(nodes):
            end = start + len(node.key)
            if node.host_value is None:
                loaded = self._load_from_disk(node, key[:end], context)
                if loaded is not True:
                    done, refused = j, node if loaded is False else None
                    break
            start = end
        self.unlock(nodes[-1])
        if refused is not None:
            self._drop(refused)
        return nodes[:done]

    def _load_from_disk(self, node: Node, tokens: list[int], context: int) -> bool | None:
        """Load a disk-resident node's pages (tokens: from the start of the prompt to its end) into
        new host pages, their records with them, and delete its files: True; False when the disk
        tier refused a page (the host pages freed again); None when host memory has no room."""
        pages = self._alloc_host(len(node.key) // self.page_size)
        if pages is None:
            return None
        slots, start = page_slots(pages, self.page_size), len(tokens) - len(node.key)
        for i, (key, page) in enumerate(zip(node.disk_keys, slots.split(self.page_size), strict=True)):
            end = start + (i + 1) * self.page_size
            if not self.disk_tier.load(key, context, tokens[end - self.page_size:end], page):
                self.host_tier.free(pages, CAUSE_DISK_REFUSED)
                return False
        self.disk_tier.delete(node.disk_keys)
        node.host_value, node.disk_keys = slots, None
        return True

    def _delete_files(self, node: Node) -> None:
        if node.disk_keys is not None:
            self.disk_tier.delete(node.disk_keys)
            node.disk_keys = None

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
            node.state, self._checkpoints = None, None
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            self._free_copies(below)
            stack.extend(below.children.values())
        self._free_copies(node)

    def _free_copies(self, node: Node) -> None:
        """Free the host copy, host checkpoint and disk files of a node leaving the tree."""
        if node.host_value is not None:
            self.host_tier.free(self._pages(node.host_value), CAUSE_HOST_DROPPED)
            node.host_value = None
        self._free_host_state(node, CAUSE_HOST_DROPPED)
        self._delete_files(node)

    def _free_host_state(self, node: Node, cause: str) -> None:
        if node.host_state is not None:
            self.host_tier.free_state(node.host_state, cause)
            node.host_state = None

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
