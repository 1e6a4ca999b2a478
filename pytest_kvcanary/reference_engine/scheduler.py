"""Continuous batching: a waiting queue, the running requests, prefill and decode batches.

Each step is one batch: a prefill of waiting requests (extending their cached prefix) while rows,
the token budget and memory allow, else a decode of every running request (with speculative
decoding, up to k + 1 positions per request: the last token and k draft proposals). Memory comes
in whole pages, from the free lists, then from evicting the radix cache: a request's positions fill
its last page before a new one is taken. A prefill whose cached prefix runs on in the host tier gets
device pages for that part first and its KV loaded back into them. A prefill that still does not
fit waits, a decode that does not fit retracts the newest running request (frees what it owns,
draft KV included, and requeues it first: it is prefilled again, its cached prefix reused).
A paused request (`pause`) keeps its row, KV and locks and sits out the decodes until `resume`;
memory pressure retracts paused requests first.
In a prefill/decode pair the prefill side only runs schedule_prefill, and the decode side admits
requests with admit_transferred instead of prefilling them.

Positions are accounted when a batch is made: each request's `ahead` counts the positions launched
forwards write whose results are not processed yet, and the next batch starts past them
(`launched_len`). Synchronously a batch is processed before the next is made, so `ahead` is 0 between
steps. With async scheduling (async_steps.py) a decode is made while the previous one runs: each of
its requests is accounted as having produced one token, whose input id the host does not know yet
(UNKNOWN_TOKEN: the device fills it in); a speculative decode's requests are accounted as having
kept every position it writes (its slots past them allocated, the worst case), and the decode after
it is moved back on the device by the positions it rejects (async_steps.py), whose slots are freed
when it is processed but those the decode after it writes (`_roll_back`). A request found finished
(or aborted) while a later launched forward still writes its row retires: its output from that
forward is dropped, and it keeps its row, slots and locks until that forward is processed.

A hybrid model's request also takes a state slot when it is admitted: the state of its matched
prefix is copied there from the radix cache's checkpoint, or the slot is cleared. Its prefill
writes a checkpoint, the state after the last page boundary before its last token, into a slot of
its own, which the radix cache takes with the request's KV (a later request with the same prompt
matches up to there). With speculative decoding, each decode also takes a slot for the state
after each of its proposals but the last (in rollback_slots, with those of a decode in flight): the
forward writes them all, and `process` keeps the one of the accepted length as the request's state
(a slot swap, no copy; the decode launched after it started from that one) and frees the rest; a
decode that finds no slot for them runs without proposals.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from .config import EngineConfig
from .kv_pool import KVPools, ReqToTokenPool, page_slots, pages_needed
from .radix_cache import MatchResult, RadixCache
from .request import Request
from .state_pool import StatePool

UNKNOWN_TOKEN = -1  # an input id the host does not know: a draft's proposal, or an async step's sampled token


class Batch(NamedTuple):
    """One forward. Per request: prefix_lens (KV already in the cache, read by the forward) and
    extend_lens (tokens written). input_ids / positions / out_cache_loc (FULL slots written):
    CPU int64, row-major in request order; in a speculative decode the input ids after each
    request's first are UNKNOWN_TOKEN until the draft proposes them, and with async scheduling a
    decode's input ids the previous step samples are UNKNOWN_TOKEN until the device fills them in.
    rows: each request's mapping row when the batch was made (what its forward reads, even where
    the request leaves its row before a forward launched ahead runs). The slots are already in each
    request's row. A hybrid model's: state_slots (each request's running state), checkpoint_slots
    and checkpoint_lens (the states its forward writes besides the running one, and after how many
    tokens: a prefill's checkpoint, a speculative decode's rollback states), per request; else
    empty."""

    reqs: list[Request]
    is_prefill: bool
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    state_slots: list[int]
    checkpoint_slots: list[list[int]]
    checkpoint_lens: list[list[int]]
    rows: list[int]


class Scheduler:
    def __init__(self, config: EngineConfig, pools: KVPools, req_to_token: ReqToTokenPool,
                 radix_cache: RadixCache, states: StatePool | None = None) -> None:
        self.config, self.pools, self.req_to_token, self.radix_cache = config, pools, req_to_token, radix_cache
        self.states = states
        self.num_restored = 0  # requests admitted with their state copied from a checkpoint (hybrid)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # every request holding a row and still generating, in admission order
        self.retiring: list[Request] = []  # done while a launched forward still writes their rows (async scheduling)
        self.paused: list[Request] = []  # running requests left out of the decodes until resumed, oldest pause first
        self.num_paused = 0  # pauses since the scheduler started
        self.num_retracted = 0
        self.num_prefix_hits = 0  # requests admitted with a cached prefix (a retracted one's own included)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retiring)

    def schedule(self, retract: bool = True) -> Batch | None:
        """The next batch: a prefill of waiting requests, else a decode of every running one not
        paused. A decode that does not fit retracts paused requests (the latest paused first), then
        the newest running ones; so does a queue that only paused requests keep from moving.
        retract=False (a forward is in flight, whose requests' slots must stay theirs): None instead."""
        while ((batch := self.schedule_prefill() or self._schedule_decode(retract)) is None and retract
               and self.waiting and self.paused):
            self._retract(self.paused[-1], "paused request retracted for the queue")
        return batch

    def pause(self, req: Request) -> None:
        """Leave the running request out of the decodes until `resume`: it keeps its row, KV, state
        and radix locks, nothing it holds is freed or reused, and a launched forward that writes its
        row is processed as usual (its token kept). Memory pressure retracts paused requests before
        any other (one retracted waits again, no longer paused). ValueError unless it is running."""
        if req not in self.running:
            raise ValueError(f"only a running request can be paused; request {req.rid} is not running")
        if req not in self.paused:
            self.paused.append(req)
            self.num_paused += 1

    def resume(self, req: Request) -> None:
        """Schedule the paused request again from the next decode; nothing when it is not paused
        (never was, or since finished, aborted or retracted)."""
        if req in self.paused:
            self.paused.remove(req)

    def process(self, batch: Batch, new_tokens: list[list[int]]) -> list[Request]:
        """Account a finished forward and each request's new tokens (one, or in a speculative decode
        the accepted proposals and the target's next token); returns the requests that finished.
        A speculative decode keeps the KV of as many positions as it produced tokens and rolls the
        rest back. A request that finishes while a later launched forward writes its row retires
        until that one is processed; a retiring request's tokens are dropped (its KV is kept: the
        position it wrote holds its own last token), and it is finished or, aborted, released once
        no launched forward writes its row. Batches are processed in launch order; a prefill before
        any later batch is launched (its radix insertion may free duplicate slots the next would
        read)."""
        finished = []
        for i, (req, extend, tokens) in enumerate(zip(batch.reqs, batch.extend_lens, new_tokens)):
            kept = extend if batch.is_prefill else len(tokens)
            self._roll_back(req, kept, extend)
            if not batch.is_prefill and self.states is not None and (n := len(batch.checkpoint_slots[i])):
                self._roll_back_state(req, kept, n)
            req.kv_len += kept
            req.ahead -= extend
            if req in self.retiring:
                if not req.ahead:
                    self._retired(req)
                continue
            req.output_ids.extend(tokens)
            if req.finished:
                finished.append(req)
                if req.ahead:
                    self._retire(req)
                else:
                    self.finish(req)
                continue
            if batch.is_prefill:
                assert not req.ahead, "a prefill is processed before the next batch is launched"
                self.radix_cache.cache_unfinished_req(req)
            self._slide_window(req)
        return finished

    def finish(self, req: Request) -> None:
        """The request is done here: cache its KV (the slots stay in the radix cache), free its row
        and state slot."""
        self.radix_cache.cache_finished_req(req)
        self._leave(req)
        self.req_to_token.free(req.row)
        self._free_state(req, "a finished request's running state")
        req.row = -1

    def admit_transferred(self, req: Request) -> torch.Tensor | None:
        """Make running a request whose KV for token_ids[:kv_len] another engine computed: a row
        and kv_len own slots (evicting the cache for what the free lists lack), written to the row,
        none of it cached here, and a hybrid model's state slot (req.state_slot). Returns the slots,
        which the caller fills (and the state slot) before the next forward; None (nothing held)
        when no row or memory is free."""
        if self.rows_held >= self.config.max_running:
            return None
        states = self._alloc_states(1)
        pages = None if states is None else self._alloc(pages_needed(self.pools.page_size, 0, req.kv_len))
        if pages is None:
            if states:
                self.states.free(states, "transferred request could not be admitted")
            return None
        if states:
            req.state_slot = states[0]
        slots = page_slots(pages, self.pools.page_size)[:req.kv_len]
        req.row = self.req_to_token.alloc()
        assert req.row is not None
        req.prefix_len, req.swa_from, req.last_node = 0, 0, None
        self.req_to_token.write(req.row, 0, slots)
        self.running.append(req)
        return slots

    @property
    def rows_held(self) -> int:
        """Mapping rows in use: the running requests' and the retiring ones'."""
        return len(self.running) + len(self.retiring)

    def abort(self, *batches: Batch) -> None:
        """Undo batches whose forwards raised or will not be processed (every one launched and not
        processed): free what their requests hold, the slots the batches gave them included, and
        send the running ones back to the front of the queue (their outputs so far are kept); a
        retiring one is released."""
        for req in reversed(list(dict.fromkeys(r for b in batches for r in b.reqs))):
            if req in self.retiring:
                self._release(req, "batch aborted")
            else:
                self._retract(req, "batch aborted")

    def abort_request(self, req: Request) -> None:
        """Drop one request, waiting or running (what it holds is released, once no launched
        forward writes its row; its cached prefix stays cached); its output so far is kept."""
        if req in self.running and req.ahead:
            self._retire(req)
        elif req in self.running:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def reset(self) -> None:
        """Drop every request, releasing what the running and retiring ones hold (no forward may
        still be in flight)."""
        for req in self.running + self.retiring:
            self._release(req)
        self.waiting.clear()

    def schedule_prefill(self) -> Batch | None:
        """A prefill of the waiting requests that fit (None when none does); never a decode."""
        reqs, locs, budget = [], [], self.config.max_batch_tokens
        while self.waiting and self.rows_held < self.config.max_running:
            req = self.waiting[0]
            tokens = req.token_ids
            match = self.radix_cache.match_prefix(tokens[:-1], req.context_key)  # leave one token to compute
            if match.host_node is not None:
                match = self._load_back(match)
            if self.states is not None and match.slots.numel() and match.node.state is match.node.host_state is None:
                # the pages holding the match's checkpoint could not be loaded back: start from nothing
                match = MatchResult(match.slots[:0], self.radix_cache.root(req.context_key))
            extend = len(tokens) - match.slots.numel()
            if extend > budget:
                break
            self.radix_cache.lock(match.node)
            checkpoint_len = self._checkpoint_len(match.slots.numel(), len(tokens))
            load = self.states is not None and bool(match.slots.numel()) and match.node.state is None
            states = self._alloc_states(1 + bool(checkpoint_len) + load)
            pages = None if states is None else self._alloc(
                pages_needed(self.pools.page_size, match.slots.numel(), extend))
            if pages is None:
                if states:
                    self.states.free(states, "request could not be admitted")
                self.radix_cache.unlock(match.node)
                break
            self.waiting.popleft()
            if self.states is not None:
                self._start_state(req, match, states, checkpoint_len)
            req.row = self.req_to_token.alloc()
            assert req.row is not None
            req.prefix_len = req.kv_len = match.slots.numel()
            self.num_prefix_hits += bool(req.prefix_len)
            req.swa_from, req.last_node = 0, match.node
            self.req_to_token.write(req.row, 0, match.slots)
            self.running.append(req)
            reqs.append(req)
            locs.append(self._slots(req, extend, pages))
            budget -= extend
        return self._batch(reqs, locs, is_prefill=True) if reqs else None

    def _checkpoint_len(self, prefix: int, length: int) -> int:
        """Where a hybrid model's prefill of positions [prefix, length) writes a checkpoint: the
        last page boundary before its last token, if past its prefix (0: none, or not hybrid)."""
        at = (length - 1) // self.pools.page_size * self.pools.page_size
        return at if self.states is not None and at > prefix else 0

    def _alloc_states(self, n: int) -> list[int] | None:
        """n state slots, evicting the radix cache's checkpoints for what the free list lacks ([]
        without a state pool)."""
        if self.states is None:
            return []
        if (short := n - self.states.num_free) > 0:
            self.radix_cache.evict_states(short)
        return self.states.alloc(n)

    def _start_state(self, req: Request, match: MatchResult, slots: list[int], checkpoint_len: int) -> None:
        """Give an admitted request its running state slot, holding the state of its matched prefix
        (copied from the match's checkpoint, loaded back from the host tier first into the last of
        `slots` where only the host holds it, or cleared), and the slot its prefill's checkpoint
        goes to."""
        req.state_slot = slots[0]
        if match.slots.numel() and match.node.state is None:
            self.radix_cache.load_state(match.node, slots[-1])
        if match.slots.numel():
            self.states.copy([match.node.state], [req.state_slot])
            self.num_restored += 1
        else:
            self.states.clear([req.state_slot])
        req.checkpoint = (slots[1], checkpoint_len) if checkpoint_len else None

    def _free_state(self, req: Request, cause: str) -> None:
        """Free what state slots the request holds (a hybrid model's)."""
        held = [s for s in (req.state_slot, req.checkpoint and req.checkpoint[0], *req.rollback_slots) if s]
        if held:
            self.states.free(held, cause)
        req.state_slot, req.checkpoint, req.rollback_slots = 0, None, []

    def _load_back(self, match: MatchResult) -> MatchResult:
        """The match with the part only the host tier holds loaded back into device pages (the
        copies launched), or its device part alone when device memory is short. The loaded-back
        path stays locked until the host tier acknowledges the copy (no eviction frees the pages
        it writes)."""
        cache, node = self.radix_cache, match.host_node
        cache.lock(node)  # allocating may evict: not what is about to be loaded back
        pages = self._alloc(match.host_len // self.pools.page_size)
        if pages is None:
            cache.unlock(node)
            return MatchResult(match.slots, match.node)
        return cache.load_back(match, pages, on_done=lambda: cache.unlock(node))

    def _decoding(self) -> list[Request]:
        """The running requests a decode takes: those not paused."""
        return [r for r in self.running if r not in self.paused]

    def _schedule_decode(self, retract: bool) -> Batch | None:
        if not self._decoding():
            return None
        rollback = self._alloc_rollback_states()
        while (pages := self._alloc(sum(self._decode_pages(rollback)))) is None:
            if not retract:
                for req, slots in rollback.items():
                    self.states.free(slots, "decode could not be scheduled")
                    req.rollback_slots = req.rollback_slots[:-len(slots)]
                return None
            assert self.paused or len(self.running) > 1, "a lone request always fits (checked at submit)"
            self._retract((self.paused or self.running)[-1])
        reqs = self._decoding()
        lens, counts = self._decode_lens(rollback), self._decode_pages(rollback)
        locs = [self._slots(r, n, p) for r, n, p in zip(reqs, lens, pages.split(counts))]
        return self._batch(reqs, locs, is_prefill=False)

    def _decode_lens(self, rollback: dict[Request, list[int]]) -> list[int]:
        """Positions each decoding request's decode writes: 1, or with speculative decoding up to
        k + 1, never more than the tokens it still needs (so never past its submitted size) nor,
        in a hybrid model, than its rollback states (`rollback`) allow."""
        reqs = self._decoding()
        lens = [self._wanted_len(r) for r in reqs]
        if self.states is not None:
            return [min(n, 1 + len(rollback.get(r, []))) for r, n in zip(reqs, lens)]
        return lens

    def _wanted_len(self, req: Request) -> int:
        """Up to k + 1 positions, as many as the request still needs tokens once every forward
        launched for it accepted all it wrote (`ahead`, async scheduling: it may need fewer), and
        at least 1 (the request may finish in a launched forward: then it retires, and the one
        position written holds its own last token)."""
        return min(self.config.speculative_k + 1, max(1, req.max_new_tokens - len(req.output_ids) - req.ahead))

    def _alloc_rollback_states(self) -> dict[Request, list[int]]:
        """A hybrid model's speculative decode: each decoding request's rollback states for it, one
        per proposal but the last (none where the state pool cannot give them: it decodes one
        token), added to its rollback_slots (those of its launched decodes)."""
        rollback = {}
        if self.states is None or not self.config.speculative_k:
            return rollback
        for req in self._decoding():
            if slots := self._alloc_states(self._wanted_len(req) - 1):
                rollback[req] = slots
                req.rollback_slots = req.rollback_slots + slots
        return rollback

    def _roll_back_state(self, req: Request, kept: int, n: int) -> None:
        """After a hybrid model's speculative decode that kept `kept` of its positions (its n rollback
        states first in rollback_slots, a decode in flight's after them): the request's state becomes
        the one after them (its running slot when all were kept, else the rollback slot of that
        length, where a decode launched after it started from: AsyncSteps._follow); the decode's
        other slots are freed."""
        states = [req.state_slot, *req.rollback_slots[:n]]
        keep = states[kept % len(states)]
        self.states.free([s for s in states if s != keep], "speculative state rolled back")
        req.state_slot, req.rollback_slots = keep, req.rollback_slots[n:]

    def _decode_pages(self, rollback: dict[Request, list[int]]) -> list[int]:
        """New pages each decoding request's decode needs."""
        return [pages_needed(self.pools.page_size, r.launched_len, n)
                for r, n in zip(self._decoding(), self._decode_lens(rollback))]

    def _slots(self, req: Request, n: int, pages: torch.Tensor) -> torch.Tensor:
        """The slots of positions [launched_len, launched_len + n) of a running request: the rest of
        its last page, then the new pages'."""
        ps, start = self.pools.page_size, req.launched_len
        rest = min((-start) % ps, n)
        if not rest:
            return page_slots(pages, ps)[:n]
        return torch.cat([self.req_to_token.read(req.row, start, start + rest), page_slots(pages, ps)])[:n]

    def _roll_back(self, req: Request, kept: int, written: int) -> None:
        """Free the pages of the positions [kv_len + kept, kv_len + written) a speculative decode
        wrote and rejected, but the page the last kept one is in (their row entries lie past
        kv_len: stale, never read). A decode launched after it (async scheduling) was placed as if
        every position were kept and runs written - kept positions back (AsyncSteps._follow), over
        the rejected ones: the pages freed are then those of as many positions past its end,
        [launched_len - (written - kept), launched_len); what it writes is rolled back once it is
        processed."""
        if kept < written:
            ps, end = self.pools.page_size, req.launched_len - (written - kept)
            rejected = self.req_to_token.pages(req.row, -(-end // ps) * ps, req.launched_len)
            self.pools.free(rejected, "rejected draft position rolled back")

    def _batch(self, reqs: list[Request], locs: list[torch.Tensor], is_prefill: bool) -> Batch:
        """The batch writing positions [launched_len, launched_len + len(loc)) of each request
        (the slots locs, written to its row), which it counts as ahead from now on."""
        ids, positions, starts = [], [], [r.launched_len for r in reqs]
        self.req_to_token.write_rows([r.row for r in reqs], starts, locs)
        for req, loc, start in zip(reqs, locs, starts):
            known = req.token_ids[start:start + loc.numel()]
            ids.extend(known + [UNKNOWN_TOKEN] * (loc.numel() - len(known)))
            positions.append(torch.arange(start, start + loc.numel()))
        extras = ([r.extra_states(start, 0 if is_prefill else loc.numel() - 1)
                   for r, start, loc in zip(reqs, starts, locs)] if self.states is not None else [])
        for req, loc in zip(reqs, locs):
            req.ahead += loc.numel()
        return Batch(reqs, is_prefill, starts, [loc.numel() for loc in locs],
                     torch.tensor(ids, dtype=torch.int64), torch.cat(positions), torch.cat(locs),
                     [r.state_slot for r in reqs] if self.states is not None else [],
                     [e[0] for e in extras], [e[1] for e in extras], [r.row for r in reqs])

    def _alloc(self, n: int) -> torch.Tensor | None:
        """n FULL (+ SWA) pages, evicting the radix cache for what the free lists lack."""
        ps = self.pools.page_size
        if (short := n * ps - self.pools.full.num_free) > 0:
            self.radix_cache.evict(short)
        if self.pools.swa is not None and (short := n * ps - self.pools.swa.num_free) > 0:
            self.radix_cache.evict_swa(short)
        return self.pools.alloc(n)

    def _slide_window(self, req: Request) -> None:
        """Free the SWA pages of the request's own positions no window will read again: the next
        forward reads positions >= kv_len - window (a page is freed once all of it lies before)."""
        window = self.radix_cache.window
        if window is None:
            return
        ps = self.pools.page_size
        start, end = max(req.swa_from, req.prefix_len), (req.kv_len - window) // ps * ps
        if end > start:
            self.pools.swa.unmap(self.req_to_token.pages(req.row, start, end), "slid out of the attention window")
            req.swa_from = end

    def _retract(self, req: Request, cause: str = "request released") -> None:
        """Take memory back from a running request (the positions batches gave it included); it
        goes first in line and later re-prefills its prompt and the tokens it has generated so far."""
        self._release(req, cause)
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def _retire(self, req: Request) -> None:
        """The running request is done (finished or aborted) while a launched forward still writes
        its row: it keeps its row, slots and locks until that forward is processed (`_retired`)."""
        self.running.remove(req)
        self.retiring.append(req)

    def _retired(self, req: Request) -> None:
        """No launched forward writes the retiring request's row any more: finish it, or release it
        if it was aborted."""
        if req.finished:
            self.finish(req)
        else:
            self._release(req, "request aborted")

    def _leave(self, req: Request) -> None:
        (self.retiring if req in self.retiring else self.running).remove(req)
        self.resume(req)

    def _release(self, req: Request, cause: str = "request released") -> None:
        """Free the request's own pages (those of its positions [prefix_len, launched_len)) and
        row and unlock its cached prefix (which stays cached)."""
        self._leave(req)
        self.pools.free(self.req_to_token.pages(req.row, req.prefix_len, req.launched_len), cause)
        self.radix_cache.unlock(req.last_node)
        self.req_to_token.free(req.row)
        self._free_state(req, cause)
        req.row, req.kv_len, req.prefix_len, req.swa_from, req.last_node, req.ahead = -1, 0, 0, 0, None, 0
