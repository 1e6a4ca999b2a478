"""PDHandle: a prefill/decode pair of reference engines, each side guarded by its own canary.

The KV transfer carries the canary records of the transferred slots (every group, both halves) to
the decode side, so its first decode forward's HEAD re-verifies the whole transferred prefix, and
tells the fault ledger where damaged data went.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .config import CanaryConfig
from .engine import Engine, PDPair
from .harness import Side, _Handle
from .perturb.ledger import Place


class PDHandle(_Handle):
    """Sides "prefill" and "decode" share the handle's ledger; kernels as for EngineHandle."""

    def __init__(self, prefill_engine: Engine, decode_engine: Engine, canary: CanaryConfig,
                 kernels: str = "triton") -> None:
        for engine in (prefill_engine, decode_engine):
            if not isinstance(engine, Engine):
                raise TypeError(f"a prefill/decode pair runs reference engines; got {type(engine).__name__}")
        super().__init__()
        self.prefill = Side("prefill", prefill_engine, canary, self.ledger, kernels)
        self.decode = Side("decode", decode_engine, canary, self.ledger, kernels)
        self.sides = [self.prefill, self.decode]
        self.pair = PDPair(prefill_engine, decode_engine)
        self.pair.transfer_listeners.append(self._on_transfer)

    def _generate(self, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
        return self.pair.generate(prompts, max_new_tokens)

    def _on_transfer(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Send the records along with the KV (prefill FULL slots src -> decode FULL slots dst),
        and tell the ledger where each group's data went."""
        sender, receiver = self.prefill.runtime, self.decode.runtime
        receiver.import_records(dst, sender.export_records(src))
        for src_group, dst_group in zip(sender.groups, receiver.groups, strict=True):
            src_slots = src_group.to_group_slots(src.to(src_group.device)).tolist()
            dst_slots = dst_group.to_group_slots(dst.to(dst_group.device)).tolist()
            group = src_group.pool.kind.name.lower()
            for full_src, full_dst, s, d in zip(src.tolist(), dst.tolist(), src_slots, dst_slots):
                if s and d:
                    self.ledger.moved(self.prefill.name, group, full_src, Place(self.decode.name, d, full_dst))
