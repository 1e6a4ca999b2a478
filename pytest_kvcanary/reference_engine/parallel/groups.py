"""The torch.distributed process groups one rank of a parallel engine talks through.

The default group (every rank; NCCL on GPUs, gloo on a CPU) carries the forward's collectives:
activations between stages and the canary's per-forward digests. Tensor-parallel all-reduces run
in a stage's group, the final hidden states go down a pipeline column. Commands, results and the
sweeps' comparisons go over a gloo group on the host, whose timeout is long: a rank waits there
between tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .topology import Topology


@dataclass(frozen=True)
class RankGroups:
    """tensor: this stage's ranks (None when tp is 1); column: this shard's stages, first to last
    (None when pp is 1); control: every rank, gloo on the host."""

    topology: Topology
    rank: int
    tensor: Any
    column: Any
    control: Any

    @classmethod
    def create(cls, topology: Topology, rank: int, control_timeout: timedelta) -> RankGroups:
        """Every rank must call it, in the same order (torch.distributed makes groups collectively)."""
        tensor = [dist.new_group(topology.stage_ranks(s)) for s in range(topology.pp)] if topology.tp > 1 else None
        column = [dist.new_group(topology.column(t)) for t in range(topology.tp)] if topology.pp > 1 else None
        control = dist.new_group(backend="gloo", timeout=control_timeout)
        return cls(topology, rank,
                   None if tensor is None else tensor[topology.stage(rank)],
                   None if column is None else column[topology.tp_rank(rank)], control)

    @property
    def stage(self) -> int:
        return self.topology.stage(self.rank)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.topology.pp - 1

    def neighbour(self, step: int) -> int:
        """The rank of this shard `step` stages later (earlier when negative)."""
        return self.rank + step * self.topology.tp

    def last_in_column(self) -> int:
        """The rank of this shard on the last stage."""
        return self.topology.column(self.topology.tp_rank(self.rank))[-1]
