"""Kernel entries from a forward: what HEAD verifies, what TAIL stamps, what SWEEP re-checks.

Index arithmetic runs on the host over the ForwardView's small CPU tensors; slot lookups gather
from req_to_token and the FULL->group map on the records' device.
"""

from __future__ import annotations

import torch

from kvcanary_kernels import VerifyEntries, WriteEntries
from kvcanary_kernels.records import PREV_CHAIN_HEAD, PREV_SKIP, UNKNOWN

from .groups import GroupState
from .host import ForwardView, RadixWalk


def _ragged(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments [starts[b], starts[b] + counts[b]): (segment index, value) per element."""
    seg = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offsets = torch.arange(len(seg)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return seg, torch.repeat_interleave(starts, counts) + offsets


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device=device, dtype=torch.int64) for t in tensors]


def window_starts(view: ForwardView, window: int | None) -> torch.Tensor:
    """First prefix position a HEAD check covers per request (0 for FULL groups)."""
    if window is None:
        return torch.zeros_like(view.prefix_lens)
    return (view.prefix_lens - window).clamp(min=0)


def verify_entries(view: ForwardView, req_to_token: torch.Tensor, group: GroupState) -> VerifyEntries:
    """HEAD: every prefix position [window_start, prefix_len) of every request in the batch."""
    device = group.device
    starts = window_starts(view, group.pool.window)
    seg, pos = _ragged(starts, view.prefix_lens - starts)
    row = view.rows[seg]
    row_d, pos_d = _on(req_to_token.device, row, pos)
    full = req_to_token[row_d, pos_d]
    prev_full = req_to_token[row_d, (pos_d - 1).clamp(min=0)]
    slots = group.to_group_slots(full.to(device=device, dtype=torch.int64))
    prev = group.to_group_slots(prev_full.to(device=device, dtype=torch.int64))
    head, skip = _on(device, pos == 0, (pos == starts[seg]) & (pos > 0))
    prev = torch.where(head.bool(), PREV_CHAIN_HEAD, torch.where(skip.bool(), PREV_SKIP, prev))
    if view.prefix_token_ids is None:
        tokens = torch.full_like(pos, UNKNOWN)
    else:
        parts = [ids[int(s):] for ids, s in zip(view.prefix_token_ids, starts)]
        tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    pos_t, tokens_t, row_t = _on(device, pos, tokens, row)
    return VerifyEntries(slots=slots, positions=pos_t, prev_slots=prev, tokens=tokens_t, rows=row_t)


def write_entries(view: ForwardView, req_to_token: torch.Tensor, group: GroupState) -> WriteEntries:
    """TAIL: the slots this forward wrote, one segment per request, seeded from its last prefix slot."""
    device = group.device
    seg, expected_pos = _ragged(view.prefix_lens, view.extend_lens)
    seg_starts = torch.cumsum(view.extend_lens, 0) - view.extend_lens
    rows_d, last_d = _on(req_to_token.device, view.rows, (view.prefix_lens - 1).clamp(min=0))
    seed = group.to_group_slots(req_to_token[rows_d, last_d].to(device=device, dtype=torch.int64))
    (is_head,) = _on(device, view.prefix_lens == 0)
    seed = torch.where(is_head.bool(), PREV_CHAIN_HEAD, seed)
    slots = group.to_group_slots(view.out_cache_loc.to(device=device, dtype=torch.int64))
    tokens, positions, exp_pos, rows, starts, lens = _on(
        device, view.input_ids, view.positions, expected_pos, view.rows[seg], seg_starts, view.extend_lens
    )
    return WriteEntries(
        slots=slots,
        tokens=tokens,
        positions=positions,
        expected_positions=exp_pos,
        expected_tokens=torch.full_like(tokens, UNKNOWN),
        rows=rows,
        seg_starts=starts,
        seg_lens=lens,
        seed_slots=seed,
    )


def sweep_entries(walk: RadixWalk, group: GroupState, *, unlocked_only: bool = False) -> VerifyEntries:
    """SWEEP: what the radix cache holds, restricted to slots resident in this group."""
    device = group.device
    keep = ~walk.locked if unlocked_only else torch.ones_like(walk.locked, dtype=torch.bool)
    slots_full, pos, prev_full, tokens = _on(device, walk.slots[keep], walk.positions[keep],
                                             walk.prev_slots[keep], walk.tokens[keep])
    slots = group.to_group_slots(slots_full)
    prev = torch.where(prev_full < 0, PREV_CHAIN_HEAD, group.to_group_slots(prev_full.clamp(min=0)))
    # A predecessor that slid out of the SWA pool cannot be checked against.
    prev = torch.where((prev_full >= 0) & (prev == 0), PREV_SKIP, prev)
    # Slots no longer resident in this group map to 0, which the kernels skip.
    return VerifyEntries(slots=slots, positions=pos, prev_slots=prev, tokens=tokens, rows=torch.full_like(slots, -1))
