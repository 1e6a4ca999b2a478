"""Moving one request's KV between a prefill process and a decode process over torch.distributed
point-to-point (gloo on a CPU, NCCL on GPUs), and the faults a transfer engine can have.

A transfer is two messages on the data group, tagged with its number: the KV of every
pool the request holds (FULL, a draft pool, the SWA slots still resident on the prefill side), as
one byte buffer, then a sidecar with the canary's records of the same slots (none where the sides'
canaries are detached: NoRecords). The sender posts both
with `isend`; the receiver posts `irecv`s into staging buffers and polls their completion (NCCL:
`is_completed`; gloo, whose receives complete only in `wait`: a thread per receive waits, as a
transfer engine's progress thread does), then writes the staging buffers into the slots it
allocated ("lands" the transfer) before the request's first decode forward.

Faults (`TransportFault`): three engine defects the canary must catch, and two failures of the
link or the process a correct engine must survive by aborting the request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from .kv_pool import KVPools, page_slots

# Engine defects: the decode side lands a transfer's records over the bytes the slots held before
# (the transport reported success, the bytes never arrived); the decode side gives up on a late
# transfer and hands its slots to the next one while the late bytes still land there; the prefill
# side sends the blocks at the request's logical block ids (0, 1, ...) instead of its physical ones.
DEFECTS = ("stale_bytes", "freed_slots", "logical_ids")
# Failures a correct engine survives: the link delivers a transfer only after its receiver gave up
# on it; the prefill process dies between a transfer's KV message and its sidecar.
FAILURES = ("late_transfer", "prefill_killed")
TRANSPORT_FAULTS = DEFECTS + FAILURES


@dataclass(frozen=True)
class TransportFault:
    """Fault `name` (one of TRANSPORT_FAULTS) on transfer number `transfer` (0: the first one the
    decode side admits after the reset; "freed_slots" acts on the transfer it gives up on)."""

    name: str
    transfer: int = 0

    def __post_init__(self) -> None:
        if self.name not in TRANSPORT_FAULTS:
            raise ValueError(f"transport fault must be one of {', '.join(TRANSPORT_FAULTS)}; got {self.name!r}")
        if isinstance(self.transfer, bool) or not isinstance(self.transfer, int) or self.transfer < 0:
            raise ValueError(f"transfer must be an integer >= 0 (the transfer's number since the reset); "
                             f"got {self.transfer!r}")


def armed(faults: Sequence[TransportFault], name: str, seq: int) -> bool:
    """Whether fault `name` is on transfer number seq."""
    return any(f.name == name and f.transfer == seq for f in faults)


class Sidecar(Protocol):
    """What travels with the KV: the canary's records of the transferred slots. The handle's side
    implements it over its canary runtime (handles/pd_side.py)."""

    def width(self) -> int:
        """int64 words per transferred FULL slot (0: nothing travels)."""

    def export(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Prefill side: ``[n, width]`` int64 on the data device, for these FULL slots."""

    def install(self, full_slots: torch.Tensor, sidecar: torch.Tensor) -> None:
        """Decode side: write a received sidecar to these FULL slots, before any forward reads them."""

    def receipt(self, full_slots: torch.Tensor) -> Any:
        """Decode side, once landed: where the slots are in each pool group (picklable), for `delivered`."""

    def delivered(self, src_full_slots: list[int], dst_full_slots: list[int], receipt: Any) -> None:
        """Prefill side: the transfer of src landed at dst (the fault ledger follows damage there)."""

    def take_frees(self) -> Any:
        """Decode side: the frees of its slots since the last call (picklable), for `note_frees`."""

    def note_frees(self, frees: Any) -> None:
        """Prefill side: the decode side freed these slots (damage moved there is gone with them)."""


class NoRecords:
    """The Sidecar of a side whose canary is detached: no records travel (width 0), so a transfer
    is its KV message alone, and nothing is installed, followed or noted."""

    def width(self) -> int:
        return 0

    def export(self, full_slots: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a transfer without records has no sidecar to export")

    def install(self, full_slots: torch.Tensor, sidecar: torch.Tensor) -> None:
        raise RuntimeError("a transfer without records has no sidecar to install")

    def receipt(self, full_slots: torch.Tensor) -> Any:
        return None

    def delivered(self, src_full_slots: list[int], dst_full_slots: list[int], receipt: Any) -> None:
        pass

    def take_frees(self) -> Any:
        return []

    def note_frees(self, frees: Any) -> None:
        pass


@dataclass(frozen=True)
class Offer:
    """A prefilled request the prefill side offers (index: its prompt's in the generate call; rid:
    its id there);
    swa_resident: which of its positions still have an SWA slot there (None without an SWA pool)."""

    index: int
    rid: int
    prompt_ids: list[int]
    output_ids: list[int]
    max_new_tokens: int
    context_key: int
    kv_len: int
    swa_resident: list[bool] | None


def _kv_tensors(pools: KVPools) -> list[tuple[torch.Tensor, bool]]:
    """Every per-layer buffer a transfer moves, with whether it is indexed by SWA slots."""
    out = [(t, False) for pool in (pools.full, pools.draft) if pool is not None for t in pool.k_layers + pool.v_layers]
    if pools.swa is not None:
        out += [(t, True) for t in pools.swa.k_layers + pools.swa.v_layers]
    return out


def _indices(pools: KVPools, full_slots: torch.Tensor,
             resident: list[bool] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FULL slots, SWA slots of the resident positions) on the pools' device."""
    device = pools.full.k_layers[0].device
    full = full_slots.to(device)
    if pools.swa is None or resident is None:
        return full, full[:0]
    keep = torch.tensor(resident, dtype=torch.bool, device=device)
    return full, pools.swa.full_to_swa[full][keep]


def gather_kv(pools: KVPools, full_slots: torch.Tensor, resident: list[bool] | None) -> torch.Tensor:
    """The transfer's KV message: every buffer's rows at these slots, as one uint8 buffer."""
    full, swa = _indices(pools, full_slots, resident)
    parts = [t[swa if is_swa else full].contiguous().view(torch.uint8).reshape(-1) for t, is_swa in _kv_tensors(pools)]
    return torch.cat(parts)


def kv_bytes(pools: KVPools, n: int, resident: list[bool] | None) -> int:
    """The KV message's size for n FULL slots, `resident` of them with SWA slots."""
    swa = 0 if resident is None else sum(resident)
    return sum((swa if is_swa else n) * t[0].numel() * t.element_size() for t, is_swa in _kv_tensors(pools))


def scatter_kv(pools: KVPools, full_slots: torch.Tensor, resident: list[bool] | None, message: torch.Tensor) -> None:
    """Write a KV message (gather_kv's layout) into these slots: the landing of a transfer."""
    full, swa = _indices(pools, full_slots, resident)
    offset = 0
    for t, is_swa in _kv_tensors(pools):
        slots = swa if is_swa else full
        size = slots.numel() * t[0].numel() * t.element_size()
        t[slots] = message[offset:offset + size].view(t.dtype).reshape(slots.numel(), *t.shape[1:])
        offset += size


def source_slots(slots: torch.Tensor, page_size: int, logical: bool) -> torch.Tensor:
    """The slots a sender reads: the request's own; with the logical_ids defect, its logical block
    ids taken for physical ones (block i's slots are pages i's)."""
    if not logical:
        return slots
    pages = -(-slots.numel() // page_size)
    return page_slots(torch.arange(pages, dtype=torch.int64), page_size)[:slots.numel()]


class Completion:
    """The completion of posted point-to-point works, polled without blocking: `done()` is True
    once every work completed, and raises what a failed one raised (a closed connection, say)."""

    def __init__(self, works: list[Any], backend: str) -> None:
        self._works = works
        self._error: BaseException | None = None
        self._finished = None if backend == "nccl" else threading.Event()
        if self._finished is not None:  # gloo works complete only inside wait(): a thread waits for them
            threading.Thread(target=self._wait, daemon=True, name="kv-canary transfer").start()

    def _wait(self) -> None:
        try:
            for work in self._works:
                work.wait()
        except BaseException as e:  # surfaced by done() in the polling thread
            self._error = e
        self._finished.set()

    def done(self) -> bool:
        finished = self._finished.is_set() if self._finished is not None else all(w.is_completed() for w in self._works)
        if finished and self._error is not None:
            raise self._error
        return finished


@dataclass
class Incoming:
    """A transfer the decode side is receiving: its number since the reset (seq) and its messages'
    tag, the request it admitted (held out of its scheduler until landed), its slots, the staging
    buffers (sidecar None: no records travel), the completion, its deadline and when its receives
    were posted (time.monotonic())."""

    seq: int
    tag: int
    offer: Offer
    request: Any
    slots: torch.Tensor
    kv: torch.Tensor
    sidecar: torch.Tensor | None
    completion: Completion
    deadline: float
    posted: float


def post_receive(group: Any, backend: str, src: int, seq: int, kv: torch.Tensor,
                 sidecar: torch.Tensor | None) -> Completion:
    """irecv both messages of transfer `seq` from rank src into the staging buffers (sidecar None:
    the KV message alone, no records travel)."""
    works = [dist.irecv(kv, src, group=group, tag=2 * seq)]
    if sidecar is not None:
        works.append(dist.irecv(sidecar, src, group=group, tag=2 * seq + 1))
    return Completion(works, backend)


def post_send(group: Any, dst: int, seq: int, kv: torch.Tensor, sidecar: torch.Tensor | None) -> list[Any]:
    """isend transfer `seq`'s KV message and its sidecar (None: none goes, as when no records travel
    or the process dies before it)."""
    works = [dist.isend(kv, dst, group=group, tag=2 * seq)]
    if sidecar is not None:
        works.append(dist.isend(sidecar, dst, group=group, tag=2 * seq + 1))
    return works
