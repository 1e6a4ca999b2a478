"""The two halves of a prefill/decode pair whose engines run in processes of their own.

Both halves run one generate call in ticks. Each tick a side does its own work (the prefill side:
a prefill when it holds nothing; the decode side: poll its receives, land the completed ones, run
one decode step), then the two exchange one control message over a gloo group (`Link.exchange`):

    prefill -> decode   offers (prefilled requests, each with its KV length), requests finished
                        on the prefill side (max_new_tokens 1)
    decode -> prefill   accepts (the transfer's number and the slots it allocated), transfers
                        landed, transfers given up (timed out or failed: the request is aborted),
                        the slots it freed (for the fault ledger), whether every request is resolved

The prefill side posts a transfer's sends once it hears the accept, and keeps the request (its KV
in the prefill radix cache) until it hears that the transfer landed or was given up. The decode
side holds an admitted request out of its scheduler until the transfer landed: it never decodes
against what the slots held before. A transfer given up keeps its slots until its receive drained
(completed or failed); only then are they freed, so late bytes land nowhere that is read.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .engine import Engine
from .kv_pool import slot_pages
from .pd_transport import (Incoming, Offer, Sidecar, TransportFault, armed, gather_kv, kv_bytes,
                           post_receive, post_send, scatter_kv, source_slots)
from .request import Request

DECODE_RANK, PREFILL_RANK = 0, 1  # rank 0 decodes: it outlives a prefill process that dies


@dataclass(frozen=True)
class Link:
    """How one side reaches the other: its own rank, the data group's backend ("gloo" or "nccl";
    the data group is the default one) and the control group (gloo), whose timeout bounds every
    exchange."""

    rank: int
    backend: str
    control: Any

    @property
    def peer(self) -> int:
        return PREFILL_RANK if self.rank == DECODE_RANK else DECODE_RANK

    def exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send this tick's message, return the peer's (raises when the peer is gone)."""
        out: list[Any] = [None, None]
        dist.all_gather_object(out, message, group=self.control)
        return out[self.peer]


class TransferTimes(NamedTuple):
    """A transfer the decode side landed: its number since the reset (seq), its prompt's index, the
    bytes of its KV message and of its sidecar (0: no records travelled), and time.monotonic()
    readings (the processes of one host share that clock): its receives posted (at admission), both
    messages found in (polled), and landed (bytes and records written into its slots, the engine's
    stream synchronized: the copies done)."""

    seq: int
    index: int
    kv_bytes: int
    sidecar_bytes: int
    posted: float
    received: float
    landed: float


class DecodeResult(NamedTuple):
    """outputs: per prompt, its output ids (an aborted request's: those it had when its transfer
    was given up); aborted: prompt index -> why its transfer was given up; failure: why the pair
    broke (the prefill process is gone), else None; dangling: receives that never drained;
    transfers: the transfers landed, in landing order."""

    outputs: list[list[int]]
    aborted: dict[int, str]
    failure: str | None
    dangling: int
    transfers: tuple[TransferTimes, ...] = ()


class PrefillProcess:
    """The prefill half: prefills, offers, sends what the decode side accepted."""

    def __init__(self, engine: Engine, link: Link, sidecar: Sidecar) -> None:
        self.engine, self.link, self.sidecar = engine, link, sidecar

    def generate(self, prompts: Sequence[Any], max_new_tokens: int, context_keys: Sequence[int],
                 faults: Sequence[TransportFault]) -> dict[int, float]:
        """Run the prefill side of one generate call until the decode side says it is done. Returns
        when it began sending each transfer (by number: time.monotonic() before it gathered the KV
        and records and posted the sends)."""
        engine = self.engine
        reqs = [engine.submit(p, max_new_tokens, k) for p, k in zip(prompts, context_keys)]
        index = {r.rid: i for i, r in enumerate(reqs)}
        held: dict[int, Request] = {}  # by prompt index: prefilled here, transfer not resolved
        offers: dict[int, Offer] = {}
        sending: dict[int, tuple[list[int], list[Any]]] = {}  # seq -> (src, its works and buffers), kept to the end
        late: dict[int, list[Any]] = {}  # seq -> [tag, kv, sidecar, the decode side's seq when it gave up, or None]
        reported: set[int] = set()
        began: dict[int, float] = {}  # seq -> when its sending began
        while True:
            new = []
            if not held and engine.scheduler.waiting:
                for r in engine.prefill_for_transfer():
                    i = index[r.rid]
                    held[i], offers[i] = r, self._offer(i, r)
                    new.append(offers[i])
            finished = {i: r.output_ids for i, r in enumerate(reqs) if r.finished and i not in reported | held.keys()}
            reported |= finished.keys()
            reply = self.link.exchange({"offers": new, "finished": finished})
            for seq, tag, i, dst in reply["accepts"]:
                began[seq] = time.monotonic()
                src = engine.req_to_token_pool.read(held[i].row, 0, held[i].kv_len)
                read = source_slots(src, engine.config.page_size, armed(faults, "logical_ids", seq))
                kv = gather_kv(engine.pools, read, offers[i].swa_resident)
                car = self.sidecar.export(read) if self.sidecar.width() else None
                if armed(faults, "late_transfer", seq):
                    late[seq] = [tag, kv, car, None]
                elif armed(faults, "prefill_killed", seq):
                    self._die_mid_transfer(tag, kv)
                else:
                    sending[seq] = (src.tolist(), [*post_send(None, self.link.peer, tag, kv, car), kv, car])
            for seq, i, dst, receipt in reply["landed"]:
                self.sidecar.delivered(sending[seq][0], dst, receipt)
                engine.scheduler.finish(held.pop(i))
            self.sidecar.note_frees(reply["freed"])  # after the landings: a slot freed now held what landed
            for seq, i, after in reply["gave_up"]:
                if seq in late:
                    late[seq][3] = after
                engine.scheduler.finish(held.pop(i))
            landed = max((seq for seq, *_ in reply["landed"]), default=-1)
            last = not held and not engine.scheduler.waiting  # no later transfer will come
            for seq, (tag, kv, car, after) in list(late.items()):  # delivered once a later transfer landed
                if after is not None and (landed >= after or last):
                    sending[seq] = ([], [*post_send(None, self.link.peer, tag, kv, car), kv, car])
                    del late[seq]
            if reply["done"]:
                return began

    def _die_mid_transfer(self, tag: int, kv: torch.Tensor) -> None:
        """The prefill_killed failure: the transfer's KV message goes out, its sidecar never does."""
        for work in post_send(None, self.link.peer, tag, kv, None):
            work.wait()
        os.kill(os.getpid(), signal.SIGKILL)

    def _offer(self, i: int, req: Request) -> Offer:
        """What the decode side is told of prefilled request `req` (prompt index i)."""
        resident = None
        swa = self.engine.pools.swa
        if swa is not None:
            src = self.engine.req_to_token_pool.read(req.row, 0, req.kv_len)
            resident = (swa.full_to_swa[src.to(swa.full_to_swa.device)] != 0).tolist()
        return Offer(i, req.rid, list(req.prompt_ids), list(req.output_ids), req.max_new_tokens, req.context_key,
                     req.kv_len, resident)


@dataclass
class _Call:
    """One generate call on the decode side: what it resolved, what is in flight, and what it
    reports at the next exchange (accepts, landed, gave_up)."""

    outputs: dict[int, list[int]] = field(default_factory=dict)  # by prompt index: finished or aborted
    aborted: dict[int, str] = field(default_factory=dict)
    offers: deque[Offer] = field(default_factory=deque)  # not admitted yet
    live: list[Incoming] = field(default_factory=list)  # receiving
    cancelled: list[Incoming] = field(default_factory=list)  # given up, receive not drained: slots held
    recycled: list[Incoming] = field(default_factory=list)  # the freed_slots defect: slots for the next admission
    decoding: dict[int, Request] = field(default_factory=dict)
    dangling: int = 0
    accepts: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    landed: list[tuple[int, int, list[int], Any]] = field(default_factory=list)
    gave_up: list[tuple[int, int, int]] = field(default_factory=list)
    times: list[TransferTimes] = field(default_factory=list)  # the transfers landed, in order

    def report(self, done: bool, freed: Any) -> dict[str, Any]:
        """This tick's message (freed: the sidecar's frees since the last one), and a fresh start
        for the next one's."""
        message = {"accepts": self.accepts, "landed": self.landed, "gave_up": self.gave_up, "freed": freed,
                   "done": done}
        self.accepts, self.landed, self.gave_up = [], [], []
        return message


class DecodeProcess:
    """The decode half: admits offers, receives their KV, lands it, decodes. drain_timeout_s: how
    long the slots of a transfer given up on stay held for its receive to drain; past it they stay
    held for good (a "dangling" receive: the pair should be replaced)."""

    def __init__(self, engine: Engine, link: Link, sidecar: Sidecar, drain_timeout_s: float) -> None:
        self.engine, self.link, self.sidecar = engine, link, sidecar
        self.drain_timeout_s = drain_timeout_s
        self.seq = 0  # transfers admitted since the reset (a fault's `transfer` counts them)
        self.tag = 0  # transfers posted since the process started (the messages' tags: never reused)
        self.num_landed = 0  # transfers landed since the process started (a soak's liveness)
        self.held: list[Request] = []  # admitted, held out of the scheduler: receiving, or given up and draining

    def reset(self) -> None:
        """Before the engine's reset: free what requests held out of the scheduler hold."""
        for req in list(self.held):
            self._release(req)
        self.seq = 0

    def generate(self, n: int, timeout_s: float, faults: Sequence[TransportFault]) -> DecodeResult:
        """Run the decode side of one generate call of n prompts; transfers not landed within
        timeout_s of their admission are given up (their requests aborted)."""
        scheduler, call = self.engine.scheduler, _Call()
        while True:
            self._poll(call, timeout_s, faults)
            self._drain(call, faults)
            if scheduler.has_work:
                self.engine.step()
            call.outputs |= {i: r.output_ids for i, r in call.decoding.items() if r.finished}
            done = len(call.outputs) == n and not call.cancelled
            try:
                reply = self.link.exchange(call.report(done, self.sidecar.take_frees()))
            except RuntimeError as e:
                return self._lost(n, call, f"the prefill process is gone ({e})")
            if done:
                return DecodeResult([call.outputs[i] for i in range(n)], call.aborted, None, call.dangling,
                                    tuple(call.times))
            call.outputs |= reply["finished"]
            call.offers.extend(reply["offers"])
            while call.offers and (inc := self._admit(call.offers[0], timeout_s, call.recycled)) is not None:
                call.offers.popleft()
                call.live.append(inc)
                call.accepts.append((inc.seq, inc.tag, inc.offer.index, inc.slots.tolist()))
            if call.offers and not self.held and not scheduler.has_work:
                raise RuntimeError("the decode engine cannot hold a transferred request even when idle")

    def _poll(self, call: _Call, timeout_s: float, faults: Sequence[TransportFault]) -> None:
        """Land the transfers whose receives completed; give up on the failed and the late ones."""
        now = time.monotonic()
        for inc in list(call.live):
            try:
                complete, why = inc.completion.done(), ""
            except Exception as e:  # the transfer failed: nothing more will land
                complete, why = False, f"failed: {e}"
            if complete:
                call.live.remove(inc)
                received = time.monotonic()
                self._land(inc, faults)
                call.times.append(TransferTimes(inc.seq, inc.offer.index, inc.kv.numel(),
                                                0 if inc.sidecar is None else inc.sidecar.numel() * 8, inc.posted,
                                                received, self._clock()))
                self.num_landed += 1
                call.decoding[inc.offer.index] = inc.request
                call.landed.append((inc.seq, inc.offer.index, inc.slots.tolist(), self.sidecar.receipt(inc.slots)))
            elif why or now > inc.deadline:
                call.live.remove(inc)
                call.aborted[inc.offer.index] = f"transfer {inc.seq} {why or f'timed out after {timeout_s:g} s'}"
                call.outputs[inc.offer.index] = inc.offer.output_ids
                call.gave_up.append((inc.seq, inc.offer.index, self.seq))
                inc.deadline = now + self.drain_timeout_s  # for its receive to drain
                call.cancelled.append(inc)
                if armed(faults, "freed_slots", inc.seq):
                    call.recycled.append(inc)

    def _drain(self, call: _Call, faults: Sequence[TransportFault]) -> None:
        """Free the slots of given-up transfers whose receives drained (completed or failed): the
        late bytes are dropped. A receive past the drain timeout keeps its slots held for good."""
        now = time.monotonic()
        for inc in list(call.cancelled):
            try:
                drained, failed = inc.completion.done(), False
            except Exception:
                drained, failed = True, True
            defect = armed(faults, "freed_slots", inc.seq)
            if drained and not failed and defect:
                self._land(inc, faults, run=False)  # the defect: late bytes land in the slots it handed on
            if drained or now > inc.deadline:
                call.cancelled.remove(inc)
                if not drained:  # its slots may still be written: they stay held
                    call.dangling += 1
                elif inc in call.recycled or not defect:  # with the defect, a request whose slots went on is freed
                    if inc in call.recycled:
                        call.recycled.remove(inc)
                    self._release(inc.request)

    def _admit(self, offer: Offer, timeout_s: float, recycled: list[Incoming]) -> Incoming | None:
        """Admit an offered request (held out of the scheduler) and post its receives; None when
        there is no room: the requests held out count against max_running, and the pools keep
        room for every admitted request's remaining tokens (as SGLang's decode side reserves
        decode tokens), since a request held out cannot be retracted to make room."""
        engine, ps = self.engine, self.engine.config.page_size
        admitted = engine.scheduler.running + self.held
        if len(admitted) >= engine.config.max_running:
            return None
        need = sum(r.max_new_tokens - len(r.output_ids) + ps for r in admitted)  # their remaining tokens
        need += offer.kv_len + offer.max_new_tokens + ps
        cache = engine.radix_cache
        for pool, evict in ((engine.pools.full, cache.evict), (engine.pools.swa, cache.evict_swa)):
            if pool is not None and (short := need - pool.num_free) > 0 and evict(short) < short:
                return None
        req = Request(offer.rid, offer.prompt_ids, offer.max_new_tokens, context_key=offer.context_key,
                      output_ids=list(offer.output_ids), kv_len=offer.kv_len)
        slots = engine.scheduler.admit_transferred(req)
        if slots is None:
            return None
        engine.scheduler.running.remove(req)  # not decoded before its transfer landed
        self.held.append(req)
        if offer.swa_resident is not None:
            resident = torch.tensor(offer.swa_resident)
            engine.pools.swa.unmap(slot_pages(slots[~resident], engine.config.page_size),
                                   "not SWA-resident on the prefill side, so not transferred")
        if recycled and recycled[0].slots.numel() >= slots.numel():  # the freed_slots defect
            victim = recycled.pop(0)
            mine, rest = victim.slots[:slots.numel()], victim.slots[slots.numel():]
            engine.req_to_token_pool.write(req.row, 0, mine)
            engine.req_to_token_pool.write(victim.request.row, 0, torch.cat([slots, rest]))
            self._release(victim.request)
            slots = mine
        device = engine.pools.full.k_layers[0].device
        kv = torch.empty(kv_bytes(engine.pools, slots.numel(), offer.swa_resident), dtype=torch.uint8, device=device)
        width = self.sidecar.width()
        car = torch.empty((slots.numel(), width), dtype=torch.int64, device=device) if width else None
        completion = post_receive(None, self.link.backend, self.link.peer, self.tag, kv, car)
        posted = time.monotonic()
        inc = Incoming(self.seq, self.tag, offer, req, slots, kv, car, completion, posted + timeout_s, posted)
        self.seq, self.tag = self.seq + 1, self.tag + 1
        return inc

    def _land(self, inc: Incoming, faults: Sequence[TransportFault], run: bool = True) -> None:
        """Write a received transfer into its slots (the records with the bytes) and, unless run
        is False, let its request decode."""
        if not armed(faults, "stale_bytes", inc.seq):
            scatter_kv(self.engine.pools, inc.slots, inc.offer.swa_resident, inc.kv)
        if inc.sidecar is not None:
            self.sidecar.install(inc.slots, inc.sidecar)
        if run:
            self.held.remove(inc.request)
            self.engine.scheduler.running.append(inc.request)

    def _clock(self) -> float:
        """time.monotonic() once the engine's stream finished what was queued on it (a landing's
        copies). The stream alone: a device-wide synchronize would also wait for receives posted
        since, whose sends the prefill side posts only after the next exchange."""
        if self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()
        return time.monotonic()

    def _release(self, req: Request) -> None:
        """Free a request held out of the scheduler (its row and slots)."""
        self.held.remove(req)
        self.engine.scheduler.running.append(req)
        self.engine.scheduler.abort_request(req)

    def _lost(self, n: int, call: _Call, failure: str) -> DecodeResult:
        """The prefill process is gone: every transfer not landed is given up."""
        for inc in call.live + call.cancelled:
            call.aborted.setdefault(inc.offer.index, f"transfer {inc.seq} never completed")
            call.outputs.setdefault(inc.offer.index, inc.offer.output_ids)
        return DecodeResult([call.outputs.get(i, []) for i in range(n)], call.aborted, failure, 0, tuple(call.times))
