"""Async scheduling (`EngineConfig.async_scheduling`): each step is scheduled and launched before the
results of the step before it are processed, as vLLM's async scheduling and SGLang's overlap
scheduler run.

    Engine.step   schedule N+1      every request of N counted as having produced one token
                                    (Scheduler.schedule(retract=False))
                  launch N+1        its input ids for N's requests gathered on the device from N's
                                    sampled tokens; the forward is the engine's own, hooks included
                  process N         wait for N's tokens; a request that finished at N retires: it
                                    still had a row in N+1, whose token is dropped, and keeps its
                                    slots until N+1 is processed

With speculative decoding (speculative.py) a decode writes up to k + 1 positions of a request and
keeps 1 to all of them, which only the device knows until the host processes it. The next decode is
scheduled as if the one in flight kept every position: the request's slots past them are allocated
(the worst case), and the batch's positions, prefix lengths, slots and input ids are those of that
case. When it runs, it is moved on the device (`_follow`): each request's positions go back by the
proposals the decode before it rejected, its slots are read from its row at those positions (over
the rejected ones), its input id is that decode's last new token, and a hybrid model's running state
is the rollback state that decode wrote after the positions it kept. The forward's view (what the
canary checks) is built from the moved batch: the positions, prefix lengths and input ids the
forward uses, the DRAFT group's inputs included. The eager forward takes the lengths as host ints,
read back inside the launched forward (on CUDA a wait on the step before it there). Processing a
decode frees the slots of the positions it rejected but those the decode launched after it writes:
as many past that one's end, the rest once that one is processed (Scheduler._roll_back). A request
still needing fewer tokens than the decode in flight may give it gets one position in the next
(Scheduler._wanted_len): if it finishes in flight, it retires, and that position holds its own last
token.

    Engine.step   schedule N+1      N's requests at their positions if N keeps every one
                  launch N+1        moved back on the device by what N rejected (_follow)
                  process N         learn what N kept; free its rejected slots N+1 does not write

A launched step writes each request's last new token into the engine's token table, on the device,
at the position it goes to, right after sampling (a speculative decode's proposals are there
already: its draft writes them). So the next step's TAIL checks the input ids that step gathered
(by its own index into these tokens) against the token table, on the device and in stream order;
once the host processes N, the table holds its copy of the token and the HEAD after that checks
each stamped record against the host's bookkeeping.

On CUDA a launch is asynchronous by itself: the tokens are copied to pinned host memory behind the
forward and the host waits on an event when it processes the step. On a CPU the forward of a
launched step runs, by default, when the host first waits for its results, as late as a device may
run it. Whatever the host does meanwhile (scheduling the next step, loading pages back, receiving a
prefill/decode transfer) then lands before it, the worst case of copies that do not wait for the
device (a transfer over RDMA, vLLM #45357). `AsyncSteps.run_at_launch` runs it at once instead, in
CUDA's order, where the host learns a step's tokens only after the next step ran. That is why every
slot, row and lock a launched step uses stays held until the step is processed: a decode that would
retract, and any step after a prefill (whose radix insertion may free duplicate slots the next step
reads), first process the step in flight.

With seeded jitter (`EngineConfig.jitter_seed`, jitter.py) each launched step draws where its
forward runs, on either device: at launch, once the host has processed the step before it (its
frees, finished requests and radix insertions land first), or when the host first waits for it
(the next step's scheduling, load-backs and transfers land first). A lifetime bug that needs one of
those orders meets it, reproducibly from the seed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from .jitter import Jitter
from .request import Request
from .scheduler import Batch, Scheduler

# Where a launched step's forward runs (Launched.runs): jitter draws one per step.
AT_LAUNCH, AFTER_PREVIOUS, WHEN_WAITED = "at launch", "once the step before it is processed", "when waited for"
RUN_POINTS = (AT_LAUNCH, AFTER_PREVIOUS, WHEN_WAITED)


@dataclass(eq=False)
class Launched:
    """A launched step: its batch, where its forward runs (one of RUN_POINTS), its forward until it
    runs (run); once run, the batch as it ran (ran: what the host did not know filled in, _follow)
    and, on the device, each request's new tokens (tokens [B, max extend]: its sampled token, or a
    speculative decode's accepted proposals and the target's next token) and how many (counts
    [B]), and, on CUDA, their pinned host copies and the event that says they landed."""

    batch: Batch
    runs: str = AT_LAUNCH
    run: Callable[[], None] | None = None
    ran: Batch | None = None
    tokens: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    host: tuple[torch.Tensor, torch.Tensor] | None = None
    landed: torch.cuda.Event | None = None


class AsyncSteps:
    """An engine's steps launched and not processed yet, oldest first (at most two, within a step).
    The engine is given by its scheduler, its token table ([rows, max_context], on its device), its
    forward (over a batch: each request's new tokens on the device, padded, and how many, as
    Launched holds them, the host not waiting) and its account (processes a forward's results,
    returns the requests that finished). run_at_launch: a launched step's forward runs at once
    (CUDA's order: the host learns a step's tokens after the next step ran; the default on CUDA,
    and a CPU can run so too) or when the host first waits for its results (a CPU's default); a
    jitter with a seed draws that per step instead, from RUN_POINTS."""

    def __init__(self, scheduler: Scheduler, token_table: torch.Tensor,
                 forward: Callable[[Batch], tuple[torch.Tensor, torch.Tensor]],
                 account: Callable[[Batch, list[list[int]]], list[Request]], jitter: Jitter | None = None) -> None:
        self.scheduler, self.token_table, self.forward, self.account = scheduler, token_table, forward, account
        self.jitter = jitter if jitter is not None else Jitter(None)
        self.device = token_table.device
        self.launched: deque[Launched] = deque()
        self.run_at_launch = self.device.type == "cuda"
        self.num_moved_back = 0  # steps moved back behind a speculative decode's rejections (_follow)

    def step(self) -> list[Request]:
        """Launch the next step and process the one before it; returns the requests that finished
        in the processed one. RuntimeError when requests wait but nothing can run; if a forward
        raises, every launched step is undone (their requests back to waiting) and it propagates."""
        try:
            return self._step()
        except BaseException:
            batches = [s.batch for s in self.launched]
            self.launched.clear()
            self.scheduler.abort(*batches)
            raise

    def settle(self) -> None:
        """Let every launched forward run to its end and forget their results (the engine's reset)."""
        while self.launched:
            self._wait(self.launched.popleft())

    def _step(self) -> list[Request]:
        scheduler, finished = self.scheduler, []
        if self.launched and self.launched[-1].batch.is_prefill:
            finished += self._process()
        batch = scheduler.schedule(retract=not self.launched)
        if batch is None and self.launched:  # nothing to overlap (or it would retract): the step in flight first
            finished += self._process()
            batch = scheduler.schedule()
        if batch is None:
            if scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests pending")
            return finished
        self._launch(batch)
        if len(self.launched) > 1:
            finished += self._process()
        if self.launched[-1].runs == AFTER_PREVIOUS:
            self._run_to(self.launched[-1])
        return finished

    def _launch(self, batch: Batch) -> None:
        """Launch the batch's forward: now (run_at_launch), else when the host first waits for it;
        with jitter, at the point drawn (RUN_POINTS)."""
        device, prev = self.device, self.launched[-1] if self.launched else None
        carried = [] if prev is None else self._carried(batch, prev.batch)
        rows = torch.tensor(batch.rows, dtype=torch.int64, device=device)
        step = Launched(batch, self.jitter.choose(RUN_POINTS, AT_LAUNCH if self.run_at_launch else WHEN_WAITED))

        def run() -> None:
            ran = step.ran = batch if not carried else self._follow(batch, prev, carried)
            step.tokens, step.counts = self.forward(ran)
            # each request's last new token, at the position it goes to (if within the table; no sync)
            at = torch.tensor(ran.prefix_lens, dtype=torch.int64, device=device) + step.counts
            fits, at = at < self.token_table.shape[1], at.clamp(max=self.token_table.shape[1] - 1)
            last = step.tokens.gather(1, step.counts[:, None] - 1)[:, 0]
            self.token_table[rows, at] = torch.where(fits, last, self.token_table[rows, at])
            if device.type == "cuda":
                step.host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                  for t in (step.tokens, step.counts))
                for host, t in zip(step.host, (step.tokens, step.counts)):
                    host.copy_(t, non_blocking=True)
                step.landed = torch.cuda.Event()
                step.landed.record()

        step.run = run
        self.launched.append(step)  # before it runs: a forward that raises is undone with it
        if step.runs == AT_LAUNCH:  # the forwards launched before it first: a device runs them in order
            self._run_to(step)

    @staticmethod
    def _carried(batch: Batch, prev: Batch) -> list[tuple[int, int]]:
        """(token index in batch, request index in prev) of each input id of batch that prev samples:
        the first token of each request prev also runs."""
        index = {req: i for i, req in enumerate(prev.reqs)}
        starts = torch.tensor([0, *batch.extend_lens[:-1]]).cumsum(0).tolist()
        return [(start, index[req]) for req, start in zip(batch.reqs, starts) if req in index]

    def _follow(self, batch: Batch, prev: Launched, carried: list[tuple[int, int]]) -> Batch:
        """The batch as it runs after prev, from prev's results on the device: each carried
        request's first input id is the last token prev produced for it. Where prev is a
        speculative decode that kept fewer of the request's positions than it wrote (the scheduler
        placed the batch as if it kept them all), the request's positions move back by as many, and
        with them its prefix length, its slots (read from its row at those positions), and a hybrid
        model's running state (the rollback state prev wrote after that many tokens) and rollback
        states' lengths. The eager forward takes each request's lengths and state slot as host ints:
        those are read back from the device here."""
        device, table, ps = self.device, self.scheduler.req_to_token.table, self.scheduler.pools.page_size
        dst, src = (torch.tensor(x, dtype=torch.int64, device=device) for x in zip(*carried))
        ids = batch.input_ids.to(device, copy=True)
        ids[dst] = prev.tokens[src, prev.counts[src] - 1]
        if max(prev.batch.extend_lens) == 1:  # one token per request: nothing moves
            return batch._replace(input_ids=ids)
        starts = torch.tensor([0, *batch.extend_lens[:-1]]).cumsum(0).tolist()
        index = [starts.index(d) for d, _ in carried]  # the carried requests' indices in the batch
        extend = torch.tensor(prev.batch.extend_lens, dtype=torch.int64, device=device)
        back = torch.zeros(len(batch.reqs), dtype=torch.int64, device=device)
        back[torch.tensor(index, dtype=torch.int64, device=device)] = extend[src] - prev.counts[src]
        positions = batch.positions.to(device) - back.repeat_interleave(torch.tensor(batch.extend_lens, device=device))
        rows = torch.tensor(batch.rows, dtype=torch.int64, device=device).repeat_interleave(
            torch.tensor(batch.extend_lens, device=device))
        slots = table[rows, positions // ps] * ps + positions % ps
        state_slots, back = list(batch.state_slots), back.tolist()
        self.num_moved_back += any(back)
        if state_slots:  # the state after the kept positions: the running one if all were kept
            for b, i in zip(index, src.tolist()):
                states = [prev.ran.state_slots[i], *prev.batch.checkpoint_slots[i]]
                state_slots[b] = states[(prev.batch.extend_lens[i] - back[b]) % len(states)]
        return batch._replace(
            input_ids=ids, positions=positions, out_cache_loc=slots, state_slots=state_slots,
            prefix_lens=[p - n for p, n in zip(batch.prefix_lens, back)],
            checkpoint_lens=[[x - n for x in lens] for lens, n in zip(batch.checkpoint_lens, back)])

    def _run_to(self, step: Launched) -> None:
        """Run the launched forwards not run yet up to this step's, in launch order."""
        for s in self.launched if step in self.launched else [step]:
            if s.run is not None:
                run, s.run = s.run, None
                run()
            if s is step:
                break

    def _wait(self, step: Launched) -> None:
        """Until the step's tokens are there: its forward (and those before it) run, and on CUDA
        their copy to the host landed."""
        self._run_to(step)
        if step.landed is not None:
            step.landed.synchronize()

    def _process(self) -> list[Request]:
        """Wait for the oldest launched step and process its results."""
        step = self.launched[0]
        self._wait(step)
        self.launched.popleft()
        tokens, counts = (t.tolist() for t in (step.host or (step.tokens, step.counts)))
        return self.account(step.batch, [row[:n] for row, n in zip(tokens, counts)])
