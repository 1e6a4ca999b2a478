"""Each kind of corruption is caught with the right reason at the right slot, position and row, and
nothing else is (every launch is also checked against its reference)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STORED
from kvcanary_kernels.records import FIELD_PREV_HASH, FIELD_REAL_KV_HASH, FIELD_TOKEN, Reason

from kv_world import i64

POS, CHAIN, KV, TOK = Reason.VERIFY_POSITION, Reason.VERIFY_CHAIN_HASH, Reason.VERIFY_REAL_KV_HASH, Reason.VERIFY_TOKEN
MISSING = Reason.VERIFY_MISSING_SLOT
LEN = 8


def _found(rows) -> set[tuple[int, int, int]]:
    """(slot, position, reasons) of each row."""
    return {(r[COL_SLOT], r[COL_POSITION], r[COL_REASONS]) for r in rows}


@pytest.fixture(params=["token", "block4", "full_to_group"])
def stamped(request, world_factory):
    """Two requests of LEN tokens, stamped in one forward, in a pool with two sources."""
    w = world_factory(7, request.param, specs=((torch.bfloat16, 1, 32), (torch.float16, 4, 16)))
    reqs = [w.add_request(LEN, context_key=3), w.add_request(LEN)]
    assert w.step([(r, LEN) for r in reqs]) == []
    return w, reqs


def _head(w, req, known_tokens=True, window=0):
    """HEAD of a forward reading every cached position of ``req``."""
    return w.verify(w.head_view([req], known_tokens=known_tokens), window=window)


def test_kv_byte_flip(stamped):
    w, (a, b) = stamped
    slot = w.slot(a, 4)
    w.kv_bytes(0, slot)[0] ^= 0x01
    rows = _head(w, a)
    assert _found(rows) == {(slot, 4, KV)}
    assert rows[0][COL_ROW] == a.row
    assert rows[0][COL_STORED] == w.records[slot, FIELD_REAL_KV_HASH]
    assert rows[0][COL_EXPECTED] == w.fingerprints([slot])[0]
    assert _head(w, b) == []


def test_two_slots_kv_swapped(stamped):
    w, (a, _) = stamped
    x, y = w.kv_bytes(1, w.slot(a, 2)), w.kv_bytes(1, w.slot(a, 6))
    saved = x.clone()
    x.copy_(y)
    y.copy_(saved)
    assert _found(_head(w, a)) == {(w.slot(a, 2), 2, KV), (w.slot(a, 6), 6, KV)}


def test_record_token_overwritten(stamped):
    w, (a, _) = stamped
    w.records[w.slot(a, 5), FIELD_TOKEN] += 1
    # A record's own prev_hash does not cover its token; its successor's does.
    assert _found(_head(w, a)) == {(w.slot(a, 5), 5, TOK), (w.slot(a, 6), 6, CHAIN)}


def test_wrong_mapping_entry(world_factory):
    w = world_factory(8, specs=((torch.bfloat16, 1, 32),))
    a, b = w.add_request(LEN), w.add_request(LEN)
    assert w.step([(a, LEN), (b, LEN)]) == []
    w.table[a.row, 3] = w.slot(b, 5)  # another live slot, holding position 5 of another request
    rows = _head(w, a, known_tokens=False)
    assert _found(rows) == {(w.slot(b, 5), 3, POS | CHAIN), (w.slot(a, 4), 4, CHAIN)}
    head = next(r for r in rows if r[COL_SLOT] == w.slot(b, 5))
    assert (head[COL_STORED], head[COL_EXPECTED], head[COL_ROW]) == (5, 3, a.row)
    assert b.tokens[5] != a.tokens[3]
    assert _found(_head(w, a)) == {(w.slot(b, 5), 3, POS | TOK | CHAIN), (w.slot(a, 4), 4, CHAIN)}


def test_wrong_block_table_entry(world_factory):
    """A block entry pointing at another request's block of the same positions: positions and KV
    match, so the chain at the block boundary (and known tokens) tell."""
    w = world_factory(9, "block4", specs=((torch.bfloat16, 1, 32),))
    a, b = w.add_request(LEN), w.add_request(LEN)
    assert w.step([(a, LEN), (b, LEN)]) == []
    w.table[a.row, 1] = w.table[b.row, 1]
    assert _found(_head(w, a, known_tokens=False)) == {(w.slot(b, 4), 4, CHAIN)}
    assert _found(_head(w, a)) == {(w.slot(b, 4), 4, CHAIN | TOK)} | {(w.slot(b, p), p, TOK) for p in (5, 6, 7)}


def test_two_mapping_entries_swapped(world_factory):
    w = world_factory(10, specs=((torch.bfloat16, 1, 32),))
    a = w.add_request(LEN)
    assert w.step([(a, LEN)]) == []
    s1, s5 = w.slot(a, 1), w.slot(a, 5)
    w.table[a.row, 1], w.table[a.row, 5] = s5, s1
    assert _found(_head(w, a, known_tokens=False)) == {
        (s5, 1, POS | CHAIN), (w.slot(a, 2), 2, CHAIN), (s1, 5, POS | CHAIN), (w.slot(a, 6), 6, CHAIN),
    }


def test_stale_slot_reused_by_another_sequence(world_factory):
    w = world_factory(11, specs=((torch.bfloat16, 1, 32),))
    a, c = w.add_request(LEN), w.add_request(LEN)
    assert w.step([(a, LEN)]) == []
    stale = w.slot(a, 2)  # a's slot at position 2, freed too early and reused by c at position 6
    w.table[c.row, 6] = stale
    c.tokens[6] = a.tokens[2] + 1
    assert w.step([(c, LEN)]) == []
    assert _found(_head(w, a)) == {(stale, 2, POS | TOK | CHAIN), (w.slot(a, 3), 3, CHAIN)}
    assert _head(w, c) == []


def _evict(w, req, pos) -> int:
    """Drops (req, pos) from the mapping (an SWA eviction); returns the slot it had."""
    slot = w.slot(req, pos)
    if w.full_to_group is not None:
        w.full_to_group[int(w.table[req.row, pos])] = 0
    else:  # a per-token entry 0 is the reserved slot; a block entry 0 is the null block
        w.table[req.row, pos // w.kind.page_size] = 0
    return slot


def test_missing_slot_inside_a_window(stamped):
    w, (a, _) = stamped
    _evict(w, a, 5)
    rows = _head(w, a, window=3)  # reads positions 5..7
    if w.kind.page_size == 1 or w.full_to_group is not None:
        assert _found(rows) == {(0, 5, MISSING)}  # position 6's chain is not checked across the hole
        assert _head(w, a, window=2) == []  # reads positions 6..7 only
    else:  # the whole null block (positions 4..7) is missing
        assert _found(rows) == {(0, p, MISSING) for p in (5, 6, 7)}
    assert (rows[0][COL_ROW], rows[0][COL_STORED], rows[0][COL_EXPECTED]) == (a.row, 0, 0)
    # an engine whose slot 0 holds a token (no spare slot): a read mapped there is skipped
    assert w.verify(w.head_view([a]), window=3, missing_at_zero=False) == []


def test_window_start_is_not_chain_checked(stamped):
    w, (a, _) = stamped
    w.records[w.slot(a, 4), FIELD_PREV_HASH] += 1
    successor = (w.slot(a, 5), 5, CHAIN)  # position 5's expected prev_hash covers 4's
    assert _found(_head(w, a, window=4)) == {successor}  # positions 4..7: 4 starts the window
    assert _found(_head(w, a, window=5)) == {(w.slot(a, 4), 4, CHAIN), successor}


def test_written_reserved_slot(stamped):
    w, (a, _) = stamped
    w.kv_bytes(1, 0)[3] ^= 0x40  # a padding row wrote slot 0
    view = w.head_view([a])
    rows = w.verify(view, sentinel=True)
    assert [(r[COL_SLOT], r[COL_POSITION], r[COL_ROW], r[COL_REASONS]) for r in rows] == [
        (0, -1, -1, Reason.RESERVED_SLOT_WRITTEN)]
    assert rows[0][COL_STORED] == w.records[0, FIELD_REAL_KV_HASH]
    assert rows[0][COL_EXPECTED] == w.fingerprints([0])[0] != rows[0][COL_STORED]
    assert w.verify(view, sentinel=False) == []


def test_recheck_with_read_hashes_compares_the_last_source_with_what_head_read(stamped):
    """Damage inside a forward: RECHECK re-reads the last source only, against the hashes HEAD
    kept; damage to another source is the next HEAD's to report."""
    w, (a, b) = stamped
    w.use_read_hashes()
    view = w.head_view([a, b])
    assert w.verify(view, sentinel=True) == []
    last_source = len(w.sources) - 1
    w.kv_bytes(last_source, w.slot(a, 3))[5] ^= 0x10
    w.kv_bytes(0, w.slot(b, 6))[0] ^= 0x01
    w.kv_bytes(last_source, 0)[1] ^= 0x02  # slot 0
    rows = w.verify(view, sentinel=True, after_forward=True)
    assert _found(rows) == {(w.slot(a, 3), 3, KV), (0, -1, Reason.RESERVED_SLOT_WRITTEN)}
    damaged = next(r for r in rows if r[COL_SLOT] == w.slot(a, 3))
    expected = K.source_hash_ref(w.sources[last_source], i64([w.slot(a, 3)]))[0]
    assert damaged[COL_EXPECTED] == expected != damaged[COL_STORED]
    assert _found(w.verify(view)) == {(w.slot(a, 3), 3, KV), (w.slot(b, 6), 6, KV)}


def test_sentinel_needs_a_source(world_factory):
    w = world_factory(12, specs=((torch.bfloat16, 1, 32, "none"),))
    assert w.verify(w.head_view([]), sentinel=True) == []


def test_wrong_context_key_at_position_zero(world_factory):
    """KV cached under one context (a LoRA adapter, a cache salt) reused under another."""
    w = world_factory(13, "block4", specs=((torch.bfloat16, 1, 32),))
    a = w.add_request(LEN, context_key=1111)
    assert w.step([(a, LEN)]) == []
    c = w.add_request(LEN + 2, prefix=a, shared=LEN, context_key=2222)
    rows = _head(w, c)
    assert _found(rows) == {(w.slot(a, 0), 0, CHAIN)}
    assert (rows[0][COL_STORED], rows[0][COL_EXPECTED]) == (K.to_signed(K.head_hash_int(1111)),
                                                            K.to_signed(K.head_hash_int(2222)))
    assert _found(w.step([(c, 2)])) == {(w.slot(a, 0), 0, CHAIN)}  # HEAD and RECHECK of c's decode
    assert len(w.step([(c, 0)])) == 2


def test_write_token(stamped):
    w, (_, b) = stamped
    c = w.add_request(LEN, prefix=b, shared=4)
    fwd = w.forward([(c, 4)])
    w.write(fwd)
    ids = fwd.view.input_ids.clone()
    ids[2] += 1  # the engine wrote a token its bookkeeping did not expect (position 6)
    rows = w.stamp(replace(fwd.view, input_ids=ids))
    w.commit(fwd)
    assert _found(rows) == {(w.slot(c, 6), 6, Reason.WRITE_TOKEN)}
    assert (rows[0][COL_STORED], rows[0][COL_EXPECTED], rows[0][COL_ROW]) == (c.tokens[6] + 1, c.tokens[6], c.row)
    # The chain was stamped over the written token, so HEAD sees only the token.
    assert _found(_head(w, c)) == {(w.slot(c, 6), 6, TOK)}
    assert _head(w, c, known_tokens=False) == []


def test_write_position(stamped):
    w, (a, _) = stamped
    c = w.add_request(3, prefix=a, shared=0)
    fwd = w.forward([(c, 3)])
    w.write(fwd)
    bad = replace(fwd.view, positions=fwd.view.positions + 10)
    rows = w.stamp(bad)
    assert _found(rows) == {(w.slot(c, p), p, Reason.WRITE_POSITION) for p in range(3)}
    assert {(r[COL_STORED], r[COL_EXPECTED]) for r in rows} == {(10, 0), (11, 1), (12, 2)}
    assert w.stamp(bad, check_write_inputs=False) == []


def test_write_real_kv_hash(stamped):
    """Write-through: the forward's computed KV for a token is not what its slot holds, here
    because a later write (a padding row, a slot with two owners) overwrote the slot."""
    w, _ = stamped
    c = w.add_request(LEN)
    fwd = w.forward([(c, LEN)], pad_tokens=2)
    written = w.write(fwd)
    computed = w.source_hashes(written)
    padding = torch.full((computed.shape[0], 2), 5, dtype=torch.int64, device=computed.device)  # anything
    computed = torch.cat([computed, padding], dim=1)
    expected = w.fingerprints([written[3]])[0]
    w.kv_bytes(0, written[3])[7] ^= 0x02
    rows = w.stamp(fwd.view, written_source_hashes=computed, check_write_inputs=False)
    assert _found(rows) == {(written[3], 3, Reason.WRITE_REAL_KV_HASH)}
    assert (rows[0][COL_STORED], rows[0][COL_EXPECTED]) == (w.fingerprints([written[3]])[0], expected)


def test_a_mapping_hole_in_a_written_range_is_skipped(world_factory):
    """A written position without a slot gets no record and does not advance the chain; HEAD then
    reports the hole alone."""
    w = world_factory(14, "full_to_group", specs=((torch.bfloat16, 1, 32),))
    a = w.add_request(LEN)
    fwd = w.forward([(a, LEN)])
    hole = _evict(w, a, 3)
    record_zero, hole_record = w.records[0].clone(), w.records[hole].clone()
    written = w.write(fwd)
    assert written[3] == 0
    assert w.stamp(fwd.view) == []
    w.commit(fwd)
    assert torch.equal(w.records[0], record_zero) and torch.equal(w.records[hole], hole_record)
    assert int(w.ring.slot_runs[1]) == LEN - 1
    assert _found(_head(w, a)) == {(0, 3, MISSING)}


def test_padding_rows_and_tokens_write_nothing(stamped):
    w, (a, b) = stamped
    before = w.records.clone()
    view = w.head_view([b], pad_rows=3, pad_tokens=5)
    view = replace(view, rows=torch.full_like(view.rows, a.row))  # padding may point at a live row
    assert w.stamp(view) == []
    assert torch.equal(w.records, before)
    assert _head(w, a) == [] and _head(w, b) == []
