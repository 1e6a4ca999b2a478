"""Ring mappings (a sliding window of ``ring`` slots per request): a forward that writes more
positions than the ring keeps only its last ``ring`` (TAIL), RECHECK leaves out the positions whose
slots the forward rewrote, and HEAD with a window of at most ``ring`` reads intact slots.

Every launch goes through ``World.launch`` (kernel == reference, bit for bit).
"""

from __future__ import annotations

import torch

from kvcanary_kernels.records import COL_POSITION, COL_REASONS, FIELD_POSITION, FIELD_PREV_HASH, Reason

from kv_world import World

RING = 16  # the "ring" and "ring-block4" mappings of kv_world
STAMP_TAG = 1  # World.step's TAIL tag
SPECS = ((torch.bfloat16, 1, 32),)


def _twins(world_factory, mapping: str, length: int) -> tuple[World, World, object, object]:
    """A ring world and a per-token world holding one request with the same tokens."""
    ring = world_factory(51, mapping, specs=SPECS, max_context=128)
    flat = world_factory(52, "token", specs=SPECS, max_context=128)
    a, b = ring.add_request(length, context_key=7), flat.add_request(length, context_key=7)
    b.tokens = list(a.tokens)
    return ring, flat, a, b


def _prev_hashes(w: World, req, start: int, stop: int) -> list[int]:
    return [int(w.records[w.slot(req, p), FIELD_PREV_HASH]) for p in range(start, stop)]


def test_long_prefills_and_wrapping_decode_log_nothing_and_keep_the_content_chain(world_factory):
    """Prefills of 2.5 rings (from position 0), 1.25 rings (after a prefix: the seed slot is
    rewritten) and exactly one ring, then decode steps around the ring: nothing is logged at
    HEAD, TAIL or RECHECK, only the last ring entries of a forward are stamped, and each kept
    position's prev_hash is the chain through every earlier position (as a per-token table
    stamps it)."""
    for mapping in ("ring", "ring-block4"):
        w, flat, a, b = _twins(world_factory, mapping, 90)
        done = 0
        for extend in (40, 20, RING, 1, 1, 1, 1, 1, 3):
            runs = int(w.ring.slot_runs[STAMP_TAG])
            assert w.step([(a, extend)], window=RING, pad_rows=1, pad_tokens=2) == []
            assert flat.step([(b, extend)]) == []
            done += extend
            assert int(w.ring.slot_runs[STAMP_TAG]) - runs == min(extend, RING)
            kept = range(done - RING, done)
            assert [int(w.records[w.slot(a, p), FIELD_POSITION]) for p in kept] == list(kept)
            assert _prev_hashes(w, a, done - RING, done) == _prev_hashes(flat, b, done - RING, done)
        assert w.verify(w.head_view([a]), window=RING, sentinel=True) == []


def test_recheck_leaves_out_the_positions_the_forward_rewrote(world_factory):
    """After a forward of 5 into a ring of 16, the read window [prefix - 16, prefix) keeps its
    last 11 positions; the first 5 hold the new tokens now. after_forward checks only the 11
    (and still catches a flipped one); the HEAD window (after_forward False) reports the 5."""
    w, _, a, _ = _twins(world_factory, "ring", 40)
    assert w.step([(a, 30)], window=RING) == []
    fwd = w.forward([(a, 5)])
    assert w.verify(fwd.view, window=RING) == []
    w.write(fwd)
    assert w.stamp(fwd.view) == []
    runs = int(w.ring.slot_runs[0])
    assert w.verify(fwd.view, window=RING, after_forward=True) == []
    assert int(w.ring.slot_runs[0]) - runs == RING - 5
    stale = w.verify(fwd.view, window=RING)
    # The 5 rewritten positions, and the chain of the one after them.
    assert sorted(r[COL_POSITION] for r in stale) == list(range(30 - RING, 30 - RING + 6))
    w.kv_bytes(0, w.slot(a, 29))[0] ^= 1
    rows = w.verify(fwd.view, window=RING, after_forward=True)
    assert [(r[COL_POSITION], r[COL_REASONS]) for r in rows] == [(29, Reason.VERIFY_REAL_KV_HASH)]


def test_recheck_after_a_forward_longer_than_the_ring_checks_nothing(world_factory):
    """A forward of at least a ring rewrites every slot: RECHECK has no position left to check,
    and after_forward changes nothing for a per-token table."""
    w, flat, a, b = _twins(world_factory, "ring", 60)
    assert w.step([(a, 20)], window=RING) == []
    fwd = w.forward([(a, RING + 3)])
    w.write(fwd)
    assert w.stamp(fwd.view) == []
    runs = int(w.ring.slot_runs[0])
    assert w.verify(fwd.view, window=RING, after_forward=True) == []
    assert int(w.ring.slot_runs[0]) == runs
    assert flat.step([(b, 20)]) == []
    fwd = flat.forward([(b, 5)])
    flat.write(fwd)
    flat.stamp(fwd.view)
    runs = int(flat.ring.slot_runs[0])
    assert flat.verify(fwd.view, window=RING, after_forward=True) == []
    assert int(flat.ring.slot_runs[0]) - runs == RING
