"""One rank's shard of the reference model, and the engine that runs it.

Tensor parallel (Megatron-style): q/k/v (MLA: q and kv_b), gate and up projections are split by
output rows, head by head; o_proj and down_proj by input columns, and their outputs are summed over
the stage's ranks (an all-reduce), so every rank holds the layer's full output. Embeddings, norms,
the LM head and MLA's latent projection are replicated. Pipeline parallel: a stage runs its own
layers on the hidden states the previous stage sent it, sends its own to the next, and the last
stage's final hidden states are broadcast down the column, so every rank samples the same tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from ..attention import KVAccess
from ..config import EngineConfig
from ..engine import Engine
from ..model import CausalLM, StateAccess
from ..weights import load_weights
from .groups import RankGroups
from .topology import Topology

# Sharded by output rows (dim 0) and by input columns (dim 1), head-major: a chunk is whole heads.
ROW_SHARDED = ("q_proj", "k_proj", "v_proj", "kv_b_proj", "gate_proj", "up_proj")
COLUMN_SHARDED = ("o_proj", "down_proj")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def shard_state(full: dict[str, torch.Tensor], local: dict[str, torch.Tensor], groups: RankGroups,
                num_layers: int) -> dict[str, torch.Tensor]:
    """The tensors of `local`'s names (a shard's state dict) cut from a full model's state dict."""
    topology, rank = groups.topology, groups.rank
    first, t = topology.first_layer(rank, num_layers), topology.tp_rank(rank)
    out = {}
    for name, like in local.items():
        layer = _LAYER.fullmatch(name)
        tensor = full[f"model.layers.{first + int(layer[1])}.{layer[2]}" if layer else name]
        module = name.split(".")[-2]
        if module in ROW_SHARDED:
            tensor = tensor.chunk(topology.tp, 0)[t]
        elif module in COLUMN_SHARDED:
            tensor = tensor.chunk(topology.tp, 1)[t]
        assert tensor.shape == like.shape, f"{name}: shard {tuple(tensor.shape)} != {tuple(like.shape)}"
        out[name] = tensor
    return out


class ShardedCausalLM(CausalLM):
    """A CausalLM of one rank's heads and layers (`Topology.shard_config`) whose forward talks to
    the other ranks: the same interface, so the engine and its decode graphs run it unchanged."""

    def __init__(self, full: CausalLM, groups: RankGroups) -> None:
        super().__init__(groups.topology.shard_config(full.cfg))
        self.load_state_dict(shard_state(full.state_dict(), self.state_dict(), groups, full.cfg.num_layers))
        self.groups = groups
        if groups.tensor is not None:
            for layer in self.model.layers:
                layer.self_attn.o_proj.register_forward_hook(self._sum_over_stage)
                layer.mlp.down_proj.register_forward_hook(self._sum_over_stage)

    def _sum_over_stage(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=self.groups.tensor)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess,
                context_keys: torch.Tensor | None = None, states: StateAccess | None = None) -> torch.Tensor:
        """CausalLM.forward on this rank's shard. states: unused (a model with recurrent layers
        runs on one rank: Topology.check refuses to split it)."""
        g, decoder = self.groups, self.model
        if g.first_stage:
            x = decoder.embed(input_ids, context_keys)
        else:
            x = torch.empty(input_ids.shape[0], self.cfg.hidden, dtype=self.cfg.dtype, device=input_ids.device)
            dist.recv(x, src=g.neighbour(-1))
        x = decoder.run_layers(x, positions, kv)
        if g.column is not None:
            if not g.last_stage:
                dist.send(x, dst=g.neighbour(1))
            dist.broadcast(x, src=g.last_in_column(), group=g.column)
        return decoder.norm(x)


def shard_engine(config: EngineConfig, groups: RankGroups, device: str) -> Engine:
    """The engine of one rank: config's model cut to the rank's shard (`Topology.check` first),
    its pools sized for the shard, on `device`."""
    groups.topology.check(config)
    full = CausalLM(config.model)
    if config.checkpoint is not None:
        load_weights(full, config.checkpoint)
    model = ShardedCausalLM(full, groups)
    return Engine(replace(config, model=model.cfg, checkpoint=None, device=device), model=model)


@dataclass(frozen=True)
class ReferenceShards:
    """The reference engine of `config` split over a parallel engine's ranks (handles.rank's
    ShardFactory): each rank builds its shard_engine; pairs of them make prefill/decode pairs."""

    config: EngineConfig
    pairs: bool = True

    def check(self, topology: Topology) -> None:
        topology.check(self.config)

    def build(self, groups: RankGroups, device: str) -> Engine:
        return shard_engine(self.config, groups, device)
