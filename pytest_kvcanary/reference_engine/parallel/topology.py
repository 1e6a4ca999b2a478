"""Where each rank of a parallel reference engine sits, and which part of the model it holds.

Global rank r is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``. A stage holds the
layers ``[stage * L / pp, (stage + 1) * L / pp)``; a tensor-parallel rank holds heads
``[t * H / tp, (t + 1) * H / tp)`` of every attention (KV heads likewise; a latent row is
replicated) and the same share of every MLP's intermediate width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvcanary_kernels.checks import check_int

from ..config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class Topology:
    """tp tensor-parallel ranks per stage, pp pipeline stages: tp * pp ranks in all."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        check_int("tp", self.tp, 1)
        check_int("pp", self.pp, 1)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def stage(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of one stage (one tensor-parallel group)."""
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def column(self, tp_rank: int) -> list[int]:
        """The ranks holding tensor-parallel shard tp_rank, stage by stage (one pipeline)."""
        return [s * self.tp + tp_rank for s in range(self.pp)]

    def first_layer(self, rank: int, num_layers: int) -> int:
        return self.stage(rank) * num_layers // self.pp

    def check(self, config: EngineConfig) -> None:
        """ValueError unless the engine splits this way: whole heads (KV heads) and equal MLP
        shares per rank, equal whole layers per stage (on swa, a whole number of full_every
        periods, so each stage keeps the layer pattern), no speculative decoding, CUDA graphs
        only without pipeline stages."""
        m, tp, pp = config.model, self.tp, self.pp
        if m.attention == "hybrid" and self.world > 1:
            raise ValueError(f"attention 'hybrid' runs on one rank (its state pool is not sharded); got tp={tp}, pp={pp}")
        if m.attention == "sparse" and self.world > 1:
            raise ValueError(f"attention 'sparse' runs on one rank (its indexer keys are not sharded); got tp={tp}, "
                             f"pp={pp}")
        shared = [("num_heads", m.num_heads), ("intermediate", m.intermediate)]
        if m.attention != "mla":  # a latent row is replicated on every rank
            shared.append(("num_kv_heads", m.num_kv_heads))
        for name, value in shared:
            if value % tp:
                raise ValueError(f"tp={tp} must divide model.{name} ({value}): each rank holds an equal share")
        if m.num_layers % pp:
            raise ValueError(f"pp={pp} must divide model.num_layers ({m.num_layers}): each stage holds equal layers")
        if m.attention == "swa" and (m.num_layers // pp) % m.full_every:
            raise ValueError(f"pp={pp} must leave each stage a multiple of model.full_every ({m.full_every}) layers on "
                             f"swa; got {m.num_layers // pp} layers per stage")
        if self.world > 1 and config.speculative_k:
            raise ValueError(f"speculative_k must be 0 on a parallel engine (tp={tp}, pp={pp}); "
                             f"got {config.speculative_k}")
        if pp > 1 and config.decode_mode == "graph":
            raise ValueError(f"decode_mode='graph' needs pp=1 (a stage's sends are not captured); got pp={pp}")

    def shard_config(self, model: ModelConfig) -> ModelConfig:
        """The model one rank holds: its heads, its MLP share and its stage's layers."""
        return replace(model, num_heads=model.num_heads // self.tp,
                       num_kv_heads=1 if model.attention == "mla" else model.num_kv_heads // self.tp,
                       intermediate=model.intermediate // self.tp, num_layers=model.num_layers // self.pp)
