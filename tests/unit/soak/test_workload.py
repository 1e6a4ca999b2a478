"""The soak's workloads: seeded, shaped like traffic (every kind of reuse a KV cache meets), and
readable back from the one line a failure prints."""

from __future__ import annotations

from collections import Counter

import pytest

from pytest_kvcanary.soak.workload import Geometry, Recipe, Round, Workload, make_workload, subsets

GEOMETRY = Geometry(page_size=16, window=24, capacity=767, max_context=512, max_batch=8, contexts=True, serves=True)


def test_a_seed_makes_the_same_workload_and_another_seed_another():
    assert make_workload(3, 6, GEOMETRY) == make_workload(3, 6, GEOMETRY)
    assert make_workload(3, 6, GEOMETRY) != make_workload(4, 6, GEOMETRY)


def test_a_workload_holds_every_kind_of_reuse_and_pressure():
    workload = make_workload(0, 12, GEOMETRY)
    requests = [(i, q) for i, r in enumerate(workload.rounds) for q in r.requests]
    prompts = [tuple(workload.prompt(q)) for _, q in requests]
    lengths = Counter(len(p) % GEOMETRY.page_size for p in prompts)
    per_round = [Counter(tuple(workload.prompt(q)) for q in r.requests) for r in workload.rounds]
    first_round = {}
    for i, q in requests:
        first_round.setdefault(tuple(workload.prompt(q)), i)
    assert any(n > 1 for counts in per_round for n in counts.values()), "an exact duplicate inside a round"
    assert any(first_round[tuple(workload.prompt(q))] < i for i, q in requests), "a prompt of an earlier round again"
    assert lengths[0] and lengths[1] and lengths[GEOMETRY.page_size - 1], "whole pages, and one token either side"
    stems = Counter(p[:16] for p in prompts)
    assert max(stems.values()) > 5, "shared system prompts"
    assert any(q.max_new_tokens == 1 for _, q in requests)
    assert any(len(workload.prompt(q)) + q.max_new_tokens > GEOMETRY.window * 2 for _, q in requests), "past the window"
    assert any(r.gaps and any(q.wave for q in r.requests) for r in workload.rounds), "requests joining a running batch"
    assert any(q.abort_after is not None for _, q in requests) and any(q.context for _, q in requests)
    pressed = [sum(len(workload.prompt(q)) + q.max_new_tokens for q in r.requests) for r in workload.rounds[2::3]]
    assert min(pressed) > GEOMETRY.capacity, "every third round asks for more than the pool holds"
    assert all(len(workload.prompt(q)) + q.max_new_tokens <= GEOMETRY.max_context for _, q in requests)


def test_an_engine_that_serves_gets_bursts_and_abort_storms():
    """A burst: earlier requests again (their prefixes cached, evicted or in host memory), then one
    forward later more new long requests than the pool holds. An abort storm: half a round gone at
    one forward of one wave."""
    workload = make_workload(2, 12, GEOMETRY)
    earlier = [set() for _ in workload.rounds]
    for i in range(1, len(workload.rounds)):
        earlier[i] = earlier[i - 1] | {tuple(workload.prompt(q)) for q in workload.rounds[i - 1].requests}
    bursts = [i for i, r in enumerate(workload.rounds) if r.gaps == (1,) and {q.wave for q in r.requests} == {0, 1}
              and all(tuple(workload.prompt(q)) in earlier[i] for q in r.requests if q.wave == 0)
              and sum(len(workload.prompt(q)) + q.max_new_tokens for q in r.requests if q.wave == 1) > GEOMETRY.capacity]
    assert bursts == [5, 11]
    storms = [i for i, r in enumerate(workload.rounds)
              if max(Counter((q.wave, q.abort_after) for q in r.requests if q.abort_after).values(), default=0)
              >= len(r.requests) // 2 >= 1]
    assert {3, 9} <= set(storms)


def test_an_engine_that_serves_gets_rounds_of_pauses_mid_decode_under_pressure():
    """Every sixth round from the fifth: a third of it paused at one forward after its arrival (past
    its prefill) for 1 to 4 forwards, the rest more than the pool holds; no other round pauses."""
    workload = make_workload(2, 12, GEOMETRY)
    paused = {i: [q for q in r.requests if q.pause is not None] for i, r in enumerate(workload.rounds)}
    assert [i for i, qs in paused.items() if qs] == [4, 10]
    for i in (4, 10):
        requests = workload.rounds[i].requests
        assert len(paused[i]) == max(1, len(requests) // 3) and len({q.pause for q in paused[i]}) == 1
        after, length = paused[i][0].pause
        assert 1 <= after <= 3 and 1 <= length <= 4 and all(q.wave == 0 for q in paused[i])
        assert sum(len(workload.prompt(q)) + q.max_new_tokens for q in requests) > GEOMETRY.capacity


def test_an_engine_that_neither_serves_nor_takes_contexts_gets_neither():
    plain = Geometry(page_size=1, window=None, capacity=1023, max_context=256, max_batch=8, contexts=False,
                     serves=False)
    workload = make_workload(1, 9, plain)
    requests = [q for r in workload.rounds for q in r.requests]
    assert all(q.wave == 0 and q.abort_after is None and q.pause is None and q.context == 0 for q in requests)
    assert all(r.gaps == () for r in workload.rounds)
    assert all(len(workload.prompt(q)) + q.max_new_tokens <= plain.max_context for q in requests)


def test_the_text_of_a_workload_reads_back_as_it():
    workload = make_workload(7, 5, GEOMETRY)
    assert Workload.from_text(workload.to_text()) == workload
    small = Workload(2, (Round((Recipe(-1, 0, 9, 3, 1), Recipe(4, 17, 5, 2, 6, wave=1, context=2, abort_after=3),
                                Recipe(1, 3, 8, 1, 9, pause=(2, 4))), (4,)),))
    assert small.to_text() == "2/4:-1.0+9.3*1@0;4.17+5.2*6@1~2!3;1.3+8.1*9@0^2.4"
    assert Workload.from_text(small.to_text()) == small


@pytest.mark.parametrize(("text", "names"), [
    ("x/:1.2+3.4*5@0", "its seed"),
    ("1/2,3", "gaps:request"),
    ("1/:1.2+3.4*5", "stem.stem_len+tail.tail_len*max_new@wave"),
])
def test_a_text_that_is_not_a_workload_is_an_error_naming_the_part(text, names):
    with pytest.raises(ValueError, match=names.replace("+", r"\+").replace("*", r"\*").replace(".", r"\.")):
        Workload.from_text(text)


def test_shrinking_tries_fewer_rounds_then_fewer_requests_then_shorter_ones():
    workload = make_workload(5, 4, GEOMETRY)
    candidates = list(subsets(workload))
    assert candidates[0].rounds == workload.rounds[-1:]
    assert all(c.size <= workload.size for c in candidates)
    assert any(c.size < workload.size and len(c.rounds) == len(workload.rounds) for c in candidates)
    assert any(c.size == workload.size and c != workload for c in candidates), "same requests, smaller ones"
