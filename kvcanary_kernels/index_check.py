"""SELECT: the tokens a sparse attention layer's indexer selected for each query token, checked
against the query's own row before the attention reads them (``reference.verify_selected_ref``
is its torch twin)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import records as R
from .inputs import ForwardView, SlotMapping
from .launch import batch_lanes, check_selected, mapping_args, next_power_of_2, ring_args
from .lookup import map_slot
from .ring import ViolationRing
from .violation_log import append_violations, count_launch, count_slots

_VERIFY_INDEX = tl.constexpr(int(R.Reason.VERIFY_INDEX))
BLOCK = 256


@triton.jit
def _verify_selected_kernel(mapping, sel_positions, sel_slots, rows_ptr, prefix_ptr, extend_ptr, n_batch, n_tokens,
                            topk, ring, tag, MAP: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr):
    """Program b checks batch row b's entries: its tokens' topk selections, BLOCK at a time."""
    count_launch(ring, tag)
    b = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    extends = tl.load(extend_ptr + lanes, mask=lanes < n_batch, other=0)
    start = tl.sum(tl.where(lanes < b, tl.maximum(extends, 0), 0))
    in_batch = b < n_batch
    row = tl.load(rows_ptr + b, mask=in_batch, other=0)
    prefix = tl.load(prefix_ptr + b, mask=in_batch, other=0)
    extend = tl.minimum(tl.maximum(tl.load(extend_ptr + b, mask=in_batch, other=0), 0),
                        tl.maximum(n_tokens - start, 0))
    total = extend * topk
    for first in range(0, total, BLOCK):
        e = first + tl.arange(0, BLOCK).to(tl.int64)
        on = e < total
        t = start + e // topk
        position = tl.load(sel_positions + t * topk + e % topk, mask=on, other=-1)
        slot = tl.load(sel_slots + t * topk + e % topk, mask=on, other=0)
        used = on & (position != -1)
        query = prefix + e // topk
        visible = used & (position >= 0) & (position <= query)
        expected = map_slot(mapping, MAP, row, position, visible)
        fail = used & (~visible | (slot != expected))
        count_slots(ring, tag, tl.sum(used.to(tl.int64)))
        reasons = tl.where(fail, _VERIFY_INDEX, 0).to(tl.int64)
        append_violations(ring, tag, fail, reasons, slot, position, row, slot, expected)


def verify_selected(records: torch.Tensor, mapping: SlotMapping, view: ForwardView, ring: ViolationRing,
                    tag: int) -> None:
    """One ring row per used entry of ``view.selected`` (position != -1) of view token t in batch
    row b whose position q is outside ``[0, prefix_lens[b] + j]`` (t the row's j-th token) or whose
    slot s is not ``mapping(rows[b], q)``: reason verify_index, slot s, position q, row rows[b],
    stored s, expected the mapping's slot (0 outside the query's positions). records: the INDEXER
    group's (their device and slot count bound the mapping). Counts the launch in kernel_runs[tag]
    and the used entries in slot_runs[tag]. Graph-safe: the grid is the view's batch size."""
    check_selected(records, mapping, view, ring, tag)
    positions, slots = view.selected
    topk = positions.shape[1]
    map_args, consts = mapping_args(mapping, records)
    _verify_selected_kernel[(max(1, view.rows.shape[0]),)](
        map_args, positions, slots, view.rows, view.prefix_lens, view.extend_lens, view.rows.shape[0],
        positions.shape[0], topk, ring_args(ring), tag, MAP=consts, LANES=batch_lanes(view),
        BLOCK=min(BLOCK, next_power_of_2(max(topk, 1) * 8)))
