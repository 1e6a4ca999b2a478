"""The cross-rank comparison's parts, on hand-driven hosts standing for ranks: the digest of what a
forward stamped, the reference among gathered digests, the row a diverged rank logs, the entries
two walks do not share."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcanary_kernels.records import PREV_CHAIN_HEAD, Reason
from pytest_kvcanary.canary.log import decode_row
from pytest_kvcanary.canary.ranks import (
    TAIL_TAG, log_divergence, reference_rank, stamp_digest, walk_digest, walk_divergence, walk_entries,
)
from pytest_kvcanary.canary.seam import CacheWalk

BATCHES = [{0: [5, 6, 7], 1: [8, 9]}, {0: [10], 1: [11]}]


def _digests(host, batches, pad_to: int = 0) -> list[int]:
    return [int(stamp_digest(host.forward(batch, pad_to=pad_to), host.runtime.groups)) for batch in batches]


def test_ranks_that_stamp_alike_agree_and_padding_adds_nothing(make_host):
    """Two ranks running the same forwards agree on every digest, also when one of them pads its
    batches as a graph replay does; rank-local bytes (the real-KV fingerprints) do not enter it."""
    first, second = make_host(window=4, real_data="all"), make_host(window=4, real_data="all")
    second.gen.manual_seed(99)  # other KV bytes: another rank's heads
    assert _digests(first, BATCHES) == _digests(second, BATCHES, pad_to=4)


def test_a_rank_that_writes_elsewhere_or_stamps_otherwise_differs(make_host):
    reference = _digests(make_host(), BATCHES)
    elsewhere = make_host()
    elsewhere.next_entry = 7  # its allocator hands out other slots
    assert _digests(elsewhere, BATCHES)[0] != reference[0]
    other_token = make_host()
    assert _digests(other_token, [{0: [5, 6, 7], 1: [8, 4]}])[0] != reference[0]
    swapped = make_host()  # the same tokens in another order: other positions and chains
    assert _digests(swapped, [{0: [6, 5, 7], 1: [8, 9]}])[0] != reference[0]


def test_the_reference_is_the_majority_and_the_lowest_rank_on_a_tie():
    assert int(reference_rank(torch.tensor([4, 7, 7]))) == 1
    assert int(reference_rank(torch.tensor([4, 7]))) == 0
    assert int(reference_rank(torch.tensor([3, 3, 9, 9]))) == 0


def test_a_diverged_rank_logs_one_row_naming_the_reference(make_host):
    host = make_host()
    ring = host.runtime.ring
    digests, step = torch.tensor([11, 22, 11], device=ring.rows.device), torch.tensor([5], device=ring.rows.device)
    for rank in (0, 2):
        log_divergence(ring, digests, rank, step, TAIL_TAG)
    assert int(ring.count) == 0
    log_divergence(ring, digests, 1, step, TAIL_TAG)
    assert int(ring.count) == 1
    v = decode_row(ring.rows[0].tolist(), "single")
    assert (v.reasons, v.phase, v.step, v.slot, v.position, v.row, v.peer, v.stored, v.expected) == (
        ("rank_divergence",), "TAIL", 5, -1, -1, -1, 0, 22, 11)


class NoHostReads(TorchDispatchMode):
    """Fails any operation that reads a tensor's value on the host (.item(), int(), indexing by a
    tensor): inside a CUDA graph capture such a read is an error that invalidates the capture."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a host read of a device value")
        return func(*args, **(kwargs or {}))


def test_the_per_forward_comparison_reads_nothing_on_the_host(make_host):
    """What after_forward runs per forward (the digest, the reference, the masked log) is
    graph-capturable: no value goes back to the host, whichever rank diverged."""
    host = make_host()
    view = host.forward(BATCHES[0], pad_to=4)
    ring = host.runtime.ring
    with NoHostReads():
        digest = stamp_digest(view, host.runtime.groups)
        for rank in (0, 1, 2):
            log_divergence(ring, torch.cat([digest, digest + 1, digest]), rank, ring.step - 1, TAIL_TAG)
    assert int(ring.count) == 1
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        int(digest)


def _walk(*entries: tuple[int, int, int, int]) -> CacheWalk:
    columns = [torch.tensor(c, dtype=torch.int64) for c in zip(*entries)]
    return CacheWalk(*columns, torch.zeros(len(entries), dtype=torch.bool))


def test_walks_differ_by_the_entries_one_holds_and_the_other_does_not():
    mine = walk_entries(_walk((3, 0, PREV_CHAIN_HEAD, 50), (4, 1, 3, 51), (9, 2, 4, 52)))
    same = walk_entries(_walk((4, 1, 3, 51), (9, 2, 4, 52), (3, 0, PREV_CHAIN_HEAD, 50)))  # another order
    theirs = walk_entries(_walk((3, 0, PREV_CHAIN_HEAD, 50), (4, 1, 3, 51), (8, 2, 4, 52)))
    assert walk_digest(mine) == walk_digest(same) != walk_digest(theirs)
    assert walk_divergence(mine, same, 0).shape[0] == 0
    rows = [decode_row([*r[:1], TAIL_TAG, *r[2:]], "single") for r in walk_divergence(mine, theirs, 2).tolist()]
    assert [(v.reasons, v.slot, v.position, v.peer, v.stored != 0, v.expected != 0) for v in rows] == [
        (("rank_divergence",), 8, 2, 2, False, True), (("rank_divergence",), 9, 2, 2, True, False)]
    assert Reason.RANK_DIVERGENCE.label == "rank_divergence"
