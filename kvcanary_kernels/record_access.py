"""Device-side access to canary records ``[num_slots, RECORD_WIDTH]`` int64 (contiguous)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import records as R
from .hashing import as_u64, link

WIDTH = tl.constexpr(R.RECORD_WIDTH)
TOKEN = tl.constexpr(R.FIELD_TOKEN)
POSITION = tl.constexpr(R.FIELD_POSITION)
PREV_HASH = tl.constexpr(R.FIELD_PREV_HASH)
REAL_KV_HASH = tl.constexpr(R.FIELD_REAL_KV_HASH)


@triton.jit
def field_ptrs(records, slots, FIELD: tl.constexpr):
    return records + slots * WIDTH + FIELD


@triton.jit
def successor_hash(records, slots, mask):
    """uint64 ``link(prev_hash, token, position)`` of the records at ``slots``: the prev_hash their
    successors must hold. Lanes off ``mask`` are not read (their value is meaningless)."""
    prev_hash = tl.load(field_ptrs(records, slots, PREV_HASH), mask=mask, other=0)
    token = tl.load(field_ptrs(records, slots, TOKEN), mask=mask, other=0)
    position = tl.load(field_ptrs(records, slots, POSITION), mask=mask, other=0)
    return link(as_u64(prev_hash), as_u64(token), as_u64(position))
