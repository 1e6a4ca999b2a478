"""Each kind of corruption is caught with the right reason at the right slot, and nothing else is."""

from __future__ import annotations

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STORED
from kvcanary_kernels.records import Reason

POS, CHAIN, KV, TOK = Reason.VERIFY_POSITION, Reason.VERIFY_CHAIN_HASH, Reason.VERIFY_REAL_KV_HASH, Reason.VERIFY_TOKEN
LEN = 8


def _found(rows) -> set[tuple[int, int, int]]:
    """(slot, expected position, reasons) of each row."""
    return {(r[COL_SLOT], r[COL_POSITION], r[COL_REASONS]) for r in rows}


@pytest.fixture(params=[1, 4], ids=["row", "paged"])
def stamped(request, world_factory):
    """Two stamped requests of LEN tokens in a pool with two sources."""
    page = request.param
    w = world_factory(request.param * 7 + 1, specs=((torch.bfloat16, page, 32), (torch.float16, page, 16)))
    reqs = [w.add_request(LEN), w.add_request(LEN)]
    for r in reqs:
        w.fill_kv(r.slots)
    assert w.stamp(w.write_entries([(r, 0, LEN) for r in reqs])) == []
    return w, reqs


def _verify(w, req, slots=None, known_tokens=True):
    """HEAD over the whole request, with its req_to_token row replaced by ``slots``."""
    mapped = type(req)(req.row, req.tokens, list(slots or req.slots))
    return w.verify(w.verify_entries([(mapped, 0, LEN)], known_tokens=known_tokens))


def test_wrong_mapping_entry(stamped):
    w, (a, b) = stamped
    slots = list(a.slots)
    slots[3] = b.slots[5]  # another live slot, holding position 5 of another request
    rows = _verify(w, a, slots, known_tokens=False)
    assert _found(rows) == {(b.slots[5], 3, POS | CHAIN), (a.slots[4], 4, CHAIN)}
    head = next(r for r in rows if r[COL_SLOT] == b.slots[5])
    assert (head[COL_STORED], head[COL_EXPECTED], head[COL_ROW]) == (5, 3, a.row)


def test_wrong_mapping_entry_with_known_tokens_also_flags_the_token(stamped):
    w, (a, b) = stamped
    slots = list(a.slots)
    slots[3] = b.slots[5]
    assert b.tokens[5] != a.tokens[3]
    assert _found(_verify(w, a, slots)) == {(b.slots[5], 3, POS | TOK | CHAIN), (a.slots[4], 4, CHAIN)}


def test_two_mapping_entries_swapped(stamped):
    w, (a, _) = stamped
    slots = list(a.slots)
    slots[1], slots[5] = slots[5], slots[1]
    assert _found(_verify(w, a, slots, known_tokens=False)) == {
        (a.slots[5], 1, POS | CHAIN), (a.slots[2], 2, CHAIN),
        (a.slots[1], 5, POS | CHAIN), (a.slots[6], 6, CHAIN),
    }


def test_two_slots_kv_swapped(stamped):
    w, (a, _) = stamped
    x, y = w.kv_bytes(1, a.slots[2]), w.kv_bytes(1, a.slots[6])
    saved = x.clone()
    x.copy_(y)
    y.copy_(saved)
    assert _found(_verify(w, a)) == {(a.slots[2], 2, KV), (a.slots[6], 6, KV)}


def test_stale_slot_reused_by_another_sequence(stamped):
    w, (a, _) = stamped
    c = w.add_request(LEN)
    w.free.append(c.slots[6])
    c.slots[6] = a.slots[2]  # a's slot at position 2, freed too early and reused
    c.tokens[6] = a.tokens[2] + 1
    w.fill_kv(c.slots)
    assert w.stamp(w.write_entries([(c, 0, LEN)])) == []
    assert _found(_verify(w, a)) == {(a.slots[2], 2, POS | TOK | CHAIN), (a.slots[3], 3, CHAIN)}
    assert _verify(w, c) == []


def test_kv_byte_flip(stamped):
    w, (a, b) = stamped
    w.kv_bytes(0, a.slots[4])[0] ^= 0x01
    rows = _verify(w, a)
    assert _found(rows) == {(a.slots[4], 4, KV)}
    slot = torch.tensor([a.slots[4]], device=w.device)
    assert rows[0][COL_STORED] == w.records[a.slots[4], 3]
    assert rows[0][COL_EXPECTED] == K.fingerprint_ref(w.sources, slot).item()
    assert _verify(w, b) == []


def test_wrong_token_written(stamped):
    w, (_, b) = stamped
    c = w.add_request(LEN, prefix=b, prefix_len=4)
    w.fill_kv(c.slots[4:])
    entries = w.write_entries([(c, 4, LEN)])
    tokens = entries.tokens.clone()
    tokens[2] += 1  # the engine wrote a token its bookkeeping did not expect (position 6)
    rows = w.stamp(entries._replace(tokens=tokens))
    assert _found(rows) == {(c.slots[6], 6, Reason.WRITE_TOKEN)}
    assert (rows[0][COL_STORED], rows[0][COL_EXPECTED]) == (c.tokens[6] + 1, c.tokens[6])
    # The chain was stamped over the written token, so HEAD sees only the token.
    assert _found(_verify(w, c)) == {(c.slots[6], 6, TOK)}
    assert _verify(w, c, known_tokens=False) == []


def test_wrong_position_written(stamped):
    w, (a, _) = stamped
    c = w.add_request(3, prefix=a, prefix_len=2)
    w.fill_kv(c.slots[2:])
    entries = w.write_entries([(c, 2, 3)])
    rows = w.stamp(entries._replace(positions=entries.positions + 10))
    assert _found(rows) == {(c.slots[2], 2, Reason.WRITE_POSITION)}
    assert (rows[0][COL_STORED], rows[0][COL_EXPECTED]) == (12, 2)
    assert w.stamp(entries._replace(positions=entries.positions + 10), check_write_inputs=False) == []


def test_record_token_overwritten(stamped):
    w, (a, _) = stamped
    w.records[a.slots[5], 0] += 1
    # A record's own prev_hash does not cover its token; its successor's does.
    assert _found(_verify(w, a)) == {(a.slots[5], 5, TOK), (a.slots[6], 6, CHAIN)}


def test_clean_multi_step_chain_with_shared_prefix(world_factory):
    w = world_factory(99, specs=((torch.bfloat16, 2, 32), (torch.float32, 1, 4, "partial")))
    a = w.add_request(6)
    w.fill_kv(a.slots)
    assert w.stamp(w.write_entries([(a, 0, 6)])) == []
    b = w.add_request(7, prefix=a, prefix_len=4)
    w.fill_kv(b.slots[4:])
    assert w.stamp(w.write_entries([(b, 4, 7)])) == []
    for step in range(4):
        spans = [(r, 0, len(r.tokens)) for r in (a, b)]
        assert w.verify(w.verify_entries(spans, pad=step)) == []
        assert w.verify(w.verify_entries([(r, max(0, len(r.tokens) - 3), len(r.tokens)) for r in (a, b)])) == []
        for r in (a, b):  # decode: one new token per request
            r.tokens.append(w.randint(0, 50_000))
            r.slots += w.alloc(1)
            w.fill_kv(r.slots[-1:])
        n = len(a.tokens)
        assert w.stamp(w.write_entries([(a, n - 1, n), (b, len(b.tokens) - 1, len(b.tokens))])) == []
    assert w.ring.total() == 0
    assert w.verify(w.verify_entries([(r, 0, len(r.tokens)) for r in (a, b)])) == []
