"""The radix cache's lower tiers: the copies of its nodes' KV (and checkpoints) kept under the device
pages, in host memory and on disk. radix_cache.py owns the trees and the device pages; `LowerTiers`
owns these copies and reaches the trees only through the few operations it is handed.

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
runs on through disk-resident nodes: `promote` brings them into host memory (their files read,
checked and deleted, the canary's records coming back with the bytes), the rest as from the host
tier. A page refused at load (disk_tier.py says why) ends the match there, and its node leaves the
tree. When the disk is full, disk-resident leaves are dropped, least recently used first.

Hybrid models: a node written back takes its checkpoint to a host state slot (`Node.host_state`),
so a match may end at a node whose checkpoint is only there; `load_state` brings it back.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Callable, Iterator

import torch

from .disk_tier import DiskTier
from .host_tier import HostKVCache
from .kv_pool import page_slots, slot_pages
from .radix_node import Node
from .state_pool import StatePool

CAUSE_WRITTEN_BACK = "written back to host memory (device copy freed)"
CAUSE_HOST_EVICTED = "host copy evicted from host memory"
CAUSE_HOST_DROPPED = "host copy freed: its node left the radix cache"
CAUSE_STORED = "host copy stored to disk (host pages freed)"
CAUSE_DISK_REFUSED = "a page loaded back from disk was refused"


class LowerTiers:
    """The host and disk copies of a radix cache's nodes. host_tier / disk_tier: None when there is
    no such tier (disk_tier only under a host tier); states: a hybrid model's state pool, or None.
    The trees are reached through these only: nodes() yields every node of every tree (roots
    excepted); drop(node) takes a node out of its tree, freeing its copies (`free_copies`) and those
    below it; lock / unlock(node) pin a node's path against eviction; tokens(node) gives the context
    of its tree and the tokens from the root to the node's end."""

    def __init__(self, page_size: int, host_tier: HostKVCache | None, disk_tier: DiskTier | None,
                 states: StatePool | None, *, nodes: Callable[[], Iterator[Node]], drop: Callable[[Node], None],
                 lock: Callable[[Node], None], unlock: Callable[[Node], None],
                 tokens: Callable[[Node], tuple[int, list[int]]]) -> None:
        self.page_size, self.host_tier, self.disk_tier, self.states = page_size, host_tier, disk_tier, states
        self._nodes, self._drop, self._lock, self._unlock, self._tokens = nodes, drop, lock, unlock, tokens

    def back_up(self, node: Node) -> bool:
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

    def back_up_state(self, node: Node) -> bool:
        """A node written back takes its checkpoint to the host tier (where it has none there and
        a host state slot is free); its device state slot is freed either way. Returns whether the
        node had a checkpoint on the device (the caller's checkpoint walk is stale then)."""
        if node.state is None:
            return False
        if node.host_state is None:
            node.host_state = self.host_tier.alloc_state()
            if node.host_state is not None:
                self.host_tier.write_back_state(node.state, node.host_state)
        self.states.free([node.state], CAUSE_WRITTEN_BACK)
        node.state = None
        return True

    def load_back(self, nodes: list[Node], slots: torch.Tensor, on_done: Callable[[], None] | None) -> None:
        """Load the host copies of device-evicted nodes (in path order) into these device slots, as
        many as their tokens (launched; on_done runs once the copy is over), keeping the host copy."""
        self.host_tier.load_back(torch.cat([n.host_value for n in nodes]), slots, on_done)

    def load_state(self, node: Node, slot: int) -> None:
        """Load a node's checkpoint back from the host tier into device state slot `slot` (launched),
        keeping the host copy; the node's checkpoint is that slot then."""
        self.host_tier.load_back_state(node.host_state, slot)
        node.state = slot

    def promote(self, nodes: list[Node], key: list[int], context: int, start: int) -> list[Node]:
        """Bring the disk-resident nodes of a match's device-evicted part (nodes, from token start
        of key) into host memory, top-down; the part up to the first that did not come back (no
        host room, or a page refused at load: that node leaves the tree with what hangs below)."""
        self._lock(nodes[-1])  # making host room must not take what is on the way
        done, refused = len(nodes), None
        for j, node in enumerate(nodes):
            end = start + len(node.key)
            if node.host_value is None:
                loaded = self._load_from_disk(node, key[:end], context)
                if loaded is not True:
                    done, refused = j, node if loaded is False else None
                    break
            start = end
        self._unlock(nodes[-1])
        if refused is not None:
            self._drop(refused)
        return nodes[:done]

    def free_copies(self, node: Node) -> None:
        """Free the host copy, host checkpoint and disk files of a node leaving the tree."""
        self.free_host_value(node, CAUSE_HOST_DROPPED)
        self.free_host_state(node, CAUSE_HOST_DROPPED)
        self.delete_files(node)

    def free_host_value(self, node: Node, cause: str) -> None:
        """Free the node's host pages, if it holds any."""
        if node.host_value is not None:
            self.host_tier.free(self._pages(node.host_value), cause)
            node.host_value = None

    def free_host_state(self, node: Node, cause: str) -> None:
        """Free the node's host checkpoint, if it holds one."""
        if node.host_state is not None:
            self.host_tier.free_state(node.host_state, cause)
            node.host_state = None

    def delete_files(self, node: Node) -> None:
        """Delete the node's disk files, if it has any."""
        if node.disk_keys is not None:
            self.disk_tier.delete(node.disk_keys)
            node.disk_keys = None

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slot_pages(slots, self.page_size)

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
            self.free_host_value(node, CAUSE_STORED if stored else CAUSE_HOST_EVICTED)
            self.free_host_state(node, CAUSE_HOST_EVICTED)
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
