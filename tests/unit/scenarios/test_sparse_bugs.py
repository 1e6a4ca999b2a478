"""A sparse attention's stale index, put back into the reference engine's real code path: the
indexer of a request selects through a per-row list of its tokens' slots that is not reset when the
row is handed to the next request (the class SGLang's NSA canary was written for: an indexer entry
left pointing at a slot that is no longer the request's, here the previous request's, which only
the prefix cache holds).

The test proves the damage without the canary (the request's greedy outputs against a no-cache
recomputation), checks that the canary's first reports are `verify_index` at SELECT of the first
forward that selects through the stale list, at the stale slots and the positions selected there,
and that the same run without the patch is clean.
"""

from __future__ import annotations

import torch

from pytest_kvcanary.reference_engine import Engine, Request, sparse

from scenario_support import attach_canary, first_reports, make_engine, off_greedy_reference, tokens

INDEX = ("verify_index",)


def leak_row_slots(monkeypatch) -> dict[int, torch.Tensor]:
    """The bug: the slots a forward selects through are kept per mapping row and only extended,
    never reset when the row changes hands. Returns the kept lists, by the row's address."""
    kept: dict[int, torch.Tensor] = {}
    token_slots = sparse.token_slots

    def leaky(table_rows: torch.Tensor, page_size: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        fresh = token_slots(table_rows, page_size, start, end)
        old = kept.get(table_rows.data_ptr(), fresh[:0])
        n = min(old.numel(), fresh.numel())
        kept[table_rows.data_ptr()] = slots = torch.cat([old[:n], fresh[n:]])
        return slots

    monkeypatch.setattr(sparse, "token_slots", leaky)
    return kept


ROW = 0  # the one mapping row (max_running 1)


def run_two(engine: Engine) -> tuple[Request, Request, int]:
    """Two requests one after the other in the one mapping row, no shared prefix; and the step of
    the second one's prefill."""
    first = engine.submit(tokens(1, 24), 4)
    while engine.scheduler.has_work:
        engine.step()
    step = engine.forward_count
    second = engine.submit(tokens(2, 20), 4)
    while engine.scheduler.has_work:
        engine.step()
    assert [engine.request_at(ROW, s)[0] for s in (0, step)] == [first.rid, second.rid]  # the row changed hands
    return first, second, step


def test_a_row_handed_to_the_next_request_selects_through_the_last_ones_slots(monkeypatch):
    engine = make_engine("sparse", max_running=1)
    runtime = attach_canary(engine)
    kept = leak_row_slots(monkeypatch)
    first, second, prefill = run_two(engine)
    assert not off_greedy_reference(engine, first) and off_greedy_reference(engine, second)
    stale = next(iter(kept.values())).tolist()  # the list the second request selected through
    mine = engine.req_to_token_pool.read(ROW, 0, len(second.token_ids) - 1).tolist()
    step, found = first_reports(runtime)
    assert step == prefill
    assert found and all((phase, group, reasons, row) == ("SELECT", "INDEXER", INDEX, ROW)
                         for phase, _, group, reasons, _, _, row in found)
    assert all(slot == stale[q] != mine[q] for _, _, _, _, slot, q, _ in found)
    assert {v.phase for v in runtime.log.violations} == {"SELECT"}  # the KV and keys are intact


def test_the_same_run_without_the_bug_is_clean():
    engine = make_engine("sparse", max_running=1)
    runtime = attach_canary(engine)
    first, second, _ = run_two(engine)
    assert not off_greedy_reference(engine, first) and not off_greedy_reference(engine, second)
    assert first_reports(runtime) == (None, set())
