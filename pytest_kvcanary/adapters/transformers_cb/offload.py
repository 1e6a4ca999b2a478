"""transformers' CPU offloading (5.18+) as the seam's HostTier.

When its cache runs short, transformers offloads starved requests: with a CPU swap pool
(``cpu_offload_space`` > 0) it copies their blocks there (``OffloadingManager._offload_to_cpu``)
after freeing them, and once such a request is scheduled again copies them back into the blocks the
scheduler gave it (``restore_scheduled_requests``) and frees the CPU blocks; requests that do not fit
the pool are soft-reset (recomputed). Both copies run on transformers' compute stream. This module
announces each copy to the tier's listeners (per pool group: the blocks' slots, the CPU blocks'
slots, position by position) right after transformers launched it, on that stream, and every CPU
block freed, so the canary's records travel with the bytes and the first forward that reads a
restored block verifies it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from ...canary.seam import HostPool, HostTierListener
from ..patches import Patches
from .versions import SectorLayout

CAUSE_RESTORED = "restored to the device: the CPU copy freed"
CAUSE_CANCELLED = "offloaded request dropped: its CPU copy freed"


def _slots(blocks: list[int], page_size: int) -> torch.Tensor:
    """The slots of these blocks, block by block."""
    return (torch.tensor(blocks, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).flatten()


class CpuOffloadTier:
    """Wraps the processor's OffloadingManager (which must have a CPU pool) through `patches`.
    pools: per pool group, the group's layers in the CPU pool (HostPool)."""

    def __init__(self, processor: Any, layout: SectorLayout, patches: Patches) -> None:
        manager = processor.offloading_manager
        self._manager, self._layout = manager, layout
        self._groups = {g.key: g for g in layout.groups}  # allocator name -> group
        self.pools = [HostPool(group.kind, k, v, num_blocks * group.page_size)
                      for group, k, v, num_blocks in layout.cpu_pools(manager._cpu_tensor)]
        self._listeners: list[HostTierListener] = []
        offload, restore, drop = manager._offload_to_cpu, manager.restore_scheduled_requests, \
            manager.free_request_cpu_cache

        def offload_to_cpu(victims: list[Any], tables: dict[str, dict[str, list[int]]]) -> set[str]:
            done = offload(victims, tables)
            with self._stream():
                for request_id in done:
                    for name, cpu_blocks in manager._request_id_to_cpu_blocks[request_id].items():
                        self._announce("written_back", name, tables[request_id][name][:len(cpu_blocks)], cpu_blocks)
            return done

        def restore_scheduled_requests(requests_in_batch: list[Any]) -> None:
            pairs = []  # (allocator name, device blocks, CPU blocks), as transformers pairs them
            for future in requests_in_batch:
                state = future.state
                if state.is_cpu_offloaded:
                    for name, cpu_blocks in manager._request_id_to_cpu_blocks[state.request_id].items():
                        device = self._layout.cache.cache_allocators[name].block_table.get(state.request_id, [])
                        n = min(len(cpu_blocks), len(device))
                        pairs.append((name, device[:n], cpu_blocks))
            restore(requests_in_batch)
            with self._stream():
                for name, device, cpu_blocks in pairs:
                    self._announce("loaded_back", name, device, cpu_blocks[:len(device)])
                    self._freed(name, cpu_blocks, CAUSE_RESTORED)

        def free_request_cpu_cache(state: Any) -> None:
            held = dict(manager._request_id_to_cpu_blocks.get(state.request_id, {})) if state.is_cpu_offloaded else {}
            drop(state)
            for name, cpu_blocks in held.items():
                self._freed(name, cpu_blocks, CAUSE_CANCELLED)

        patches.replace(manager, "_offload_to_cpu", offload_to_cpu)
        patches.replace(manager, "restore_scheduled_requests", restore_scheduled_requests)
        patches.replace(manager, "free_request_cpu_cache", free_request_cpu_cache)

    def add_listener(self, listener: HostTierListener) -> None:
        self._listeners.append(listener)

    def synchronize(self) -> None:
        stream = self._manager._compute_stream
        if stream is not None:
            stream.synchronize()

    def _stream(self) -> Any:
        """transformers' compute stream, where it launched the copies (none on a CPU)."""
        stream = self._manager._compute_stream
        return nullcontext() if stream is None else torch.cuda.stream(stream)

    def _announce(self, event: str, name: str, blocks: list[int], cpu_blocks: list[int]) -> None:
        group = self._groups[name]
        slots, host = _slots(blocks, group.page_size), _slots(cpu_blocks, group.page_size)
        for listener in self._listeners:
            if event == "written_back":
                listener.written_back(group.kind, slots, host)
            else:
                listener.loaded_back(group.kind, host, slots)

    def _freed(self, name: str, cpu_blocks: list[int], cause: str) -> None:
        group = self._groups[name]
        host = _slots(cpu_blocks, group.page_size)
        for listener in self._listeners:
            listener.host_freed(group.kind, host, cause)
