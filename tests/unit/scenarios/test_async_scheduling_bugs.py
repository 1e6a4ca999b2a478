"""Lifetime bugs of async scheduling, put into the reference engine's real code paths; each one's
damage is proven without the canary (the request's KV or outputs against a no-cache forward), the
canary names the slot at the first forward that reads it, and the same workload without the bug is
clean.

- vLLM #45357-like: a request found finished at step N still has a row in step N+1, already
  launched; the bug drops that row's output and frees the slot it writes at once, while N+1 is in
  flight. The slot becomes a prefill/decode transfer's receive target, the transfer lands, then N+1
  writes the finished request's KV over it.
- vLLM #47728's class: a sliding-window model frees the SWA pages its window slid past by the
  optimistic count (the positions launched, step N+1's in flight included) instead of the processed
  one, so the page of the oldest position step N+1 still reads is freed before N+1 runs: its window
  has a hole.
- vLLM #47728's class under speculative decoding: when step N+1 is scheduled, the positions of step
  N (in flight) past the one token N is sure to produce are rolled back at once, on that count,
  instead of once N's acceptance is known: their slots are freed while step N+1, placed on the
  device after the positions N kept, writes them. A prefill takes them, then writes its KV over the
  request's.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.reference_engine import Engine, Request
from pytest_kvcanary.reference_engine.pd import PDPair
from pytest_kvcanary.reference_engine.scheduler import Batch, Scheduler

from scenario_support import (
    WINDOW, attach_canary, first_reports, kv_off_reference, make_engine, off_greedy_reference, reports, tokens,
)


class Run(NamedTuple):
    decode: Engine
    canary: CanaryRuntime
    finished: Request  # the request that finished at step N
    receiver: Request  # the request transferred while step N+1 was in flight (or once it could be)
    off: set[tuple[str, int]]  # the receiver's (group, position)s whose KV differ from a no-cache forward's
    place: tuple[int, int, int]  # the receiver's (slot, position, row) of its last prompt position


def finish_then_receive() -> Run:
    """A prefill engine prefills R (20 tokens, 3 new) and Y (20 tokens, 4 new); R moves to an async
    decode engine of 42 usable slots and decodes until a step in which it finished is processed
    (R holds positions 0-22, the last written by step N+1, in flight); Y moves there as soon as the
    decode engine can hold it (19 slots are free, so it gets one R freed), and decodes to its end."""
    pair = PDPair(make_engine(), make_engine(num_slots=43, async_scheduling=True))
    pair.decode._async.run_at_launch = False  # a launched step runs as late as it may: after a transfer meanwhile
    prefill, decode = attach_canary(pair.prefill), attach_canary(pair.decode)
    pair.add_transfer_listener(lambda src, dst: decode.import_records(dst, prefill.export_records(src)))
    sent = [pair.prefill.submit(tokens(200, 20), 3), pair.prefill.submit(tokens(201, 20), 4)]
    assert pair.prefill.prefill_for_transfer() == sent
    r = pair._transfer(sent[0])
    pair.prefill.scheduler.finish(sent[0])
    while not r.finished:
        pair.decode.step()
    while (y := pair._transfer(sent[1])) is None:
        pair.decode.step()
    pair.prefill.scheduler.finish(sent[1])
    place = (int(pair.decode.req_to_token_pool.read(y.row, 19, 20)), 19, y.row)
    pair.decode.step()  # step N+1 has run by now
    off = kv_off_reference(pair.decode, y)
    while pair.decode.scheduler.has_work:
        pair.decode.step()
    return Run(pair.decode, decode, r, y, off, place)


def free_the_dropped_slot_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: the slot step N+1 writes for a request that finished at N is freed when N is
    processed (its output is dropped anyway), not once N+1 is."""
    retire, retired = Scheduler._retire, Scheduler._retired

    def retire_freeing(self: Scheduler, req: Request) -> None:
        self.pools.free(self.req_to_token.pages(req.row, req.kv_len, req.launched_len), "its next output is dropped")
        retire(self, req)

    def retired_without_it(self: Scheduler, req: Request) -> None:
        req.kv_len -= 1  # the position step N+1 wrote: its slot was freed already
        retired(self, req)

    monkeypatch.setattr(Scheduler, "_retire", retire_freeing)
    monkeypatch.setattr(Scheduler, "_retired", retired_without_it)


def test_without_the_bug_the_receiver_waits_for_the_slot_and_stays_clean():
    run = finish_then_receive()
    assert run.off == set() and not off_greedy_reference(run.decode, run.receiver)
    assert not off_greedy_reference(run.decode, run.finished) and len(run.finished.output_ids) == 3
    assert first_reports(run.canary) == (None, set())


def test_slot_freed_while_the_next_step_is_in_flight_is_caught_where_the_receiver_reads_it(monkeypatch):
    free_the_dropped_slot_at_once(monkeypatch)
    run = finish_then_receive()
    assert run.off == {("FULL", 19)}, "step N+1 wrote the finished request's KV over the received one"
    assert off_greedy_reference(run.decode, run.receiver)
    step, found = first_reports(run.canary)
    assert step == 3  # the receiver's first decode (steps 0-2 decoded R, step 2 its dropped row)
    slot, position, row = run.place
    assert {(v[0], v[2], v[4], v[5], v[6]) for v in found} == {(phase, "FULL", slot, position, row)
                                                                for phase in ("HEAD", "RECHECK")}
    assert {v[3] for v in found} == {("verify_position", "verify_token", "verify_chain_hash")}


class SlideRun(NamedTuple):
    canary: CanaryRuntime
    req: Request
    off: set[tuple[str, int]]  # (group, position)s whose KV differ from a no-cache forward's, step 5 processed
    freed: list[tuple[int, int]]  # (forwards run, position) of each SWA page the window slid past, as freed


def slide_past_the_window() -> SlideRun:
    """A sliding-window engine (window 4) with async scheduling decodes one request (a 6-token prompt,
    14 new tokens) to its end, each launched step run as late as it may (when first waited for)."""
    engine = make_engine("swa", async_scheduling=True)
    engine._async.run_at_launch = False
    canary = attach_canary(engine)
    req = engine.submit(tokens(300, 6), 14)
    freed: list[tuple[int, int]] = []

    def slid(kind: GroupKind, slots: torch.Tensor, cause: str) -> None:
        if cause == "slid out of the attention window":
            row = engine.req_to_token_pool.read(req.row, 0, req.launched_len).tolist()
            freed.extend((engine.forward_count, row.index(s)) for s in slots.tolist())

    engine.add_free_listener(slid)
    while engine.forward_count < 6:  # until step 5, which writes position 10, is processed
        engine.step()
    off = kv_off_reference(engine, req)
    while engine.scheduler.has_work:
        engine.step()
    return SlideRun(canary, req, off, freed)


def slide_by_the_launched_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: the window slides by the positions launched (kv_len + ahead: the token of the step in
    flight counted as if processed), not by the positions processed."""
    slide = Scheduler._slide_window

    def slide_optimistically(self: Scheduler, req: Request) -> None:
        processed = req.kv_len
        req.kv_len = req.launched_len
        try:
            slide(self, req)
        finally:
            req.kv_len = processed

    monkeypatch.setattr(Scheduler, "_slide_window", slide_optimistically)


def test_without_the_bug_the_window_slides_by_the_processed_count_and_stays_clean():
    run = slide_past_the_window()
    assert run.off == set() and not off_greedy_reference(make_engine("swa"), run.req)
    # position p's SWA page goes once the step reading it was processed: kv_len = p + WINDOW + 1
    assert run.freed[0] == (6, 6), run.freed
    assert first_reports(run.canary) == (None, set())


def test_a_window_slid_by_the_optimistic_count_is_caught_where_the_step_in_flight_reads_the_hole(monkeypatch):
    slide_by_the_launched_count(monkeypatch)
    run = slide_past_the_window()
    # processing step 4 (kv_len 10) freed position 6, which step 5 (in flight: position 10, window 6-9) reads
    assert run.freed[0] == (5, 6), run.freed
    assert {p for group, p in run.off if group == "FULL"} == {10}, "step 5 computed position 10 from a holed window"
    assert off_greedy_reference(make_engine("swa"), run.req)
    step, found = first_reports(run.canary)
    assert step == 5
    assert found == reports(("K", "V"), ("HEAD", "RECHECK"), "SWA", ("verify_missing_slot",), [(0, 10 - WINDOW, 0)])


class SpecRun(NamedTuple):
    canary: CanaryRuntime
    req: Request  # the speculating request
    other: Request  # the request prefilled while step N+1 was in flight (or once it could be)
    off: set[tuple[str, int]]  # req's (group, position)s whose KV differ from a no-cache forward's, other prefilled
    outputs: list[int]  # req's first 13 outputs: its prefill's token and three decodes of 4
    rolled_back: list[tuple[int, list[int]]]  # (forwards run, FULL slots) of each rollback


def speculate_then_prefill() -> SpecRun:
    """An async engine with speculative decoding (k = 3, the draft the whole target: every proposal
    accepted) of 23 usable slots, each launched step run as late as it may, decodes R (an 8-token
    prompt, 16 new: slots 1-8) by 4 positions a step: step 1 writes positions 8-11 (slots 9-12),
    step 2, scheduled while step 1 is in flight, positions 12-15 (slots 13-16). Y (a 10-token
    prompt) arrives once step 2 is launched; it is prefilled as soon as it fits."""
    engine = make_engine(speculative_k=3, draft_layers=4, num_slots=24, async_scheduling=True)
    engine._async.run_at_launch = False
    canary = attach_canary(engine)
    rolled_back: list[tuple[int, list[int]]] = []
    engine.add_free_listener(lambda kind, slots, cause: kind == GroupKind.FULL and "rolled back" in cause
                             and rolled_back.append((engine.forward_count, slots.tolist())))
    req = engine.submit(tokens(500, 8), 16)
    for _ in range(3):  # R's prefill, then steps 1 and 2 launched (step 1 processed)
        engine.step()
    other = engine.submit(tokens(501, 10), 2)
    while engine.forward_count < 4:  # step 3 has run: Y's prefill, if Y fit
        engine.step()
    off = kv_off_reference(engine, req)
    while len(req.output_ids) < 13:  # R's decode reading positions 12-15 (step 4) processed
        engine.step()
    return SpecRun(canary, req, other, off, req.output_ids[:13], rolled_back)


def roll_back_on_the_optimistic_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: a decode scheduled while a speculative decode of the same request is in flight rolls
    that one back at once, as if it kept one position (the one token it is sure to produce): it frees
    the pages past where the new decode would then end, and the rollback once step N is processed
    frees only what is left."""
    schedule, freed_early = Scheduler._schedule_decode, set()

    def schedule_rolling_back(self: Scheduler, retract: bool) -> Batch | None:
        in_flight = [r for r in self._decoding() if r.ahead > 1]
        batch = schedule(self, retract)
        for req, extend in zip(() if batch is None else batch.reqs, () if batch is None else batch.extend_lens):
            if req in in_flight:
                ps, end = self.pools.page_size, req.kv_len + 1 + extend
                pages = self.req_to_token.pages(req.row, -(-end // ps) * ps, req.launched_len)
                freed_early.update(pages.tolist())
                self.pools.free(pages, "rejected draft position rolled back")
        return batch

    def roll_back_the_rest(self: Scheduler, req: Request, kept: int, written: int) -> None:
        if kept < written:
            ps, end = self.pools.page_size, req.launched_len - (written - kept)
            pages = self.req_to_token.pages(req.row, -(-end // ps) * ps, req.launched_len).tolist()
            self.pools.free(torch.tensor([p for p in pages if p not in freed_early], dtype=torch.int64),
                            "rejected draft position rolled back")

    monkeypatch.setattr(Scheduler, "_schedule_decode", schedule_rolling_back)
    monkeypatch.setattr(Scheduler, "_roll_back", roll_back_the_rest)


def test_without_the_bug_the_rejected_positions_wait_for_the_acceptance_and_the_run_stays_clean():
    run = speculate_then_prefill()
    assert run.off == set() and not off_greedy_reference(make_engine(), run.req)
    assert run.outputs == make_engine().generate([run.req.prompt_ids], 13)[0]
    assert run.rolled_back == [] and run.other.kv_len == 0, "nothing rejected; Y waits for room"
    assert first_reports(run.canary) == (None, set())


def test_positions_rolled_back_on_the_optimistic_count_are_caught_where_the_prefill_overwrote_them(monkeypatch):
    roll_back_on_the_optimistic_count(monkeypatch)
    run = speculate_then_prefill()
    # scheduling step 2 freed the slots of positions 13-15 (14-16), which step 2 writes, before step 1 even ran
    assert run.rolled_back[0] == (1, [14, 15, 16]), run.rolled_back
    assert run.off == {(group, p) for group in ("FULL", "DRAFT") for p in (13, 14, 15)}, "Y's KV over R's"
    assert run.outputs != make_engine().generate([run.req.prompt_ids], 13)[0]
    assert off_greedy_reference(make_engine(), run.req)
    step, found = first_reports(run.canary)
    assert step == 4  # R's decode after Y's prefill (step 3) reads positions 13-15
    row = run.req.row
    expected = (reports(("K", "V"), ("HEAD", "RECHECK"), group, ("verify_position", "verify_token",
                                                                "verify_chain_hash"), [(14, 13, row)]) |
                reports(("K", "V"), ("HEAD", "RECHECK"), group, ("verify_position", "verify_token"),
                        [(15, 14, row), (16, 15, row)]) for group in ("FULL", "DRAFT"))
    assert found == set().union(*expected)
