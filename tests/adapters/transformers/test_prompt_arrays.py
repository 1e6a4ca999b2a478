"""Prompt tokens converted to int64 once a request, ahead of the forward that stages them where the
host can see the request coming (PromptArrays), and never from a stale array: a request
transformers re-creates under the same id stages its new prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from .support import INSTALL, make_engine

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb import prompt_arrays  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb.prompt_arrays import PromptArrays  # noqa: E402


@dataclass
class State:
    request_id: str
    initial_tokens: list[int]
    position_offset: int = 0
    generated_tokens: list[int] = field(default_factory=list)


def test_prompts_converted_ahead_are_staged_from_that_array_up_to_the_budget():
    prompts = PromptArrays(budget=10)
    a, b, c = State("a", list(range(6))), State("b", list(range(10, 16))), State("c", list(range(20, 26)))
    prompts.ahead([a], [b, c])  # a and b make the budget: c is left for later
    held_a, held_b = prompts.of(a), prompts.of(b)
    assert prompts.of(a) is held_a and prompts.of(b) is held_b  # converted once
    assert held_b.tolist() == b.initial_tokens
    assert prompts.of(c).tolist() == c.initial_tokens  # converted when staged


def test_a_request_recreated_under_its_id_stages_its_new_prompt():
    prompts = PromptArrays(budget=100)
    old = State("r", [1, 2, 3])
    prompts.ahead([], [old])
    assert prompts.of(old).tolist() == [1, 2, 3]
    new = State("r", [1, 2, 3, 7, 8])  # as transformers re-creates an offloaded request
    prompts.ahead([], [new])
    assert prompts.of(new).tolist() == [1, 2, 3, 7, 8]


def test_prompts_staged_whole_are_let_go():
    prompts = PromptArrays(budget=100)
    done, going = State("done", [1, 2], position_offset=2), State("going", [3, 4, 5], position_offset=1)
    first = prompts.of(done), prompts.of(going)
    prompts.ahead([done, going], [])
    assert prompts.of(going) is first[1]
    assert prompts.of(done) is not first[0]  # not held: converted again if it were staged again


class Recorder:
    """Forward hooks doing nothing; with the engine's staging.map and the prompt conversions
    recorded in order."""

    def __init__(self, engine, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        staging = engine._staging
        map_batch, convert = staging.map, prompt_arrays._converted

        def mapping(io, pair, step) -> None:
            self.events += [("map", future.state.request_id) for future in io.requests_in_batch]
            map_batch(io, pair, step)

        def converting(state):
            self.events.append(("convert", state.request_id))
            return convert(state)

        monkeypatch.setattr(staging, "map", mapping)
        monkeypatch.setattr(prompt_arrays, "_converted", converting)

    def before_forward(self, view) -> None:
        pass

    def after_forward(self, view) -> None:
        pass

    def end_forward(self, device_work=None) -> None:
        pass


def test_waiting_prompts_are_converted_once_before_the_forward_that_stages_them(monkeypatch):
    # One request a batch, 32 tokens a forward: each 40-token prompt waits, then takes two forwards.
    engine = make_engine("mha", max_batch_tokens=32, max_requests_per_batch=1)
    recorder = Recorder(engine, monkeypatch)
    engine.set_forward_hooks(recorder)
    engine.generate([[t] * 40 for t in (3, 4, 5, 6)], max_new_tokens=3)
    converted = [request for what, request in recorder.events if what == "convert"]
    first_map = {}
    for i, (what, request) in enumerate(recorder.events):
        if what == "map":
            first_map.setdefault(request, i)
    assert sorted(converted) == sorted(first_map) and len(first_map) == 4  # each prompt once
    ahead = [request for request in first_map if recorder.events.index(("convert", request)) < first_map[request]]
    assert len(ahead) == 3  # all but the first, converted while an earlier forward ran
