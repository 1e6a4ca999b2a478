"""Which lane (mapping row) each batch row's request holds, as the host stages it for the device:
per IO pair under async batching, where a pair's staging buffer is filled only every other forward.
A batch that shrinks on one pair and comes back whole on the other must still find the lane of
every row staged there (before: the rows past the shorter batch kept lanes of an older one, so a
request's blocks were read into another request's lane, and whole lanes were reported at HEAD
with another prompt's tokens). Driven on a CPU engine with two staging buffers and hand-made
batches: the staging logic is the host's alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from .support import INSTALL, make_engine

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb.batch_buffers import BatchBuffers  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb.staging import BatchStaging  # noqa: E402


@dataclass
class State:
    request_id: str
    initial_tokens: list[int]
    position_offset: int
    generated_tokens: list[int] = field(default_factory=list)


@dataclass
class Future:
    state: State
    query_length: int


@dataclass
class BatchIO:
    requests_in_batch: list[Future]
    req_id_to_new_token_position: dict[str, int]
    total_seqlen_q: int


class TwoPairStaging:
    """A CPU engine's host staging with two IO pairs, fed batches by hand."""

    def __init__(self) -> None:
        engine = make_engine("mha")
        buffers = BatchBuffers(engine.capacities, 2 * engine.capacities.max_batch, engine.device, pairs=2)
        self.staging = BatchStaging(buffers, engine.capacities.max_batch, engine._hashed_writes)
        self.lanes = self.staging.lanes
        self.states: dict[str, State] = {}
        self.pair = 0
        self.step = 0

    def forward(self, *names: str, prefill: bool = False) -> list[int]:
        """Map a batch of these requests on the next IO pair (a prefill of 4 tokens for a new
        request, else one token each); returns the lanes staged for its rows."""
        futures = []
        for name in names:
            state = self.states.get(name)
            if state is None:
                state = self.states[name] = State(name, [ord(c) for c in name * 4], position_offset=0)
            query = 4 if state.position_offset == 0 else 1
            state.position_offset += query
            futures.append(Future(state, query))
        io = BatchIO(futures, {n: i for i, n in enumerate(names)}, sum(f.query_length for f in futures))
        self.staging.map(io, self.pair, self.step)
        self.step += 1
        staged = self.staging.buffers._hosts[self.pair]["lanes"][0, :len(names)].tolist()
        self.pair = 1 - self.pair
        return staged

    def held(self, *names: str) -> list[int]:
        return [self.lanes.lane_of[name] for name in names]


def test_a_batch_back_whole_on_the_other_io_pair_finds_every_rows_lane_staged():
    run = TwoPairStaging()
    assert run.forward("a", "b", "c") == run.held("a", "b", "c")  # pair 0
    assert run.forward("a", "b") == run.held("a", "b")  # pair 1: c left the batch
    assert run.forward("a", "b", "c") == run.held("a", "b", "c")  # pair 0: c back
    assert run.forward("a", "b", "c") == run.held("a", "b", "c")  # pair 1: its row 2 was never staged
    assert len(set(run.held("a", "b", "c"))) == 3


def test_a_request_back_after_its_lane_went_to_another_gets_a_lane_of_its_own():
    """c leaves the batch from row 2 and its lane goes to a new request; when c comes back in row 2,
    the rows before it unchanged, it is mapped again (before: it kept the lane it had in row 2)."""
    run = TwoPairStaging()
    run.forward("c")  # c gets the first lane, so it is the lowest of the lanes a new request may take
    run.forward("a", "b", "c", "d")
    lanes = run.lanes
    c_lane = lanes.lane_of["c"]
    held = set(run.held("a", "b", "c", "d"))
    for lane in range(len(lanes.lane_used)):  # the free lanes used since: a new request takes a held one
        if lane not in held:
            lanes.lane_used[lane] = 10
    run.forward("a", "x")
    assert lanes.lane_of["x"] == c_lane and "c" not in lanes.lane_of  # x took c's lane
    staged = run.forward("a", "x", "c")
    assert staged == run.held("a", "x", "c") and len(set(staged)) == 3
