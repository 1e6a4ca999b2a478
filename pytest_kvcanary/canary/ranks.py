"""Cross-rank consistency of a parallel engine, which no rank's own canary can see.

Every rank of a tensor- or pipeline-parallel engine runs the same scheduler, so each forward every
rank writes each new token's shard into the same slot, with the same token, position and chain
(only the real-KV fingerprints differ: each rank holds other heads or layers). After each forward
`RankCheck` folds what this rank's TAIL stamped into one int64 digest, gathers every rank's
digest and compares them on the device (graph-capturable: no host sync, fixed shapes); at each
sweep it compares the prefix caches' walks on the host, naming the slots that differ. A rank whose
digest differs from the reference (the digest most ranks hold; on a tie, the lowest such rank's)
logs a `rank_divergence` row naming the reference rank.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from kvcanary_kernels import map_slot_ref, mix_torch
from kvcanary_kernels.records import (
    COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STEP, COL_STORED, COL_TAG,
    FIELD_POSITION, FIELD_PREV_HASH, FIELD_TOKEN, ROW_WIDTH, GroupKind, Half, Phase, Reason, launch_tag,
)

from .groups import GroupState
from .runtime import CanaryRuntime
from .seam import CacheWalk, ForwardView, PagedWalk
from .walk import paged_entries

TAIL_TAG = launch_tag(Phase.TAIL, Half.K, GroupKind.FULL)
SWEEP_TAG = launch_tag(Phase.SWEEP, Half.K, GroupKind.FULL)


def _fold(*columns: torch.Tensor) -> torch.Tensor:
    """mix(... mix(mix(a) ^ b) ...) of int64 columns, element by element."""
    acc = mix_torch(columns[0])
    for column in columns[1:]:
        acc = mix_torch(acc ^ column)
    return acc


def stamp_digest(view: ForwardView, groups: Sequence[GroupState]) -> torch.Tensor:
    """[1] int64: what this forward's TAIL stamped, read back from the records of every slot the
    forward wrote (group, slot, token, position, prev_hash, keyed by the token's place in the view;
    real-KV fingerprints left out). Device work on fixed shapes: padding rows (extend 0) add nothing."""
    lens = view.extend_lens
    ends = lens.cumsum(0)
    t = torch.arange(view.input_ids.shape[0], device=lens.device)
    b = torch.searchsorted(ends, t, right=True)
    valid = b < lens.shape[0]
    b = b.clamp(max=lens.shape[0] - 1)
    rows, positions = view.rows[b], view.prefix_lens[b] + t - (ends[b] - lens[b])
    key = mix_torch(t + 1)
    total = torch.zeros((), dtype=torch.int64, device=lens.device)
    for group in groups:
        slots = map_slot_ref(group.mapping, rows, positions, group.pool.num_slots)
        rec = next(iter(group.halves.values())).records[slots]
        terms = _fold(slots + (int(group.pool.kind) << 48), rec[:, FIELD_TOKEN], rec[:, FIELD_POSITION],
                      rec[:, FIELD_PREV_HASH], key)
        total = total + torch.where(valid, terms, 0).sum()  # wraps
    return mix_torch(total).reshape(1)


def reference_rank(digests: torch.Tensor) -> torch.Tensor:
    """The rank whose digest most ranks share (the lowest such rank on a tie), as a 0-d tensor."""
    votes = (digests[:, None] == digests[None, :]).sum(1)
    return torch.argmax(votes)  # the first of equal maxima


def log_divergence(ring: Any, digests: torch.Tensor, rank: int, step: torch.Tensor, tag: int) -> None:
    """Append a rank_divergence row to `ring` when this rank's digest is not the reference's (a
    masked write: device work, fixed shapes). The row: slot and position -1, row the reference
    rank, stored this rank's digest, expected the reference's, at forward `step` ([1] int64)."""
    ref = reference_rank(digests)
    mine, expected = digests[rank], digests.gather(0, ref.reshape(1))[0]  # digests[ref] would read ref on the host
    diverged = (mine != expected).reshape(1)
    row = torch.zeros(1, ROW_WIDTH, dtype=torch.int64, device=digests.device)
    row[:, COL_REASONS] = int(Reason.RANK_DIVERGENCE)
    row[:, COL_TAG] = tag
    row[:, COL_STEP] = step
    row[:, COL_SLOT] = -1
    row[:, COL_POSITION] = -1
    row[:, COL_ROW] = ref
    row[:, COL_STORED] = mine
    row[:, COL_EXPECTED] = expected
    at = ring.count % ring.capacity
    ring.rows.index_copy_(0, at, torch.where(diverged[:, None], row, ring.rows.index_select(0, at)))
    ring.count.add_(diverged.to(torch.int64))


def walk_entries(walk: CacheWalk | PagedWalk) -> dict[tuple[int, ...], int]:
    """Each entry of a cache walk, (slot, position, previous slot, token, context key), with its hash."""
    if isinstance(walk, PagedWalk):
        walk = paged_entries(walk)
    contexts = walk.context_keys if walk.context_keys is not None else torch.zeros_like(walk.slots)
    columns = [c.cpu().to(torch.int64) for c in (walk.slots, walk.positions, walk.prev_slots, walk.tokens, contexts)]
    return dict(zip(map(tuple, torch.stack(columns, 1).tolist()), _fold(*columns).tolist()))


def walk_digest(entries: dict[tuple[int, ...], int]) -> int:
    """An order-free hash of a walk's entries (a wrapping sum of their hashes)."""
    return int(torch.tensor(list(entries.values()), dtype=torch.int64).sum())


def walk_divergence(mine: dict[tuple[int, ...], int], reference: dict[tuple[int, ...], int], peer: int) -> torch.Tensor:
    """rank_divergence rows [n, ROW_WIDTH] (tag and step left to the ring) of the entries one walk
    holds and the other does not, by slot and position: row the peer rank, stored the entry's hash
    where this rank's walk holds it (else 0), expected where the reference's does (else 0)."""
    differing = sorted(mine.keys() ^ reference.keys())
    rows = torch.zeros(len(differing), ROW_WIDTH, dtype=torch.int64)
    for i, entry in enumerate(differing):
        rows[i, COL_REASONS] = int(Reason.RANK_DIVERGENCE)
        rows[i, COL_SLOT], rows[i, COL_POSITION] = entry[0], entry[1]
        rows[i, COL_ROW] = peer
        rows[i, COL_STORED] = mine.get(entry, 0)
        rows[i, COL_EXPECTED] = reference.get(entry, 0)
    return rows


class RankCheck:
    """The forward hooks of one engine (one side) on one rank: its CanaryRuntime, then the
    comparison with the other ranks. rank / world: this rank and how many there are; group: the
    process group the digests are gathered over (None: the default group; device tensors, so
    NCCL on GPUs); control: a gloo group on the host for the sweeps' walks. Every rank must make
    the same calls in the same order (the engine's forwards and sweeps are in step)."""

    def __init__(self, runtime: CanaryRuntime, rank: int, world: int, control: Any, group: Any = None) -> None:
        self.runtime = runtime
        self.rank, self.world = rank, world
        self.group, self.control = group, control
        self._digests = torch.zeros(world, dtype=torch.int64, device=runtime.device)

    def before_forward(self, view: ForwardView) -> None:
        self.runtime.before_forward(view)

    def kv_stored(self, kind: GroupKind, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        self.runtime.kv_stored(kind, layer, k, v)

    def after_forward(self, view: ForwardView) -> None:
        """TAIL, then this forward's digests compared (the ring's step has moved on: the row
        names the forward just run)."""
        runtime = self.runtime
        runtime.after_forward(view)
        dist.all_gather_into_tensor(self._digests, stamp_digest(view, runtime.groups), group=self.group)
        log_divergence(runtime.ring, self._digests, self.rank, runtime.ring.step - 1, TAIL_TAG)

    def end_forward(self, device_work: Callable[[], ContextManager[None]] = nullcontext) -> None:
        sweeps = self.runtime.sweeps
        self.runtime.end_forward(device_work)
        if self.runtime.sweeps != sweeps:
            self.compare_walks()

    def compare_walks(self) -> None:
        """After a sweep: gather every rank's walk digest; where this rank's is not the
        reference's, log the slots its walk holds otherwise than the reference rank's."""
        walk = self.runtime.host.cache_walk()
        mine = {} if walk is None else walk_entries(walk)
        digests = [None] * self.world
        dist.all_gather_object(digests, walk_digest(mine), group=self.control)
        if len(set(digests)) == 1:
            return
        ref = int(reference_rank(torch.tensor(digests, dtype=torch.int64)))
        shared = [mine if self.rank == ref else None]
        dist.broadcast_object_list(shared, src=ref, group=self.control)
        if digests[self.rank] != digests[ref]:
            self.runtime.ring.append(walk_divergence(mine, shared[0], ref), SWEEP_TAG)
