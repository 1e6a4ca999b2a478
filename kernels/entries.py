"""The per-launch inputs of the kernels: int64 device tensors, never read on the host.

``MappingArgs`` and ``ViewArgs`` describe a forward the way the engine holds it (its mapping table
and its batch); the view kernels walk the positions themselves. ``VerifyEntries`` is an explicit
list of slots, for the sweep over what a prefix cache holds. Entries whose slot is 0 are skipped
(slot 0 is reserved), so a caller may pad them to a fixed length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MappingArgs(NamedTuple):
    """Where (row, position) finds its slot.

    ``lp = pos % ring if ring else pos``;
    ``slot = table[row, lp // page_size] * page_size + lp % page_size``; then
    ``slot = full_to_group[slot]`` when full_to_group is given. page_size 1: a per-token table
    (req_to_token); > 1: a block table of block ids. A table column or full_to_group index out of
    range reads as slot 0 (not resident).
    """

    table: torch.Tensor  # [rows, cols] int32 or int64
    page_size: int  # >= 1
    ring: int  # >= 0
    full_to_group: torch.Tensor | None  # int64 [n_full_slots]


class ViewArgs(NamedTuple):
    """One forward's batch (length B) and tokens (length T), in batch order.

    Batch row b reads positions [0, prefix_lens[b]) (a window of them, for SWA) and writes
    [prefix_lens[b], prefix_lens[b] + extend_lens[b]) from tokens
    [start_b, start_b + extend_lens[b]), start_b = sum(extend_lens[:b]); tokens past
    sum(extend_lens) are padding. A padded batch row has prefix 0 and extend 0 (its ``rows``
    value must still index the table). token_table[row, pos]: the token the engine believes the
    position holds, -1 unknown. context_keys[b]: the request's context key (0 = none), which
    seeds its chain at position 0.
    """

    rows: torch.Tensor  # [B] mapping row of each batch row
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] as the engine computed them
    token_table: torch.Tensor | None  # [rows, max_context]
    context_keys: torch.Tensor | None  # [B]


class VerifyEntries(NamedTuple):
    """SWEEP: slots to check (length M).

    prev_slots: the slot holding the previous position (its record gives the expected prev_hash),
    PREV_CHAIN_HEAD = -1 for position 0, PREV_SKIP = -2 to skip the chain check.
    tokens: the expected token, or UNKNOWN = -1. rows: request row, or -1 (sweep).
    context_keys: the context key that seeds a chain head's expected prev_hash (0 = none).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    prev_slots: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    context_keys: torch.Tensor
