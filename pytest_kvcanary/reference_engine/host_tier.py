"""The host-memory tier behind the radix cache (SGLang's HiCache, one host level): pages the cache
evicts are written back here and loaded back into device pages on a later hit.

It holds host buffers laid out as the device pools' (the FULL pool and, with speculative decoding,
the draft pool, whose KV lives at the same FULL slots), a page allocator over them and the copies
both ways; for a hybrid model also host state slots, where the radix cache's checkpoints go with
their node's pages. On CUDA the copies run on a copy stream of their own, between pinned host memory and the
device, without the host waiting; the engine makes each forward's stream wait for every copy
launched before it (`wait`), so no forward reads a loaded-back page, or writes a device page just
written back, before the copy is over. On a CPU the same copies run synchronously.

A load-back may name what to do once its copy is known to be over (`on_done`: the scheduler
unlocks the node it loaded back, so no eviction frees those device pages while the copy still
writes them, whatever stream each copy runs on); `acknowledge` runs what is over (with seeded
jitter, up to jitter.MAX_DELAY acknowledgements late, out of order). The page and state
allocators keep a record of what they handed out: a double free, or the free of a page or state
slot never handed out, is a bug and asserts, as the device pools do.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from kvcanary_kernels.records import GroupKind, Half
from pytest_kvcanary.canary.seam import HostPool, HostTierListener, copy_runs

from .config import EngineConfig
from .jitter import Jitter
from .kv_pool import KVPools, page_slots
from .state_pool import StatePool


class HostKVCache:
    """host_num_slots host slots in pages of the pools' page size (every page usable). pools: a
    `HostPool` per device pool it backs (FULL, DRAFT). num_written_back / num_loaded_back: pages
    copied each way since the engine started. states: a hybrid model's state pool, whose
    checkpoints it keeps in num_state_slots host state slots (pools then holds a STATE HostPool;
    num_states_written_back / num_states_loaded_back count them). Implements the seam's HostTier."""

    def __init__(self, config: EngineConfig, pools: KVPools, device: torch.device,
                 states: StatePool | None = None, jitter: Jitter | None = None) -> None:
        self.page_size, self.num_slots = pools.page_size, config.host_num_slots
        self._jitter = jitter if jitter is not None else Jitter(None)
        self.num_pages = self.num_slots // self.page_size
        pinned = device.type == "cuda"
        backed = [(GroupKind.FULL, pools.full)] + ([(GroupKind.DRAFT, pools.draft)] if pools.draft is not None else [])

        def host(layers: list[torch.Tensor]) -> list[torch.Tensor]:
            return [torch.zeros((self.num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pinned) for t in layers]

        self.pools = [HostPool(kind, host(pool.k_layers), host(pool.v_layers), self.num_slots) for kind, pool in backed]
        self._kinds = [kind for kind, _ in backed]
        self._device = [pool.k_layers + pool.v_layers for _, pool in backed]
        self.free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self._held = torch.zeros(self.num_pages, dtype=torch.bool)  # pages handed out
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._event: torch.cuda.Event | None = None  # the last copy launched
        # load-backs to acknowledge: the copy's event, what to run, acknowledgements it still waits (jitter)
        self._pending: list[tuple[torch.cuda.Event | None, Callable[[], None], int]] = []
        self._listeners: list[HostTierListener] = []
        self.num_written_back = self.num_loaded_back = 0
        self._state_device = [] if states is None else states.buffers
        n = 0 if states is None else config.num_state_slots
        if states is not None:
            host_states = [torch.zeros((n, *t.shape[1:]), dtype=t.dtype, pin_memory=pinned) for t in states.buffers]
            self.pools.append(HostPool(GroupKind.STATE, host_states, [], n))
        self.num_state_slots = n
        self.free_state_slots = list(range(n))
        self._state_held = [False] * n
        self.num_states_written_back = self.num_states_loaded_back = 0

    @property
    def num_free(self) -> int:
        """Free host slots (of free pages)."""
        return self.free_pages.numel() * self.page_size

    def add_listener(self, listener: HostTierListener) -> None:
        self._listeners.append(listener)

    @property
    def kv_pools(self) -> list[HostPool]:
        """The pools holding KV pages (FULL, DRAFT), without a hybrid model's STATE pool."""
        return self.pools[:len(self._kinds)]

    def records_of(self, host_slots: torch.Tensor) -> list[dict[tuple[GroupKind, Half], torch.Tensor]]:
        """What each listener keeping records beside the host pages (one offering `records_of`:
        the canary's HostRecords) holds for these host slots, per backed pool and half, on the CPU:
        for a copy of the pages that leaves host memory (the disk tier) to take along."""
        self.synchronize()
        return [{(kind, half): rows.cpu() for kind in self._kinds
                 for half, rows in listener.records_of(kind, host_slots).items()}
                for listener in self._listeners if hasattr(listener, "records_of")]

    def restore_records(self, host_slots: torch.Tensor,
                        records: dict[tuple[int, GroupKind, Half], torch.Tensor]) -> None:
        """Give the listeners keeping records (in `records_of`'s order: j, the listener's index
        there) the records of pages that came back into these host slots from such a copy; the
        next load-back takes them to the device with the bytes."""
        keepers = [listener for listener in self._listeners if hasattr(listener, "restore_records")]
        for j, listener in enumerate(keepers):
            for kind in self._kinds:
                listener.restore_records(kind, host_slots, {half: rows.to(torch.int64) for (i, k, half), rows
                                                            in records.items() if i == j and k is kind})

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free host pages, or None (nothing allocated) when fewer are free."""
        if n > self.free_pages.numel():
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self._held[pages] = True
        return pages

    def free(self, pages: torch.Tensor, cause: str) -> None:
        """Return host pages; listeners hear their slots first. Freeing a page twice, or one never
        handed out, is a bug."""
        assert pages.unique().numel() == pages.numel() and bool(self._held[pages].all()), "bad host free"
        self._held[pages] = False
        slots = page_slots(pages, self.page_size)
        for listener in self._listeners:
            for kind in self._kinds:
                listener.host_freed(kind, slots, cause)
        self.free_pages = torch.cat([self.free_pages, pages])

    def restart(self) -> None:
        """With every page free, hand them out from page 0 up again, as a new tier does."""
        assert self.free_pages.numel() == self.num_pages, "restart while host pages are held"
        assert len(self.free_state_slots) == self.num_state_slots, "restart while host state slots are held"
        self.free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self.free_state_slots.sort()

    def alloc_state(self) -> int | None:
        """A free host state slot, or None."""
        if not self.free_state_slots:
            return None
        host_slot = self.free_state_slots.pop(0)
        self._state_held[host_slot] = True
        return host_slot

    def free_state(self, host_slot: int, cause: str) -> None:
        """Return a host state slot; listeners hear it first. Freeing one twice, or one never handed
        out, is a bug."""
        assert self._state_held[host_slot], "bad host state free"
        self._state_held[host_slot] = False
        for listener in self._listeners:
            listener.host_freed(GroupKind.STATE, torch.tensor([host_slot]), cause)
        self.free_state_slots.append(host_slot)

    def write_back_state(self, slot: int, host_slot: int) -> None:
        """Copy the state of device state slot `slot` to `host_slot` (launched; the device slot may
        be freed now)."""
        self._copy_state(self._state_device, self.pools[-1].k_layers, slot, host_slot, into_host=True)
        self.num_states_written_back += 1

    def load_back_state(self, host_slot: int, slot: int) -> None:
        """Copy the state in `host_slot` to device state slot `slot` (launched; work on the
        engine's stream waits for it, `wait`)."""
        self._copy_state(self.pools[-1].k_layers, self._state_device, host_slot, slot, into_host=False)
        self.num_states_loaded_back += 1

    def _copy_state(self, src_buffers: list[torch.Tensor], dst_buffers: list[torch.Tensor], src: int, dst: int,
                    *, into_host: bool) -> None:
        device_slot, host_slot = (torch.tensor([s]) for s in ((src, dst) if into_host else (dst, src)))
        with self._copying():
            for s, d in zip(src_buffers, dst_buffers, strict=True):
                d[dst].copy_(s[src], non_blocking=True)
            for listener in self._listeners:
                if into_host:
                    listener.written_back(GroupKind.STATE, device_slot, host_slot)
                else:
                    listener.loaded_back(GroupKind.STATE, host_slot, device_slot)

    def write_back(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy every backed pool's KV of these device slots to these host slots (launched; the
        device slots may be freed now)."""
        with self._copying():
            for pool, device in zip(self.pools, self._device):
                for dst, src in zip(pool.k_layers + pool.v_layers, device):
                    copy_runs(dst, host_slots, src, device_slots)
            for listener in self._listeners:
                for kind in self._kinds:  # every backed pool is indexed by FULL slots
                    listener.written_back(kind, device_slots, host_slots)
        self.num_written_back += host_slots.numel() // self.page_size

    def load_back(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
                  on_done: Callable[[], None] | None = None) -> None:
        """Copy these host slots' KV to these (newly allocated) device slots (launched; the next
        forward waits for it). on_done runs once the copy is known to be over (`acknowledge`)."""
        with self._copying():
            for pool, device in zip(self.pools, self._device):
                for dst, src in zip(device, pool.k_layers + pool.v_layers):
                    copy_runs(dst, device_slots, src, host_slots)
            for listener in self._listeners:
                for kind in self._kinds:
                    listener.loaded_back(kind, host_slots, device_slots)
        self.num_loaded_back += host_slots.numel() // self.page_size
        if on_done is not None:
            self._pending.append((self._event, on_done, self._jitter.delay()))

    def acknowledge(self, *, late: bool = True) -> None:
        """Run the on_done of every load-back whose copy is over (on a CPU: all of them), in order;
        with jitter, one whose drawn delay has not run out waits for a later acknowledgement (and
        counts it down), and the ones after it may go first. late=False: none waits."""
        waiting = []
        for event, on_done, delay in self._pending:
            if event is not None and not event.query():
                waiting.append((event, on_done, delay))
            elif delay and late:
                waiting.append((event, on_done, delay - 1))
            else:
                on_done()
        self._pending = waiting

    def wait(self) -> None:
        """The current stream waits for every copy launched so far (CUDA; nothing on a CPU)."""
        if self._event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._event)

    def synchronize(self) -> None:
        """The host waits for every copy launched so far: host memory may then be read or written
        from the CPU."""
        if self._event is not None:
            self._event.synchronize()
        self.acknowledge(late=False)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Copies (and listeners' work) on the copy stream, after what the device's stream has
        launched (the forwards that wrote or read these device slots) and a jitter's spin; a
        completion event after."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self._jitter.spin()
            yield
        self._event = torch.cuda.Event()
        self._event.record(self._stream)
