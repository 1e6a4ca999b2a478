"""HEAD and SWEEP of a SCALES group: the dequantization scales a forward uses (or a pool holds)
against each layer's guarded scales, bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import records as R
from .launch import cdiv, check_scales, next_power_of_2, ring_args
from .ring import ViolationRing
from .violation_log import append_violations, count_launch, count_slots

_VERIFY_SCALE = tl.constexpr(int(R.Reason.VERIFY_SCALE))
MAX_BLOCK = 1024


@triton.jit
def _unsigned32(bits):
    """int32 bit patterns as the int64 of their unsigned value."""
    wide = bits.to(tl.int64)
    return tl.where(wide < 0, wide + 4294967296, wide)


@triton.jit
def _verify_scales_kernel(scales, guarded, n, width, layers, ring, tag, BLOCK: tl.constexpr):
    count_launch(ring, tag)
    if tl.program_id(0) == 0:
        count_slots(ring, tag, layers)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = offs < n
    found = _unsigned32(tl.load(scales + offs, mask=on, other=0))
    want = _unsigned32(tl.load(guarded + offs, mask=on, other=0))
    fail = on & (found != want)
    reasons = tl.where(fail, _VERIFY_SCALE, 0).to(tl.int64)
    append_violations(ring, tag, fail, reasons, offs // width, offs % width, -1, found, want)


def verify_scales(scales: torch.Tensor, guarded: torch.Tensor, ring: ViolationRing, tag: int) -> None:
    """One ring row per scale (layer i, head h) whose float32 bits in ``scales`` differ from
    ``guarded``'s (both ``[num_layers, W]``): reason verify_scale, slot i, position h, row -1,
    stored / expected the two scales' bits (unsigned). Counts the launch in kernel_runs[tag] and
    the layers in slot_runs[tag]. Graph-safe; the grid depends on the shape only."""
    check_scales(scales, guarded, ring, tag)
    n, width = scales.numel(), scales.shape[1]
    block = min(MAX_BLOCK, next_power_of_2(n))
    _verify_scales_kernel[(max(1, cdiv(n, block)),)](scales.view(torch.int32), guarded.view(torch.int32), n, width,
                                                      scales.shape[0], ring_args(ring), tag, BLOCK=block)
