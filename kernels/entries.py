"""The per-launch inputs of the stamp and verify kernels: flat int64 device tensors.

Entries whose slot is 0 are skipped (slot 0 is reserved), so a caller may pad plans to a fixed
capacity and capture the launch in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class WriteEntries(NamedTuple):
    """TAIL: records to stamp for this forward's newly written slots, grouped in row segments.

    Per entry (length N): the slot written, the token and position the engine wrote there, the
    position and token the engine's bookkeeping expects (UNKNOWN = -1 to skip the token check) and
    the request row. Per segment (length R; one per request row, entries contiguous and in
    position order): first entry index, entry count, and the slot whose record seeds the chain
    (PREV_CHAIN_HEAD = -1 when the segment starts at position 0).
    """

    slots: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    expected_positions: torch.Tensor
    expected_tokens: torch.Tensor
    rows: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seed_slots: torch.Tensor


class VerifyEntries(NamedTuple):
    """HEAD / SWEEP: slots to check (length M).

    prev_slots: the slot holding the previous position (its record gives the expected prev_hash),
    PREV_CHAIN_HEAD = -1 for position 0, PREV_SKIP = -2 to skip the chain check.
    tokens: the expected token, or UNKNOWN = -1. rows: request row, or -1 (sweep).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    prev_slots: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
