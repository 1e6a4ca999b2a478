"""Pure-torch references of the kernels and the real-KV fingerprint.

Same signatures and same effect on records, ring.count, kernel_runs and slot_runs as the kernels;
the ring rows are the same set, in entry order (the kernels' order may differ, so where one
launch claims more than the ring's capacity, which rows survive may differ too). Written to be
read, not to be fast: they synchronise with the device. ``tiling`` is accepted so a caller can
swap kernels for references; it changes nothing here.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .checks import check_int
from .inputs import ForwardView, SlotMapping, VerifyEntries
from .hashing import head_hash_int, head_hash_torch, link_int, link_torch, mix_torch, to_signed
from .launch import (
    Tiling, check_common, check_entries, check_prev_records, check_scales, check_selected, check_stamp_launch,
    check_state_launch, check_vector, check_view_launch,
    RowsPart, StampPart, ViewPart, check_parts, rows_source,
)
from .records import (
    COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STEP, COL_STORED, COL_TAG,
    FIELD_POSITION, FIELD_PREV_HASH, FIELD_REAL_KV_HASH, FIELD_TOKEN, PREV_SKIP,
    PRIMARY_REASON_ORDER, ROW_WIDTH, UNKNOWN, Reason,
)
from .ring import ViolationRing
from .sources import RealKvSource

# A failing check per reason: (failing entries, stored values, expected values).
Checks = dict[Reason, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# ---- hashes -------------------------------------------------------------------------------


_LOW32 = (1 << 32) - 1


def word_terms_ref(words: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``a * b + a + b`` of int64 words against keys (``fingerprint.word_terms``; multiplies wrap)."""
    a = ((words & _LOW32) + (keys & _LOW32)) & _LOW32
    b = (((words >> 32) & _LOW32) + ((keys >> 32) & _LOW32)) & _LOW32
    return a * b + a + b


def source_hash_ref(source: RealKvSource, slots: torch.Tensor) -> torch.Tensor:
    """Wrapping sum over the slot's read_words sampled words of their terms keyed by ``mix(i + 1)``."""
    words = source.words()
    unit = words.element_size()
    cols = torch.arange(source.read_bytes // 8, device=slots.device)
    pages = slots // source.page_size
    within = slots % source.page_size
    tile = source.slots_per_tile
    first = ((within // tile) * (source.tile_stride // unit) + (within % tile) * (source.slot_stride // unit))[:, None]
    if not source.elementwise:
        tile = words[pages[:, None], first + (cols // 2) * (source.sample_stride // unit) + cols % 2]
    else:  # word i packs elements i * P .. i * P + P - 1, little-endian (fingerprint.element_source_hash)
        per_word = 8 // unit
        tile = torch.zeros(slots.shape[0], cols.shape[0], dtype=torch.int64, device=slots.device)
        for j in range(per_word):
            e = words[pages[:, None], first + (cols * per_word + j) * (source.sample_stride // unit)].to(torch.int64)
            tile |= (e & ((1 << 8 * unit) - 1) if unit < 8 else e) << (8 * unit * j)
    return word_terms_ref(tile, mix_torch(cols + 1)).sum(dim=1)


def fingerprint_ref(sources: Sequence[RealKvSource], slots: torch.Tensor) -> torch.Tensor:
    """int64 fingerprint of each slot: ``acc = mix(acc ^ source_hash)`` over sources; 0 for none."""
    acc = torch.zeros_like(slots)
    for source in sources:
        acc = mix_torch(acc ^ source_hash_ref(source, slots))
    return acc


def successor_hash_ref(records: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``link(prev_hash, token, position)`` of the records at ``slots``."""
    rec = records[slots]
    return link_torch(rec[:, FIELD_PREV_HASH], rec[:, FIELD_TOKEN], rec[:, FIELD_POSITION])


def source_hash_rows_ref(rows: torch.Tensor, read_bytes: int, out: torch.Tensor,
                         tiling: Tiling | None = None, *, sample_offset: int = 0, sample_stride: int = 16) -> None:
    """Reference of ``source_hash_rows``."""
    source = rows_source(rows, read_bytes, out, sample_offset, sample_stride)
    if source is not None:
        out.copy_(source_hash_ref(source, torch.arange(rows.shape[0], device=rows.device)))


def source_hash_rows_parts_ref(parts: Sequence[RowsPart], tiling: Tiling | None = None) -> None:
    """Reference of ``source_hash_rows_parts``."""
    check_parts(parts, RowsPart)
    for part in parts:
        source_hash_rows_ref(part.rows, part.read_bytes, part.out, tiling, sample_offset=part.sample_offset,
                             sample_stride=part.sample_stride)


# ---- lookups through the engine's tables ---------------------------------------------------


def mapping_slot_ref(mapping: SlotMapping, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The slot each (row, position) finds in the mapping's table, before full_to_group (a FULL
    slot for a group mapped through it); 0 at negative positions, wherever the table entry is 0
    (block 0 of a block table is the null block: no position in it is resident) or the lookup
    leaves the table. The first half of ``lookup.map_slot``, which mirrors it on the device."""
    logical = positions % mapping.ring if mapping.ring else positions
    cols = logical // mapping.page_size
    table = mapping.table
    ok = (positions >= 0) & (rows >= 0) & (rows < table.shape[0]) & (cols < table.shape[1])
    entry = _gather(table, ok, rows, cols).long()
    ok &= entry != 0
    return torch.where(ok, entry * mapping.page_size + logical % mapping.page_size, 0)


def group_slot_ref(mapping: SlotMapping, space_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The group's slot of each slot of the mapping's space (``mapping_slot_ref``): through
    full_to_group when the mapping has one; 0 for slot 0 and wherever the lookup leaves
    full_to_group or the pool (``num_slots``). The second half of ``lookup.map_slot``."""
    ok = space_slots != 0
    slots = space_slots
    f2g = mapping.full_to_group
    if f2g is not None:
        ok &= (slots >= 0) & (slots < f2g.shape[0])
        slots = _gather(f2g, ok, slots)
    return torch.where(ok & (slots >= 0) & (slots < num_slots), slots, 0)


def map_slot_ref(mapping: SlotMapping, rows: torch.Tensor, positions: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The slot of each (row, position) in a pool of ``num_slots``: the torch twin of
    ``lookup.map_slot`` (the two mirror each other; tests compare them on random tables)."""
    return group_slot_ref(mapping, mapping_slot_ref(mapping, rows, positions), num_slots)


def known_token_ref(view: ForwardView, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """token_table[row, position], UNKNOWN off the table."""
    tt = view.token_table
    ok = (rows >= 0) & (rows < tt.shape[0]) & (positions >= 0) & (positions < tt.shape[1])
    return torch.where(ok, _gather(tt, ok, rows, positions), UNKNOWN)


def _gather(table: torch.Tensor, ok: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` where ok, 0 elsewhere (indices off ok may be out of range)."""
    if table.numel() == 0:
        return torch.zeros_like(ok, dtype=table.dtype)
    return torch.where(ok, table[tuple(torch.where(ok, i, 0) for i in index)], 0)


def _batch_entries(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For per-row counts ``lens``, each entry's batch row and its index within the row, in order."""
    b = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    return b, torch.arange(b.shape[0], device=lens.device) - first[b]


# ---- kernels ------------------------------------------------------------------------------


def verify_records_ref(records: torch.Tensor, entries: VerifyEntries, sources: Sequence[RealKvSource],
                       ring: ViolationRing, tag: int, check_tokens: bool = True,
                       tiling: Tiling | None = None, *, prev_records: torch.Tensor | None = None) -> None:
    """Reference of ``verify_records``."""
    check_common(records, sources, ring, tag)
    check_entries(entries, records.device)
    prev_records = check_prev_records(records, prev_records)
    e = VerifyEntries(*(t[entries.slots != 0] for t in entries))
    rec = records[e.slots]
    has_prev = e.prev_slots >= 0
    expected_prev = torch.where(has_prev, successor_hash_ref(prev_records, e.prev_slots.clamp(min=0)),
                                head_hash_torch(e.context_keys))
    checks = _record_checks(rec, e.positions, expected_prev, e.prev_slots != PREV_SKIP,
                            _real_kv_check(sources, e.slots, rec[:, FIELD_REAL_KV_HASH], e.slots != 0, None,
                                           False, Reason.VERIFY_REAL_KV_HASH))
    if check_tokens:
        checks[Reason.VERIFY_TOKEN] = _token_check(rec, e.tokens)
    _count(ring, tag, e.slots.shape[0])
    _append(ring, tag, checks, e.slots, e.positions, e.rows)


def state_launch_ref(records: torch.Tensor, sources: Sequence[RealKvSource], full_records: torch.Tensor,
                     full_mapping: SlotMapping, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                     ring: ViolationRing, tag: int, *, stamp: bool, extend: torch.Tensor | None = None,
                     more: tuple[torch.Tensor, torch.Tensor] | None = None, tiling: Tiling | None = None) -> None:
    """Reference of ``state_launch``: its entries spelled out, then checked as ``verify_records``
    checks entries whose predecessors live in the FULL records, or stamped."""
    check_state_launch(records, sources, full_records, full_mapping, rows, slots, lengths, extend, more, ring, tag)
    if extend is not None:
        lengths = lengths + extend
    if more is not None:
        m = more[0].shape[1] if more[0].dim() == 2 else 1
        rows = torch.cat([rows, rows.repeat_interleave(m)])
        slots, lengths = torch.cat([slots, more[0].flatten()]), torch.cat([lengths, more[1].flatten()])
    keep = slots != 0
    rows, slots, lengths = rows[keep], slots[keep], lengths[keep]
    has_prev = lengths > 0
    prev = mapping_slot_ref(full_mapping, rows, lengths - 1)
    prev = group_slot_ref(full_mapping, prev, full_records.shape[0])
    expected_prev = torch.where(has_prev, successor_hash_ref(full_records, prev), head_hash_torch(torch.zeros_like(prev)))
    _count(ring, tag, slots.shape[0])
    if stamp:
        records[slots, FIELD_TOKEN] = torch.where(has_prev, full_records[prev, FIELD_TOKEN], UNKNOWN)
        records[slots, FIELD_POSITION] = lengths
        records[slots, FIELD_PREV_HASH] = expected_prev
        records[slots, FIELD_REAL_KV_HASH] = fingerprint_ref(sources, slots)
        return
    rec = records[slots]
    checks = _record_checks(rec, lengths, expected_prev, torch.ones_like(has_prev),
                            _real_kv_check(sources, slots, rec[:, FIELD_REAL_KV_HASH], slots != 0, None, False,
                                           Reason.VERIFY_REAL_KV_HASH))
    _append(ring, tag, checks, slots, lengths, rows)


def verify_view_ref(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping, view: ForwardView,
                    ring: ViolationRing, tag: int, *, window: int, max_context: int, check_tokens: bool,
                    sentinel: bool, after_forward: bool = False, read_hashes: torch.Tensor | None = None,
                    missing_at_zero: bool = True, tiling: Tiling | None = None) -> None:
    """Reference of ``verify_view``."""
    check_view_launch(records, sources, mapping, view, ring, tag)
    if read_hashes is not None:
        check_vector("read_hashes", read_hashes, records.device, records.shape[0])
    check_int("window", window, 0)
    check_int("max_context", max_context, 1)
    prefix = view.prefix_lens.clamp(0, max_context)
    _append(ring, tag, {Reason.VIEW_OUT_OF_RANGE: (view.prefix_lens != prefix, view.prefix_lens,
                                                   torch.full_like(prefix, max_context))},
            torch.zeros_like(prefix), view.prefix_lens, view.rows)
    starts = (prefix - window).clamp(min=0) if window else torch.zeros_like(prefix)
    if after_forward and mapping.ring:
        starts = torch.minimum(torch.maximum(starts, prefix + view.extend_lens - mapping.ring), prefix)
    b, i = _batch_entries(prefix - starts)
    positions, rows, window_starts = starts[b] + i, view.rows[b], starts[b]
    slots = map_slot_ref(mapping, rows, positions, records.shape[0])
    live = slots != 0
    rec = records[slots]
    head = live & (positions == 0)
    has_prev = live & (positions > window_starts)
    prev_slots = torch.where(has_prev, map_slot_ref(mapping, rows, (positions - 1).clamp(min=0), records.shape[0]), 0)
    context = view.context_keys[b] if view.context_keys is not None else torch.zeros_like(positions)
    expected_prev = torch.where(head, head_hash_torch(context), successor_hash_ref(records, prev_slots))
    checks = _record_checks(rec, positions, expected_prev, head | (prev_slots != 0),
                            _real_kv_check(sources, slots, rec[:, FIELD_REAL_KV_HASH], live, read_hashes,
                                           after_forward, Reason.VERIFY_REAL_KV_HASH))
    if check_tokens and view.token_table is not None:
        checks[Reason.VERIFY_TOKEN] = _token_check(rec, known_token_ref(view, rows, positions))
    checks = {reason: (bad & live, stored, expected) for reason, (bad, stored, expected) in checks.items()}
    zeros = torch.zeros_like(slots)
    if missing_at_zero:
        checks[Reason.VERIFY_MISSING_SLOT] = (~live, zeros, zeros)
    _count(ring, tag, slots.shape[0])
    _append(ring, tag, checks, slots, positions, rows)
    if sentinel and sources:
        slot0 = torch.zeros(1, dtype=torch.int64, device=records.device)
        _append(ring, tag, _real_kv_check(sources, slot0, records[:1, FIELD_REAL_KV_HASH], slot0 == 0,
                                          read_hashes, after_forward, Reason.RESERVED_SLOT_WRITTEN),
                slot0, slot0 - 1, slot0 - 1)



def verify_view_parts_ref(parts: Sequence[ViewPart], mapping: SlotMapping, view: ForwardView, ring: ViolationRing,
                          **options: Any) -> None:
    """Reference of ``verify_view_parts``: ``verify_view_ref`` of each part, in order."""
    check_parts(parts, ViewPart)
    for part in parts:
        verify_view_ref(part.records, part.sources, mapping, view, ring, part.tag, read_hashes=part.read_hashes,
                        **options)

def _real_kv_check(sources: Sequence[RealKvSource], slots: torch.Tensor, stored: torch.Tensor,
                   live: torch.Tensor, read_hashes: torch.Tensor | None, after_forward: bool,
                   reason: Reason) -> Checks:
    """The fingerprint against ``stored``, or, with read_hashes, the last source's hash stored
    there (before the forward) or compared with what is stored there (after it)."""
    if not sources:
        return {}
    if read_hashes is None:
        fresh = fingerprint_ref(sources, slots)
    elif after_forward:
        fresh, stored = source_hash_ref(sources[-1], slots), read_hashes[slots]
    else:
        fresh = fingerprint_ref(sources, slots)
        read_hashes[slots[live]] = source_hash_ref(sources[-1], slots[live])
    return {reason: (stored != fresh, stored, fresh)}


def stamp_view_ref(records: torch.Tensor, sources: Sequence[RealKvSource], mapping: SlotMapping, view: ForwardView,
                   ring: ViolationRing, tag: int, *, check_tokens: bool, check_write_inputs: bool,
                   written_source_hashes: torch.Tensor | None = None, tiling: Tiling | None = None) -> None:
    """Reference of ``stamp_view``."""
    check_stamp_launch(records, sources, mapping, view, ring, tag, written_source_hashes)
    n_tokens = view.input_ids.shape[0]
    extend = view.extend_lens.clamp(0, n_tokens)
    _append(ring, tag, {Reason.VIEW_OUT_OF_RANGE: (view.extend_lens != extend, view.extend_lens,
                                                   torch.full_like(extend, n_tokens))},
            torch.zeros_like(extend), view.prefix_lens, view.rows)
    b, j = _batch_entries(extend)
    token_index = (torch.cumsum(extend, 0) - extend)[b] + j
    positions, rows = view.prefix_lens[b] + j, view.rows[b]
    slots = torch.where(token_index < n_tokens, map_slot_ref(mapping, rows, positions, records.shape[0]), 0)
    live = slots != 0
    b, j, token_index, positions, rows, slots = (t[live] for t in (b, j, token_index, positions, rows, slots))
    tokens, written_positions = view.input_ids[token_index], view.positions[token_index]
    # Every entry with a slot folds into its row's chain; with a ring, only a row's last ring
    # entries keep their slot and are stamped.
    stamped = j >= (extend[b] - mapping.ring if mapping.ring else 0)
    prev_hashes = _chain_ref(records, mapping, view, b, tokens, written_positions)[stamped]
    token_index, positions, rows, slots = token_index[stamped], positions[stamped], rows[stamped], slots[stamped]
    tokens, written_positions = tokens[stamped], written_positions[stamped]
    fingerprint = fingerprint_ref(sources, slots)
    records[slots, FIELD_TOKEN] = tokens
    records[slots, FIELD_POSITION] = written_positions
    records[slots, FIELD_PREV_HASH] = prev_hashes
    records[slots, FIELD_REAL_KV_HASH] = fingerprint
    checks: Checks = {}
    if written_source_hashes is not None:
        written = torch.zeros_like(token_index)
        for source_hashes in written_source_hashes:
            written = mix_torch(written ^ source_hashes[token_index])
        checks[Reason.WRITE_REAL_KV_HASH] = (fingerprint != written, fingerprint, written)
    if check_write_inputs:
        checks[Reason.WRITE_POSITION] = (written_positions != positions, written_positions, positions)
        if check_tokens and view.token_table is not None:
            want = known_token_ref(view, rows, positions)
            checks[Reason.WRITE_TOKEN] = ((want != UNKNOWN) & (want != tokens), tokens, want)
    _count(ring, tag, slots.shape[0])
    _append(ring, tag, checks, slots, positions, rows)


def stamp_view_parts_ref(parts: Sequence[StampPart], mapping: SlotMapping, view: ForwardView, ring: ViolationRing,
                         **options: Any) -> None:
    """Reference of ``stamp_view_parts``: ``stamp_view_ref`` of each part, in order."""
    check_parts(parts, StampPart)
    for part in parts:
        stamp_view_ref(part.records, part.sources, mapping, view, ring, part.tag,
                       written_source_hashes=part.written_source_hashes, **options)


def _chain_ref(records: torch.Tensor, mapping: SlotMapping, view: ForwardView, b: torch.Tensor, tokens: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """The prev_hash of each entry with a slot (batch row b, in order), each row's chain seeded
    before anything is written."""
    prefix, rows = view.prefix_lens.tolist(), view.rows.tolist()
    context = view.context_keys.tolist() if view.context_keys is not None else [0] * len(prefix)
    chains = []
    for row, p, c in zip(rows, prefix, context):
        if p > 0:
            at = torch.tensor([row, p - 1], device=records.device)
            rec = records[map_slot_ref(mapping, at[:1], at[1:], records.shape[0])][0].tolist()
            chains.append(link_int(rec[FIELD_PREV_HASH], rec[FIELD_TOKEN], rec[FIELD_POSITION]))
        else:
            chains.append(head_hash_int(c))
    values = []
    for row_b, token, position in zip(b.tolist(), tokens.tolist(), positions.tolist()):
        values.append(to_signed(chains[row_b]))
        chains[row_b] = link_int(chains[row_b], token, position)
    return torch.tensor(values, dtype=torch.int64, device=records.device)


# ---- checks and the ring -------------------------------------------------------------------


def _record_checks(rec: torch.Tensor, positions: torch.Tensor, expected_prev: torch.Tensor,
                   chain_checked: torch.Tensor, checks: Checks) -> Checks:
    """Adds the position and chain checks of the records ``rec`` to ``checks``."""
    stored_position, stored_prev = rec[:, FIELD_POSITION], rec[:, FIELD_PREV_HASH]
    checks[Reason.VERIFY_POSITION] = (stored_position != positions, stored_position, positions)
    checks[Reason.VERIFY_CHAIN_HASH] = (chain_checked & (stored_prev != expected_prev), stored_prev, expected_prev)
    return checks


def _token_check(rec: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stored = rec[:, FIELD_TOKEN]
    return (tokens != UNKNOWN) & (stored != tokens), stored, tokens


def verify_scales_ref(scales: torch.Tensor, guarded: torch.Tensor, ring: ViolationRing, tag: int) -> None:
    """``scale_check.verify_scales``: a verify_scale row per scale whose bits differ from the guarded one's."""
    check_scales(scales, guarded, ring, tag)
    found, want = (t.reshape(-1).view(torch.int32).to(torch.int64) & _LOW32 for t in (scales, guarded))
    index = torch.arange(found.numel(), device=found.device)
    width = scales.shape[1]
    _count(ring, tag, scales.shape[0])
    _append(ring, tag, {Reason.VERIFY_SCALE: (found != want, found, want)}, index // width, index % width,
            torch.full_like(index, -1))


def verify_selected_ref(records: torch.Tensor, mapping: SlotMapping, view: ForwardView, ring: ViolationRing,
                        tag: int) -> None:
    """``index_check.verify_selected``: a verify_index row per used selected entry outside its query's
    positions or not at its row's slot there."""
    check_selected(records, mapping, view, ring, tag)
    positions, slots = view.selected
    topk, n_tokens = positions.shape[1], positions.shape[0]
    extend = view.extend_lens.clamp(min=0)
    start = torch.cumsum(extend, 0) - extend
    extend = torch.minimum(extend, (n_tokens - start).clamp(min=0))
    b, j = _batch_entries(extend)
    t = start[b] + j
    position, slot = positions[t].reshape(-1), slots[t].reshape(-1)
    b, query = b.repeat_interleave(topk), (view.prefix_lens[b] + j).repeat_interleave(topk)
    rows = view.rows[b]
    used = position != -1
    visible = used & (position >= 0) & (position <= query)
    expected = torch.where(visible, map_slot_ref(mapping, rows, position, records.shape[0]), 0)
    _count(ring, tag, int(used.sum()))
    _append(ring, tag, {Reason.VERIFY_INDEX: (used & (~visible | (slot != expected)), slot, expected)}, slot,
            position, rows)


def _count(ring: ViolationRing, tag: int, entries: int) -> None:
    ring.kernel_runs[tag] += 1
    ring.slot_runs[tag] += entries


def fold_checks(checks: Checks, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per entry: the bits of every failing check, and the stored and expected values of the
    primary one (``PRIMARY_REASON_ORDER``); zeros where nothing fails."""
    reasons = torch.zeros_like(like)
    stored = torch.zeros_like(like)
    expected = torch.zeros_like(like)
    for reason in reversed(PRIMARY_REASON_ORDER):  # the primary reason's values land last
        if reason in checks:
            bad, stored_value, expected_value = checks[reason]
            reasons |= torch.where(bad, int(reason), 0)
            stored = torch.where(bad, stored_value, stored)
            expected = torch.where(bad, expected_value, expected)
    return reasons, stored, expected


def _append(ring: ViolationRing, tag: int, checks: Checks, slots: torch.Tensor, positions: torch.Tensor,
            rows: torch.Tensor) -> None:
    """One row per entry failing a check, claimed in entry order at ``count % capacity``."""
    reasons, stored, expected = fold_checks(checks, slots)
    fail = reasons != 0
    n_fail = int(fail.sum())
    new = torch.empty(n_fail, ROW_WIDTH, dtype=torch.int64, device=slots.device)
    new[:, COL_REASONS] = reasons[fail]
    new[:, COL_TAG] = tag
    new[:, COL_STEP] = ring.step
    new[:, COL_SLOT] = slots[fail]
    new[:, COL_POSITION] = positions[fail]
    new[:, COL_ROW] = rows[fail]
    new[:, COL_STORED] = stored[fail]
    new[:, COL_EXPECTED] = expected[fail]
    claims = int(ring.count) + torch.arange(n_fail, device=slots.device)
    kept = slice(max(0, n_fail - ring.capacity), n_fail)  # the last capacity claims survive
    ring.rows[claims[kept] % ring.capacity] = new[kept]
    ring.count += n_fail
