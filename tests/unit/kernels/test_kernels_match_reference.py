"""Kernels == torch references, bit for bit, on random pools, plans and corruptions.

Every launch goes through ``World.launch``, which runs the kernel and its reference on copies of
the same state and compares records, ring rows and counters.
"""

from __future__ import annotations

import pytest
import torch

import kvcanary_kernels as K

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

LAYOUTS = {
    "row-bf16-all": ((BF16, 1, 64),),
    "row-none": ((BF16, 1, 64, "none"),),
    "paged-fp16-partial": ((FP16, 4, 24, "partial"),),
    "paged-2src-strided": ((BF16, 4, 64), (FP32, 2, 8, "partial", 4)),
    "4src-mixed": ((FP16, 1, 8), (BF16, 2, 16, "partial"), (FP32, 4, 12, "all", 4), (FP16, 8, 8)),
}


def _corrupt_write_inputs(w, entries: K.WriteEntries) -> K.WriteEntries:
    """Random engine-input mismatches (at least one) and unknown expected tokens for the write checks."""
    n = entries.slots.numel()
    pick = lambda p: (torch.rand(n, generator=w.gen) < p).to(w.device)  # noqa: E731
    surely = torch.arange(n, device=w.device) == w.randint(0, int((entries.slots != 0).sum()))
    expected_positions = torch.where(pick(0.1) | surely, entries.expected_positions + 1, entries.expected_positions)
    expected_tokens = torch.where(pick(0.1), entries.expected_tokens + 7, entries.expected_tokens)
    expected_tokens = torch.where(pick(0.2), K.records.UNKNOWN, expected_tokens)
    return entries._replace(expected_positions=expected_positions, expected_tokens=expected_tokens)


def _corrupt_state(w, live_slots: list[int]) -> None:
    """Random KV bit flips and record field overwrites at live slots."""
    for _ in range(4):
        slot = live_slots[w.randint(0, len(live_slots))]
        if w.sources and w.randint(0, 2):
            kv = w.kv_bytes(w.randint(0, len(w.sources)), slot)
            kv[w.randint(0, kv.numel())] ^= 1 << w.randint(0, 8)
        else:
            w.records[slot, w.randint(0, 4)] += w.randint(1, 1000)


def _corrupt_plan(w, entries: K.VerifyEntries, live_slots: list[int]) -> K.VerifyEntries:
    slots, tokens = entries.slots.clone(), entries.tokens.clone()
    for _ in range(2):
        i = w.randint(0, slots.numel())
        if slots[i] != 0:
            slots[i] = live_slots[w.randint(0, len(live_slots))]
        tokens[w.randint(0, tokens.numel())] += 1
    return entries._replace(slots=slots, tokens=tokens)


# Small tiles walk each slot's words in several chunks, the last one partial where read_words is
# not a multiple of the chunk.
TILINGS = {"default": None, "small": K.Tiling(block=32, chunk=4, num_warps=1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed, tiling", [(11, "default"), (22, "small")])
def test_kernels_match_reference(world_factory, layout, seed, tiling):
    w = world_factory(seed, specs=LAYOUTS[layout])
    w.tiling = TILINGS[tiling]
    roots = [w.add_request(w.randint(4, 20)) for _ in range(3)]
    cuts = [w.randint(1, len(r.tokens)) for r in roots]
    derived = []
    for root, cut in zip(roots, cuts):
        shared = w.randint(1, cut + 1)
        derived.append((w.add_request(shared + w.randint(1, 12), prefix=root, prefix_len=shared), shared))

    # Chunked prefill: a seed slot is always stamped by an earlier launch.
    launches = [
        [(r, 0, c) for r, c in zip(roots, cuts)],
        [(r, c, len(r.tokens)) for r, c in zip(roots, cuts)] + [(d, s, s + 1) for d, s in derived],
        [(d, s + 1, len(d.tokens)) for d, s in derived],
    ]
    check_rows = 0
    for tag, spans in enumerate(launches):
        spans = [span for span in spans if span[1] < span[2]]
        for req, start, stop in spans:
            w.fill_kv(req.slots[start:stop])
        entries = _corrupt_write_inputs(w, w.write_entries(spans, pad=w.randint(0, 3)))
        check_rows += len(w.stamp(entries, tag=tag, check_tokens=bool(seed % 2)))
        w.ring.advance_step()
    assert check_rows > 0

    requests = roots + [d for d, _ in derived]
    full = [(r, 0, len(r.tokens)) for r in requests]
    windowed = [(r, w.randint(0, len(r.tokens)), len(r.tokens)) for r in requests]
    assert w.verify(w.verify_entries(full, pad=2), tag=4) == []
    assert w.verify(w.verify_entries(windowed, known_tokens=False), tag=5) == []

    live = sorted({s for r in requests for s in r.slots})
    _corrupt_state(w, live)
    plan = _corrupt_plan(w, w.verify_entries(full, pad=1), live)
    rows = w.verify(plan, tag=6, check_tokens=False) + w.verify(plan, tag=7)
    assert rows
    w.verify(w.verify_entries(windowed), tag=8)


def test_slot_zero_inside_a_segment_is_skipped(world):
    """A padding entry (slot 0) inside a segment neither gets a record nor advances the chain."""
    a = world.add_request(6)
    world.fill_kv(a.slots)
    e = world.write_entries([(a, 0, 6)])
    pad = lambda t: torch.cat([t[:3], t.new_zeros(1), t[3:]])  # noqa: E731
    padded = K.WriteEntries(pad(e.slots), pad(e.tokens), pad(e.positions), pad(e.expected_positions),
                            pad(e.expected_tokens), pad(e.rows), e.seg_starts, e.seg_lens + 1, e.seed_slots)
    record_zero = world.records[0].clone()
    assert world.stamp(padded) == []
    assert torch.equal(world.records[0], record_zero)
    assert world.verify(world.verify_entries([(a, 0, 6)])) == []
