"""BatchStaging: what the host stages for each forward from the batch transformers prepared, in the
IO pair's staging buffer (batch_buffers.py): its size, its rows' lanes (lanes.py) and the
token-table entries it adds (prompt tokens converted ahead: prompt_arrays.py); under transformers
5.17 also the hashed blocks it writes (defects.py)."""

from __future__ import annotations

import operator
from typing import Any, Iterable

import numpy as np

from .batch_buffers import BatchBuffers
from .defects import HashedBlockWrites
from .lanes import Lanes
from .prompt_arrays import PromptArrays

_NO_ENTRIES: tuple[list[int], list[int], list[int], np.ndarray] = ([], [], [], np.empty(0, dtype=np.int64))
_STATE = operator.attrgetter("state")  # a FutureRequestState's RequestState


class BatchStaging:
    """Fills `buffers` per forward (``map``) for batches of up to `max_batch` requests; ``lanes``
    says which lane each request holds; ``ahead`` converts upcoming prompts once a forward is
    launched."""

    def __init__(self, buffers: BatchBuffers, max_batch: int, hashed_writes: HashedBlockWrites) -> None:
        self.buffers = buffers
        self.max_batch = max_batch
        self.hashed_writes = hashed_writes
        self.lanes = Lanes(buffers.token_table.shape[0], max_batch)
        self.prompts = PromptArrays(buffers.host["tokens"].shape[1])  # a forward's entries a call
        self._staging_states: list[Any] = []  # the last forward's requests if it staged entries, else none
        self._staged = [-1] * len(buffers.staging)  # the lanes version each pair's staged lanes are of

    def map(self, io: Any, pair: int, step: int) -> None:
        """Stage what only the host knows about the batch transformers just prepared for forward
        `step` (`io`: its host-side inputs) in IO pair `pair`'s buffer: its size, its rows' lanes
        and the token-table entries it adds. Entries past the buffer's fixed-size part, and lanes
        to clear, are left for BatchBuffers.write_direct (``buffers.has_direct_writes``)."""
        batch = io.requests_in_batch
        size = len(batch)
        if size > self.max_batch:
            raise RuntimeError(f"transformers batched {size} requests; the canary was sized for {self.max_batch}")
        buffers, lanes = self.buffers, self.lanes
        buffers.select(pair)
        buffers.set_batch(size, len(io.req_id_to_new_token_position))
        states = list(map(_STATE, batch))
        reassigned = lanes.changed(states)
        if reassigned:
            lanes.assign(states, step)
        if self._staged[pair] != lanes.version:
            # every mapped row's lane: a later batch of this pair may have rows this one lacks
            buffers.set_lanes(lanes.mapped())
            self._staged[pair] = lanes.version
        every_row = reassigned or io.total_seqlen_q != size  # another batch, or not one token a row
        self._staging_states = states if every_row else []
        if every_row:
            cleared, *entries = lanes.token_entries(states, self.prompts)
            buffers.clear_lanes(cleared)
            buffers.set_entries(*entries)
        else:  # a decode step of the same batch: its tokens are the ones the device sampled
            buffers.set_entries(*_NO_ENTRIES)
        if self.hashed_writes.layout.writes_hashed_blocks:
            self.hashed_writes.note(batch, step, every_row=every_row)

    def ahead(self, waiting: Iterable[Any]) -> None:
        """Convert the prompts the next forwards will stage (the last forward's requests, unless it
        was a decode step of the same batch, which stages none; then those of `waiting`,
        transformers' waiting requests in its order): call it once a forward is launched, while the
        device computes it (PromptArrays.ahead)."""
        self.prompts.ahead(self._staging_states, waiting)

    def reset(self) -> None:
        """Every lane free and unknown (UNKNOWN in the token table): the next forward re-sends each
        lane it uses."""
        self.buffers.reset()
        self.lanes = Lanes(self.lanes.count, self.max_batch)
        self.prompts.clear()
        self._staging_states = []
        self._staged = [-1] * len(self.buffers.staging)
