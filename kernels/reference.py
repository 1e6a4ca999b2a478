"""Pure-torch references of the stamp and verify kernels and the real-KV fingerprint.

Same signatures and same effect on records, ring.count, kernel_runs and slot_runs as the kernels;
the ring rows are the same set, in entry order (the kernels' order may differ). Written to be read,
not to be fast: they synchronise with the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .entries import VerifyEntries, WriteEntries
from .hashing import CHAIN_HEAD_HASH, CHAIN_HEAD_HASH_U64, mix3_int, mix3_torch, mix_torch, to_signed
from .launch import check_launch
from .records import (
    COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STEP, COL_STORED, COL_TAG,
    FIELD_POSITION, FIELD_PREV_HASH, FIELD_REAL_KV_HASH, FIELD_TOKEN, PREV_SKIP,
    PRIMARY_REASON_ORDER, ROW_WIDTH, UNKNOWN, Reason,
)
from .ring import ViolationRing
from .sources import RealKvSource

# A failing check per reason: (failing entries, stored values, expected values).
Checks = dict[Reason, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def source_hash_ref(source: RealKvSource, slots: torch.Tensor) -> torch.Tensor:
    """Wrapping sum over the slot's first read_words words of ``mix(w_i ^ mix(i + 1))``."""
    words = source.words()
    cols = torch.arange(source.read_bytes // 8, device=slots.device)
    pages = slots // source.page_size
    offsets = (slots % source.page_size)[:, None] * (source.num_bytes_per_token // 8) + cols
    tile = words[pages[:, None], offsets]
    return mix_torch(tile ^ mix_torch(cols + 1)).sum(dim=1)


def fingerprint_ref(sources: Sequence[RealKvSource], slots: torch.Tensor) -> torch.Tensor:
    """int64 fingerprint of each slot: ``acc = mix(acc ^ source_hash)`` over sources; 0 for none."""
    acc = torch.zeros_like(slots)
    for source in sources:
        acc = mix_torch(acc ^ source_hash_ref(source, slots))
    return acc


def successor_hash_ref(records: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``mix3(prev_hash, token, position)`` of the records at ``slots``."""
    rec = records[slots]
    return mix3_torch(rec[:, FIELD_PREV_HASH], rec[:, FIELD_TOKEN], rec[:, FIELD_POSITION])


def verify_records_ref(records: torch.Tensor, entries: VerifyEntries, sources: Sequence[RealKvSource],
                       ring: ViolationRing, tag: int, check_tokens: bool = True) -> None:
    """Reference of ``verify_records``."""
    check_launch(records, entries, sources, ring, tag)
    e = VerifyEntries(*(t[entries.slots != 0] for t in entries))
    rec = records[e.slots]
    has_prev = e.prev_slots >= 0
    expected_prev = torch.where(has_prev, successor_hash_ref(records, e.prev_slots.clamp(min=0)),
                                CHAIN_HEAD_HASH)
    stored_prev = rec[:, FIELD_PREV_HASH]
    checks: Checks = {
        Reason.VERIFY_POSITION: (rec[:, FIELD_POSITION] != e.positions, rec[:, FIELD_POSITION], e.positions),
        Reason.VERIFY_CHAIN_HASH: (
            (e.prev_slots != PREV_SKIP) & (stored_prev != expected_prev), stored_prev, expected_prev
        ),
    }
    if sources:
        fingerprint = fingerprint_ref(sources, e.slots)
        stored_kv = rec[:, FIELD_REAL_KV_HASH]
        checks[Reason.VERIFY_REAL_KV_HASH] = (stored_kv != fingerprint, stored_kv, fingerprint)
    if check_tokens:
        stored_token = rec[:, FIELD_TOKEN]
        bad_token = (e.tokens != UNKNOWN) & (stored_token != e.tokens)
        checks[Reason.VERIFY_TOKEN] = (bad_token, stored_token, e.tokens)
    _log(ring, tag, checks, e.slots, e.positions, e.rows)


def stamp_records_ref(records: torch.Tensor, entries: WriteEntries, sources: Sequence[RealKvSource],
                      ring: ViolationRing, tag: int, check_tokens: bool = True,
                      check_write_inputs: bool = True) -> None:
    """Reference of ``stamp_records``."""
    check_launch(records, entries, sources, ring, tag)
    chained, prev_hashes = _chain_ref(records, entries)
    records[entries.slots[chained], FIELD_PREV_HASH] = prev_hashes
    live = entries.slots != 0
    slots, tokens, positions = entries.slots[live], entries.tokens[live], entries.positions[live]
    expected_positions, expected_tokens = entries.expected_positions[live], entries.expected_tokens[live]
    records[slots, FIELD_TOKEN] = tokens
    records[slots, FIELD_POSITION] = positions
    records[slots, FIELD_REAL_KV_HASH] = fingerprint_ref(sources, slots)
    checks: Checks = {}
    if check_write_inputs:
        checks[Reason.WRITE_POSITION] = (positions != expected_positions, positions, expected_positions)
        if check_tokens:
            bad_token = (expected_tokens != UNKNOWN) & (tokens != expected_tokens)
            checks[Reason.WRITE_TOKEN] = (bad_token, tokens, expected_tokens)
    _log(ring, tag, checks, slots, expected_positions, entries.rows[live])


def _chain_ref(records: torch.Tensor, entries: WriteEntries) -> tuple[torch.Tensor, torch.Tensor]:
    """Which entries get a prev_hash (live entries inside a segment) and their values, in order."""
    slots, tokens, positions = entries.slots.tolist(), entries.tokens.tolist(), entries.positions.tolist()
    chained = torch.zeros(len(slots), dtype=torch.bool)
    values: list[int] = []
    for start, length, seed in zip(entries.seg_starts.tolist(), entries.seg_lens.tolist(),
                                   entries.seed_slots.tolist()):
        if seed >= 0:
            rec = records[seed].tolist()
            chain = mix3_int(rec[FIELD_PREV_HASH], rec[FIELD_TOKEN], rec[FIELD_POSITION])
        else:
            chain = CHAIN_HEAD_HASH_U64
        for i in range(start, start + length):
            if slots[i] == 0:
                continue
            chained[i] = True
            values.append(to_signed(chain))
            chain = mix3_int(chain, tokens[i], positions[i])
    device = records.device
    return chained.to(device), torch.tensor(values, dtype=torch.int64, device=device)


def _log(ring: ViolationRing, tag: int, checks: Checks, slots: torch.Tensor, positions: torch.Tensor,
         rows: torch.Tensor) -> None:
    """Counts the launch and its live entries, and appends one row per entry failing a check."""
    ring.kernel_runs[tag] += 1
    ring.slot_runs[tag] += slots.shape[0]
    reasons = torch.zeros_like(slots)
    stored = torch.zeros_like(slots)
    expected = torch.zeros_like(slots)
    for reason in reversed(PRIMARY_REASON_ORDER):
        if reason in checks:
            bad, stored_value, expected_value = checks[reason]
            reasons |= torch.where(bad, int(reason), 0)
            stored = torch.where(bad, stored_value, stored)
            expected = torch.where(bad, expected_value, expected)
    fail = reasons != 0
    n_fail = int(fail.sum())
    start = ring.total()
    new = torch.empty(n_fail, ROW_WIDTH, dtype=torch.int64, device=slots.device)
    new[:, COL_REASONS] = reasons[fail]
    new[:, COL_TAG] = tag
    new[:, COL_STEP] = ring.step
    new[:, COL_SLOT] = slots[fail]
    new[:, COL_POSITION] = positions[fail]
    new[:, COL_ROW] = rows[fail]
    new[:, COL_STORED] = stored[fail]
    new[:, COL_EXPECTED] = expected[fail]
    kept = max(0, min(n_fail, ring.capacity - start))
    ring.rows[start : start + kept] = new[:kept]
    ring.count += n_fail
