"""Lanes: which row of the canary's block and token tables (a lane) each request holds, and what
the host has sent of each lane's tokens.

A request holds a lane from its first forward until the lane is handed to another request: there
are twice as many lanes as batch rows and a request without one takes the lane used longest ago, so
a forward still in flight never reads a lane that changed hands, and a request that moves between
batch rows (transformers reorders its batches as requests join and leave) sends nothing again.
Per batch row, the lanes keep a view of the row's lane (its state, its lane, what the lane knows)
for the last batch; it goes back to the lanes when the batch changes.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ...canary.seam import RowOwners
from .prompt_arrays import PromptArrays


class Lanes:
    """`count` lanes for batches of up to `rows` requests (RequestStates: ``request_id``,
    ``initial_tokens``, ``generated_tokens``, ``position_offset``). ``owners``: the request id
    that held each lane at each forward."""

    def __init__(self, count: int, rows: int) -> None:
        self.count = count
        self.lane_of: dict[str, int] = {}  # request id -> the lane it holds
        self.lane_states: list[Any] = [None] * count  # the RequestState each lane's tokens are of
        self.lane_known = [0] * count  # positions of that state in token_table (as of the last batch change)
        self.lane_used = [-1] * count  # the forward that last used each lane
        self.row_states: list[Any] = [None] * rows  # the last batch's requests, by batch row
        self.row_lanes = [0] * rows  # their lanes
        self.row_known = [0] * rows  # their lanes' known positions, kept up to date per forward
        self.rows_mapped = 0  # the last batch's size
        self.version = 0  # changes whenever a row's lane does
        self.owners: RowOwners[str] = RowOwners()

    def changed(self, states: list[Any]) -> bool:
        """Whether these are not the last batch's requests, row by row."""
        return not all(map(operator.is_, states, self.row_states))

    def mapped(self) -> list[int]:
        """The last batch's lanes, by batch row."""
        return self.row_lanes[:self.rows_mapped]

    def assign(self, states: list[Any], step: int) -> None:
        """Give each request of a batch that is not the last one's its lane (forward `step`): the
        one it holds, else a free lane or the one used longest ago (its request sends everything
        again if it comes back). The rows' views of their lanes (what each holds) come from the
        lanes."""
        used = self.lane_used
        for row, lane in enumerate(self.mapped()):  # the rows' views, back
            self.lane_known[lane] = self.row_known[row]
            used[lane] = step - 1  # (at most) the forward before, which may still run
        mine = {self.lane_of.get(state.request_id) for state in states}
        for row, state in enumerate(states):
            lane = self.lane_of.get(state.request_id)
            if lane is None:
                lane = min((lane for lane in range(len(used)) if lane not in mine), key=used.__getitem__)
                mine.add(lane)
                gone = self.lane_states[lane]
                if gone is not None:
                    del self.lane_of[gone.request_id]
                self.lane_of[state.request_id] = lane
            if self.lane_states[lane] is not state:  # a new request, or one transformers re-created
                self.lane_states[lane], self.lane_known[lane] = state, 0
                self.owners.note(lane, step, state.request_id)
            used[lane] = step
            self.row_states[row], self.row_lanes[row], self.row_known[row] = state, lane, self.lane_known[lane]
        # Rows past the batch held no one now: a later batch with more rows is mapped afresh (their
        # lanes may have gone to the requests of this one).
        self.row_states[len(states):] = [None] * (len(self.row_states) - len(states))
        self.rows_mapped = len(states)
        self.version += 1

    def token_entries(self, states: list[Any], prompts: PromptArrays
                      ) -> tuple[list[int], list[int], list[int], list[int], np.ndarray]:
        """(cleared, lanes, starts, counts, tokens): the lanes to clear and the token-table entries
        this forward adds, a run a row (BatchBuffers.set_entries): the positions its request
        advanced past since its lane last heard of it whose token the host has (the others are
        left to the tokens the device sampled, and sent once the host has them). A lane that
        changed hands is cleared first (UNKNOWN everywhere: no position of its request may be
        checked against the tokens of the lane's previous request). Prompt tokens come from
        `prompts` (int64, converted once a request), generated ones from the request's list."""
        known, row_lanes = self.row_known, self.row_lanes
        cleared: list[int] = []
        lanes: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        pieces: list[Any] = []  # the runs' tokens: prompt slices (int64) and lists of generated tokens
        generated_run: list[int] = []  # generated tokens since the last prompt slice
        for row, state in enumerate(states):
            length, start = state.position_offset, known[row]  # advanced past this forward's tokens
            if length <= start:
                continue
            generated, n = state.generated_tokens, len(state.initial_tokens)
            have = min(length, n + len(generated))  # positions [start, have)
            known[row] = have
            if not start:
                cleared.append(row_lanes[row])
            if have <= start:
                continue
            lanes.append(row_lanes[row])
            starts.append(start)
            counts.append(have - start)
            if start < n:
                if generated_run:
                    pieces.append(generated_run)
                    generated_run = []
                pieces.append(prompts.of(state)[start:have])
            generated_run += generated[max(start - n, 0):max(have - n, 0)]
        if generated_run:
            pieces.append(generated_run)
        if len(pieces) > 1:
            return cleared, lanes, starts, counts, np.concatenate(pieces, dtype=np.int64)
        return cleared, lanes, starts, counts, np.asarray(pieces[0] if pieces else (), dtype=np.int64)
