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
from .seam_data import CheckpointWalk, ForwardView

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
        # The checkpoints a sweep checks, a fixed buffer per VerifyEntries field (slot 0: padding),
        # refilled only when the engine's walk changed, so the sweep's launch can be replayed.
        self._sweep = VerifyEntries(*torch.zeros(len(VerifyEntries._fields), group.pool.num_slots, dtype=torch.int64,
                                                 device=self.records.device))
        self._planned: CheckpointWalk | None = None
        self.seal()

    @property
    def records(self) -> torch.Tensor:
        return self.state.records

    def per_forward_tags(self) -> list[int]:
        """The launches each forward makes: one HEAD, one TAIL."""
        return [self.tags[Phase.HEAD], self.tags[Phase.TAIL]]

    def seal(self) -> None:
        """Slot 0's record: the empty prefix's, with the fingerprint of the bytes slot 0 holds now
        (the initial state)."""
        self.group.seal_reserved_slot()
        record = self.records[0]
        record[FIELD_TOKEN], record[FIELD_POSITION] = UNKNOWN, 0
        record[FIELD_PREV_HASH] = to_signed(head_hash_int(0))

    def verify(self, view: ForwardView, ring) -> None:
        """HEAD: each row's state slot holds the state of the row's prefix (prefix_len tokens)."""
        full = self.full
        self._launch(self.records, self.state.sources, full.halves[HALF].records, full.mapping, view.rows,
                     view.state.slots, view.prefix_lens, ring, self.tags[Phase.HEAD], stamp=False)

    def stamp(self, view: ForwardView, ring) -> None:
        """TAIL, after the FULL group's: each row's state slot now summarizes prefix_len +
        extend_len tokens, each checkpoint slot its checkpoint_len (one launch)."""
        s, full = view.state, self.full
        self._launch(self.records, self.state.sources, full.halves[HALF].records, full.mapping, view.rows, s.slots,
                     view.prefix_lens, ring, self.tags[Phase.TAIL], stamp=True, extend=view.extend_lens,
                     more=(s.checkpoint_slots, s.checkpoint_lens))

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

    def plan_sweep(self, walk: CheckpointWalk | None) -> None:
        """The checkpoints the next sweep checks: the walk's (None: none), copied to the device
        unless it is the walk planned last (an engine returns the same walk while its cache is
        unchanged)."""
        if walk is self._planned and walk is not None:
            return
        self._planned = walk
        n = 0 if walk is None else walk.slots.numel()
        if n > self.group.pool.num_slots:
            raise ValueError(f"checkpoint_walk() lists {n} checkpoints; the state pool has {self.group.pool.num_slots} "
                             "slots")
        plan = torch.zeros_like(self._sweep.slots, device="cpu").repeat(len(VerifyEntries._fields), 1)
        if n:
            plan[:, :n] = torch.stack([walk.slots, walk.lengths, walk.prev_slots, torch.full_like(walk.slots, UNKNOWN),
                                       torch.full_like(walk.slots, -1), walk.context_keys]).to(torch.int64)
        for buffer, column in zip(self._sweep, plan):
            buffer.copy_(column)

    def sweep(self, ring) -> None:
        """SWEEP: each checkpoint planned (plan_sweep) summarizes its path up to its length. Device
        work only: it may be captured and replayed."""
        self._verify(self.records, self._sweep, self.state.sources, ring, self.tags[Phase.SWEEP], check_tokens=False,
                     prev_records=self.full.halves[HALF].records)

    def clear(self) -> None:
        self.group.clear()
        self._restores.zero_()
        self.plan_sweep(None)
        self.seal()
