"""The canary of a hybrid model's recurrent state (the STATE group): one record per state slot, a
running request's or a cached checkpoint's, saying which prefix the state summarizes.

A state slot's record reads as the record a KV slot at the state's length would chain from: token
= the prefix's last token, position = the prefix's length (0 for the initial state), prev_hash =
the chain hash through its last token (the successor hash of the FULL group's record of that
token; a chain head's hash for the empty prefix), real_kv_hash = the fingerprint of the state's
bytes. So HEAD checks a state a row will read against the row's own prefix, through the FULL
records the row's KV carries: a state of another prefix fails the chain, of another length the
position, and bytes changed since the stamp the fingerprint. Reserved slot 0 holds the initial
(all-zero) state: its record is the empty prefix's, and a slot cleared for a new request copies it.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvcanary_kernels import VerifyEntries
from kvcanary_kernels.hashing import head_hash_int, to_signed
from kvcanary_kernels.records import FIELD_POSITION, FIELD_PREV_HASH, FIELD_TOKEN, UNKNOWN, GroupKind, Half, Phase, launch_tag

from .groups import GroupState
from .host import CheckpointWalk, ForwardView

HALF = Half.K  # a STATE group has one half


class StateGuard:
    """Stamps, verifies and moves the STATE group's records. full: the FULL group, whose K records
    hold each token's chain and whose mapping finds them; launch: the runtime's `state_launch`
    (HEAD and TAIL of a view's rows); verify: its `verify_records` (the sweep's checkpoints)."""

    def __init__(self, group: GroupState, full: GroupState, launch: Callable, verify: Callable) -> None:
        assert group.pool.kind is GroupKind.STATE and list(group.halves) == [HALF]
        self.group, self.full = group, full
        self._launch, self._verify = launch, verify
        self.state = group.halves[HALF]
        self.tags = {phase: launch_tag(phase, HALF, GroupKind.STATE) for phase in (Phase.HEAD, Phase.TAIL, Phase.SWEEP)}
        self._restores = torch.zeros((), dtype=torch.int64, device=self.records.device)
        self.seal()

    @property
    def records(self) -> torch.Tensor:
        return self.state.records

    def per_forward_tags(self) -> list[int]:
        """The launches each forward makes: one HEAD, two TAILs (running states, checkpoints)."""
        return [self.tags[Phase.HEAD], self.tags[Phase.TAIL], self.tags[Phase.TAIL]]

    def seal(self) -> None:
        """Slot 0's record: the empty prefix's, with the fingerprint of the bytes slot 0 holds now
        (the initial state)."""
        self.group.seal_reserved_slot()
        record = self.records[0]
        record[FIELD_TOKEN], record[FIELD_POSITION] = UNKNOWN, 0
        record[FIELD_PREV_HASH] = to_signed(head_hash_int(0))

    def _run(self, view: ForwardView, ring, phase: Phase, slots: torch.Tensor, lengths: torch.Tensor,
             extend: torch.Tensor | None = None) -> None:
        full = self.full
        self._launch(self.records, self.state.sources, full.halves[HALF].records, full.mapping, view.rows, slots,
                     lengths, ring, self.tags[phase], stamp=phase is Phase.TAIL, extend=extend)

    def verify(self, view: ForwardView, ring) -> None:
        """HEAD: each row's state slot holds the state of the row's prefix (prefix_len tokens)."""
        self._run(view, ring, Phase.HEAD, view.state.slots, view.prefix_lens)

    def stamp(self, view: ForwardView, ring) -> None:
        """TAIL, after the FULL group's: each row's state slot now summarizes prefix_len +
        extend_len tokens, each checkpoint slot its checkpoint_len."""
        s = view.state
        self._run(view, ring, Phase.TAIL, s.slots, view.prefix_lens, view.extend_lens)
        self._run(view, ring, Phase.TAIL, s.checkpoint_slots, s.checkpoint_lens)

    def copied(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The states of ``src`` were copied to ``dst``: so were their records. Copies from a slot
        other than 0 (restores of a checkpoint, saves) are counted on the device."""
        src, dst = src.to(self.records.device, torch.int64), dst.to(self.records.device, torch.int64)
        self.records[dst] = self.records[src]
        self._restores += (src != 0).sum()

    def restores(self) -> int:
        """States copied from a slot other than 0 since the last clear (syncs): the liveness count
        of checkpoint reuse."""
        return int(self._restores)

    def export_records(self, slots: torch.Tensor) -> torch.Tensor:
        """The records of these state slots, ``[n, RECORD_WIDTH]`` (what a transfer sends with the
        states)."""
        return self.records[slots.to(self.records.device, torch.int64)]

    def import_records(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Write exported records (any device) to these state slots, before the forward that reads them."""
        self.records[slots.to(self.records.device, torch.int64)] = records.to(self.records.device)

    def sweep(self, walk: CheckpointWalk, ring) -> None:
        """SWEEP: each checkpoint the cache holds summarizes its path up to its length."""
        device = self.records.device
        entries = VerifyEntries(*(t.to(device, torch.int64) for t in (
            walk.slots, walk.lengths, walk.prev_slots, torch.full_like(walk.slots, UNKNOWN),
            torch.full_like(walk.slots, -1), walk.context_keys)))
        self._verify(self.records, entries, self.state.sources, ring, self.tags[Phase.SWEEP], check_tokens=False,
                     prev_records=self.full.halves[HALF].records)

    def clear(self) -> None:
        self.group.clear()
        self._restores.zero_()
        self.seal()
