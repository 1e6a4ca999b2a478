"""A node of the radix cache's tree (reference_engine/radix_cache.py; its host and disk copies kept by
reference_engine/radix_tiers.py), which a running request locks."""

from __future__ import annotations

import torch


class Node:
    """An edge of the tree: tokens (key) and their FULL slots (value; None once written back to
    the host tier and freed on the device), and their host slots when the host tier holds a copy
    (host_value). lock_ref: running requests whose cached prefix passes through here. tombstone:
    the SWA slots of value were freed. state: a hybrid model's checkpoint, the state slot holding
    the recurrent state after the node's last token (None: no state is cached there); host_state:
    the host tier's copy of it, a host state slot (written back with the node's pages). disk_keys:
    with a disk tier, the keys of the files holding the node's pages, page by page, once host memory
    evicted them (value and host_value are None then)."""

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: Node | None,
                 tombstone: bool = False) -> None:
        self.key = key  # tokens of this edge
        self.value = value  # their FULL slots, CPU int64
        self.host_value: torch.Tensor | None = None  # their host slots, CPU int64
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.tombstone = tombstone
        self.state: int | None = None
        self.host_state: int | None = None
        self.disk_keys: list[str] | None = None  # their files in the disk tier, page by page
