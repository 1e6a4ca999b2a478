"""transformers' continuous batching split over the ranks of a parallel engine (tensor parallel
only: transformers' continuous batching has no pipeline stages).

Each rank loads the checkpoint with the model's own tensor-parallel plan (transformers'
DistributedConfig over the rank processes' default group): `num_attention_heads / tp` query heads,
`num_key_value_heads / tp` KV heads and `intermediate_size / tp` of each MLP per rank, o_proj and
down_proj summed over the ranks; the paged cache holds the rank's KV heads. Every rank drives its
own processor with the same requests: transformers' `prepare_next_batch` broadcasts what rank 0's
manager queued (requests added on the other ranks are dropped by transformers), so the ranks
schedule, allocate and forward in step.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...reference_engine.parallel.groups import RankGroups
from ...reference_engine.parallel.topology import Topology
from .engine import TransformersEngine
from .model import load


@dataclass(frozen=True)
class TensorParallelShards:
    """The checkpoint directory `path` run by TransformersEngine on each rank of a tensor-parallel
    engine (handles.rank's ShardFactory; no prefill/decode pairs). options: TransformersEngine's
    keyword arguments."""

    path: str
    options: tuple[tuple[str, Any], ...] = ()
    pairs: bool = False

    def check(self, topology: Topology) -> None:
        """ValueError for pipeline stages, without the accelerate package (transformers loads no
        tensor-parallel model without it), and unless tp divides the heads, the KV heads and the
        MLP width (transformers would refuse the KV heads, or shard the rest unevenly)."""
        if topology.pp != 1:
            raise ValueError(f"engine 'transformers' runs tensor parallel only (its continuous batching has no "
                             f"pipeline parallel): pp must be 1; got {topology.pp}")
        if importlib.util.find_spec("accelerate") is None:
            raise ValueError("transformers loads a tensor-parallel model only with the accelerate package, which is "
                             "not installed (the project's [transformers] extra installs it)")
        config = json.loads((Path(self.path) / "config.json").read_text())
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        shared = {"num_attention_heads": heads, "num_key_value_heads": config.get("num_key_value_heads", heads),
                  "intermediate_size": config["intermediate_size"]}
        for name, value in shared.items():
            if value % topology.tp:
                raise ValueError(f"tp={topology.tp} must divide the model's {name} ({value})")

    def build(self, groups: RankGroups, device: str) -> TransformersEngine:
        # transformers places a tensor-parallel rank on the accelerator LOCAL_RANK names
        os.environ["LOCAL_RANK"] = str(_index(device))
        model, tokenizer = load(self.path, device, tensor_parallel=groups.topology.tp)
        return TransformersEngine(model, tokenizer, **dict(self.options))


def _index(device: str) -> int:
    import torch

    index = torch.device(device).index
    return 0 if index is None else index
