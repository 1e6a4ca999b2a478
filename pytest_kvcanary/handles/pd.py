"""PDHandle: a prefill/decode pair of engines, each side guarded by its own canary.

It drives any PrefillDecodePair (canary/seam.py). Each transfer carries the canary records
of the transferred slots (every group, both halves) to the decode side, so its first decode
forward's HEAD re-verifies the whole transferred prefix, and tells the fault ledger where
damaged data went.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
from kvcanary_kernels.records import GroupKind

from ..canary.seam import PrefillDecodePair
from ..config import CanaryConfig
from ..perturb.ledger import Ledger, Place
from .sided import Side, SidedHandle

if TYPE_CHECKING:
    from ..canary.groups import GroupState


class PDHandle(SidedHandle):
    """Sides "prefill" and "decode" share the handle's ledger."""

    def __init__(self, pair: PrefillDecodePair, canary: CanaryConfig) -> None:
        if not isinstance(pair, PrefillDecodePair):
            raise TypeError(f"kv_pd drives a PrefillDecodePair (prefill, decode, generate, add_transfer_listener); "
                            f"got {type(pair).__name__}")
        super().__init__()
        self.pair = pair
        self.prefill = Side("prefill", pair.prefill, canary, self.ledger)
        self.decode = Side("decode", pair.decode, canary, self.ledger)
        self.sides = [self.prefill, self.decode]
        pair.add_transfer_listener(self._on_transfer)
        add_state_listener = getattr(pair, "add_state_transfer_listener", None)
        if add_state_listener is not None and self.prefill.runtime.state is not None:
            add_state_listener(self._on_state_transfer)

    def _engine_generate(self) -> Callable[..., list[list[int]]]:
        return self.pair.generate

    def _on_state_transfer(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Send the states' records along with the states (prefill state slots src -> decode state
        slots dst), and tell the ledger where damage in them went."""
        sender, receiver = self.prefill.runtime.state, self.decode.runtime.state
        receiver.import_records(dst, sender.export_records(src))
        for s, d in zip(src.tolist(), dst.tolist()):
            self.ledger.moved(self.prefill.name, GroupKind.STATE, s, Place(self.decode.name, d, d))

    def _on_transfer(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Send the records along with the KV (prefill FULL slots src -> decode FULL slots dst),
        and tell the ledger where each group's data went."""
        sender, receiver = self.prefill.runtime, self.decode.runtime
        receiver.import_records(dst, sender.export_records(src))
        note_moves(self.ledger, sender.groups, src.tolist(), dst.tolist(),
                   [group.to_group_slots(dst.to(group.device)).tolist() for group in receiver.groups])


def note_moves(ledger: Ledger, sender_groups: Sequence[GroupState], src: list[int], dst: list[int],
               receiver_slots: list[list[int]]) -> None:
    """Tell the ledger where a transfer took each pool group's data: prefill FULL slots src went
    to decode FULL slots dst, which are receiver_slots[g] in the decode side's group g (0 where a
    slot is not resident in the group on either side)."""
    for group, dst_slots in zip(sender_groups, receiver_slots, strict=True):
        src_slots = group.to_group_slots(torch.tensor(src, dtype=torch.int64, device=group.device)).tolist()
        for full_src, full_dst, s, d in zip(src, dst, src_slots, dst_slots):
            if s and d:
                ledger.moved("prefill", group.pool.kind, full_src, Place("decode", d, full_dst))
