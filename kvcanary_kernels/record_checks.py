"""The checks HEAD, RECHECK and SWEEP run on a block of records, in one place."""

from __future__ import annotations

import triton
import triton.language as tl

from . import records as R
from .fingerprint import slot_fingerprint
from .hashing import as_i64
from .record_access import POSITION, PREV_HASH, REAL_KV_HASH, TOKEN, field_ptrs
from .violation_log import note_failure

_POSITION = tl.constexpr(int(R.Reason.VERIFY_POSITION))
_TOKEN = tl.constexpr(int(R.Reason.VERIFY_TOKEN))
_CHAIN = tl.constexpr(int(R.Reason.VERIFY_CHAIN_HASH))
_REAL_KV = tl.constexpr(int(R.Reason.VERIFY_REAL_KV_HASH))
_UNKNOWN = tl.constexpr(R.UNKNOWN)


# What a view launch does with its read-hash buffer (see check_real_kv).
READ_HASHES_OFF = tl.constexpr(0)
READ_HASHES_STORE = tl.constexpr(1)
READ_HASHES_COMPARE = tl.constexpr(2)


@triton.jit
def check_real_kv(sources, READS: tl.constexpr, slots, live, stored_ptrs, read_hashes, READ_HASHES: tl.constexpr):
    """``(bad, stored, fresh)`` per lane, from the bytes of the slots in ``live``. OFF and STORE:
    the fingerprint over the sources against ``stored_ptrs`` (the records' real_kv_hash); STORE
    also writes the last source's hash to ``read_hashes[slot]``. COMPARE: the last source's hash
    (the only source READS holds) against ``read_hashes[slot]``, what a STORE launch found there.
    The stored values load after the hashing: loaded before it, Triton kept the per-slot checks in
    the hash tile's layout and verify_view lost a third of its bandwidth on an H100."""
    fingerprint, last = slot_fingerprint(sources, READS, slots, live)
    fresh = as_i64(fingerprint)
    if READ_HASHES == READ_HASHES_STORE:
        tl.store(read_hashes + slots, as_i64(last), mask=live)
    if READ_HASHES == READ_HASHES_COMPARE:
        fresh = as_i64(last)
        stored_ptrs = read_hashes + slots
    stored = tl.load(stored_ptrs, mask=live, other=0)
    return live & (stored != fresh), stored, fresh


@triton.jit
def check_records(records, sources, READS: tl.constexpr, slots, live, positions, chained, expected_prev_hash,
                  tokens, CHECK_TOKENS: tl.constexpr, read_hashes, READ_HASHES: tl.constexpr):
    """``(reasons, stored, expected)`` int64 per lane for the record at ``slots`` (lanes off ``live``
    pass): the slot's bytes (with >= 1 source; check_real_kv); prev_hash against
    ``expected_prev_hash`` where ``chained``; token against ``tokens`` where it is not UNKNOWN
    (with CHECK_TOKENS); position against ``positions``. stored/expected hold the primary
    reason's pair."""
    stored_position = tl.load(field_ptrs(records, slots, POSITION), mask=live, other=0)
    stored_prev_hash = tl.load(field_ptrs(records, slots, PREV_HASH), mask=live, other=0)
    zeros = tl.zeros(slots.shape, tl.int64)
    reasons, stored, expected = zeros, zeros, zeros
    if len(READS) > 0:
        bad_kv, stored_kv, fresh = check_real_kv(sources, READS, slots, live, field_ptrs(records, slots, REAL_KV_HASH),
                                                 read_hashes, READ_HASHES)
        reasons, stored, expected = note_failure(bad_kv, _REAL_KV, stored_kv, fresh, reasons, stored, expected)
    reasons, stored, expected = note_failure(chained & (stored_prev_hash != expected_prev_hash), _CHAIN,
                                             stored_prev_hash, expected_prev_hash, reasons, stored, expected)
    if CHECK_TOKENS:
        stored_token = tl.load(field_ptrs(records, slots, TOKEN), mask=live, other=0)
        bad_token = live & (tokens != _UNKNOWN) & (stored_token != tokens)
        reasons, stored, expected = note_failure(bad_token, _TOKEN, stored_token, tokens,
                                                 reasons, stored, expected)
    reasons, stored, expected = note_failure(live & (stored_position != positions), _POSITION,
                                             stored_position, positions, reasons, stored, expected)
    return reasons, stored, expected
