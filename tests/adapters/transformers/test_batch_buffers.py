"""The token-table entries the host stages per forward (BatchBuffers): runs of a lane's positions,
lanes cleared before a new request's entries, and the entries past the fixed-size part written
before the forward, all landing where the runs say (checked against a plain-dict reference on
fresh random runs)."""

from __future__ import annotations

import random

import pytest
import torch

from .support import INSTALL

pytest.importorskip("transformers", reason=INSTALL)

from kvcanary_kernels.records import UNKNOWN  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb.batch_buffers import BatchBuffers  # noqa: E402
from pytest_kvcanary.canary.seam import Capacities  # noqa: E402

LANES, CONTEXT, MAX_TOKENS = 6, 40, 16


def staged(buffers: BatchBuffers, cleared: list[int], runs: list[tuple[int, int, list[int]]]) -> None:
    """One forward's host staging and its device work, as the engine orders them."""
    buffers.select(0)
    buffers.clear_lanes(cleared)
    buffers.set_entries([lane for lane, _, _ in runs], [start for _, start, _ in runs],
                        [len(tokens) for _, _, tokens in runs], [t for _, _, tokens in runs for t in tokens])
    if buffers.has_direct_writes():
        buffers.write_direct()
    buffers.upload()
    buffers.apply_tokens()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runs_cleared_lanes_and_spilled_entries_land_where_the_runs_say(seed):
    rng = random.Random(seed)
    buffers = BatchBuffers(Capacities(max_batch=4, max_tokens=MAX_TOKENS, max_context=CONTEXT), LANES,
                           torch.device("cpu"), pairs=1)
    expected = {(lane, p): UNKNOWN for lane in range(LANES) for p in range(CONTEXT)}
    spilled = 0
    for _ in range(12):
        cleared = rng.sample(range(LANES), rng.randrange(3))
        for lane in cleared:
            expected.update({(lane, p): UNKNOWN for p in range(CONTEXT)})
        runs = []
        for lane in rng.sample(range(LANES), rng.randrange(4)):
            start = rng.randrange(CONTEXT)
            tokens = [rng.randrange(1000) for _ in range(rng.randrange(1, CONTEXT - start + 1))]
            runs.append((lane, start, tokens))
            expected.update({(lane, start + i): t for i, t in enumerate(tokens)})
        spilled += sum(len(tokens) for _, _, tokens in runs) > MAX_TOKENS
        staged(buffers, cleared, runs)
        table = buffers.token_table.tolist()
        assert {(lane, p): table[lane][p] for lane in range(LANES) for p in range(CONTEXT)} == expected
    assert spilled, "no forward had entries past the fixed-size part"


def test_a_forward_without_entries_leaves_the_table_as_it_was():
    buffers = BatchBuffers(Capacities(max_batch=4, max_tokens=MAX_TOKENS, max_context=CONTEXT), LANES,
                           torch.device("cpu"), pairs=1)
    staged(buffers, [], [(1, 3, [7, 8, 9])])
    before = buffers.token_table.clone()
    staged(buffers, [], [])
    assert torch.equal(buffers.token_table, before)
    assert buffers.token_table[1, 3:6].tolist() == [7, 8, 9]
