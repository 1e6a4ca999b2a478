"""Launches over parts (a pool group's K and V halves side by side): verify_view_parts logs exactly
what one verify_view launch a half logs, stamp_view_parts stamps and logs what one stamp_view a half
does, source_hash_rows_parts writes what one source_hash_rows a half writes, and each parts
reference agrees with its kernel."""

from __future__ import annotations

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import (
    COL_POSITION, COL_REASONS, COL_SLOT, COL_TAG, FIELD_PREV_HASH, FIELD_TOKEN, Reason,
)

from kv_world import World, clone_ring, new_rows

LEN = 8
TAGS = (0, 2)  # the two parts' launch tags (a K and a V half's)


@pytest.fixture(params=["token", "block4"])
def two_halves(request, world_factory) -> tuple[World, list, torch.Tensor]:
    """Two stamped requests, and a second records tensor (the other half's) damaged at request a's
    position 5 (its token); request b's KV at position 3 is damaged under both halves."""
    w = world_factory(11, request.param, specs=((torch.bfloat16, 1, 32), (torch.float16, 4, 16)))
    reqs = [w.add_request(LEN), w.add_request(LEN, context_key=5)]
    assert w.step([(r, LEN) for r in reqs]) == []
    other = w.records.clone()
    other[w.slot(reqs[0], 5), FIELD_TOKEN] += 1
    w.kv_bytes(0, w.slot(reqs[1], 3))[0] ^= 0x01
    return w, reqs, other


def _run(w: World, view: K.ForwardView, records: list[torch.Tensor], how: str) -> tuple:
    """HEAD then RECHECK over both parts (read_hashes kept between them), on copies of the state:
    ``how`` is "parts" (one verify_view_parts launch a phase), "reference" (its reference) or
    "apart" (one verify_view launch a part). Returns the new rows, the ring and the read hashes."""
    ring, records = clone_ring(w.ring), [r.clone() for r in records]
    hashes = [torch.zeros(w.records.shape[0], dtype=torch.int64, device=w.device) for _ in records]
    start = int(ring.count)
    for after_forward in (False, True):
        parts = [K.ViewPart(r, w.sources, tag, h) for r, tag, h in zip(records, TAGS, hashes)]
        options = dict(window=0, max_context=w.max_context, check_tokens=True, sentinel=True,
                       after_forward=after_forward)
        if how == "apart":
            for part in parts:
                K.verify_view(part.records, part.sources, w.mapping, view, ring, part.tag,
                              read_hashes=part.read_hashes, **options)
        else:
            launch = K.verify_view_parts if how == "parts" else K.verify_view_parts_ref
            launch(parts, w.mapping, view, ring, **options)
    return new_rows(ring, start), ring, hashes


def test_the_halves_in_one_launch_log_what_a_launch_a_half_logs(two_halves):
    w, (a, b), other = two_halves
    view = w.head_view([a, b])
    rows, ring, hashes = _run(w, view, [w.records, other], "parts")
    for how in ("apart", "reference"):
        rows_, ring_, hashes_ = _run(w, view, [w.records, other], how)
        assert rows == rows_, how
        for name in ("count", "kernel_runs", "slot_runs"):
            assert torch.equal(getattr(ring, name), getattr(ring_, name)), (how, name)
        assert all(torch.equal(x, y) for x, y in zip(hashes, hashes_)), how
    found = {(r[COL_TAG], r[COL_SLOT], r[COL_POSITION], r[COL_REASONS]) for r in rows}
    token, kv = w.slot(a, 5), w.slot(b, 3)
    assert (TAGS[1], token, 5, Reason.VERIFY_TOKEN) in found  # the other half's record only
    assert not any(tag == TAGS[0] and slot == token for tag, slot, _, _ in found)
    assert {(tag, slot) for tag, slot, _, reasons in found if reasons & Reason.VERIFY_REAL_KV_HASH} == \
        {(TAGS[0], kv), (TAGS[1], kv)}  # the bytes both halves read, at HEAD


def test_no_part_is_refused_by_name(world):
    with pytest.raises(ValueError, match="parts must hold 1 to 2 ViewParts"):
        K.verify_view_parts([], world.mapping, world.head_view([]), world.ring, window=0,
                            max_context=world.max_context, check_tokens=True, sentinel=False)


def test_parts_of_another_slot_count_are_refused_by_name(world):
    req = world.add_request(4)
    world.step([(req, 4)])
    parts = [K.ViewPart(world.records, world.sources, 0), K.ViewPart(world.records[:-1].clone(), world.sources, 2)]
    with pytest.raises(ValueError, match=r"parts\[1\]\.records holds"):
        K.verify_view_parts(parts, world.mapping, world.head_view([req]), world.ring, window=0,
                            max_context=world.max_context, check_tokens=True, sentinel=False)


def _rows_parts(device: torch.device, n: int) -> list[K.RowsPart]:
    """A layer's new K (bf16, 2 heads x 32, the first 32 bytes) and V (fp16, 4 heads x 16, 16-byte
    samples every 32 bytes) for n tokens, seeded."""
    gen = torch.Generator().manual_seed(n)
    k = torch.randn(n, 2, 32, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(n, 4, 16, generator=gen).to(device, torch.float16)
    return [K.RowsPart(k, 32, torch.zeros(n, dtype=torch.int64, device=device)),
            K.RowsPart(v, 64, torch.zeros(n, dtype=torch.int64, device=device), 16, 32)]


@pytest.mark.parametrize("n", [1, 7, 300])
def test_a_layers_halves_hashed_in_one_launch_equal_a_launch_a_half(device, n):
    parts, reference = _rows_parts(device, n), _rows_parts(device, n)
    K.source_hash_rows_parts(parts)
    K.source_hash_rows_parts_ref(reference)
    for part, ref in zip(parts, reference):
        alone = torch.zeros_like(part.out)
        K.source_hash_rows(part.rows, part.read_bytes, alone, sample_offset=part.sample_offset,
                           sample_stride=part.sample_stride)
        assert torch.equal(part.out, alone) and torch.equal(part.out, ref.out)
        assert part.out.ne(0).all()


def test_halves_of_other_token_counts_are_refused_by_name(device):
    parts = _rows_parts(device, 4)
    parts[1] = parts[1]._replace(rows=parts[1].rows[:3], out=parts[1].out[:3])
    for launch in (K.source_hash_rows_parts, K.source_hash_rows_parts_ref):
        with pytest.raises(ValueError, match=r"parts\[1\]\.rows has 3 rows"):
            launch(parts)


def _stamp(w: World, view: K.ForwardView, records: list[torch.Tensor], how: str,
           written: torch.Tensor | None) -> tuple:
    """TAIL over both parts on copies of the state, as in `_run`; returns the new rows, the ring and
    the records."""
    ring, records = clone_ring(w.ring), [r.clone() for r in records]
    start = int(ring.count)
    parts = [K.StampPart(r, w.sources, tag, written) for r, tag in zip(records, TAGS)]
    options = dict(check_tokens=True, check_write_inputs=True)
    if how == "apart":
        for part in parts:
            K.stamp_view(part.records, part.sources, w.mapping, view, ring, part.tag,
                         written_source_hashes=part.written_source_hashes, **options)
    else:
        (K.stamp_view_parts if how == "parts" else K.stamp_view_parts_ref)(parts, w.mapping, view, ring, **options)
    return new_rows(ring, start), ring, records


@pytest.mark.parametrize("with_written", [False, True])
def test_the_halves_stamped_in_one_launch_equal_a_stamp_a_half(two_halves, with_written):
    """The other half's records differ at request a's last cached position (its token), so each
    part's chain starts from its own seed record; a position the forward was fed wrong is a
    write_position in both halves."""
    w, (a, b), _ = two_halves
    other = w.records.clone()
    other[w.slot(a, LEN - 1), FIELD_TOKEN] += 1
    a.tokens += w.random_tokens(3)
    b.tokens += w.random_tokens(2)
    fwd = w.forward([(a, 3), (b, 2)])
    fwd.view.positions[1] += 1
    w.write(fwd)
    written = None
    if with_written:
        written = torch.stack([K.source_hash_ref(src, torch.tensor(w.slots(a, LEN, LEN + 3) + w.slots(b, LEN, LEN + 2),
                                                                   device=w.device))
                               for src in w.sources])
    rows, ring, records = _stamp(w, fwd.view, [w.records, other], "parts", written)
    for how in ("apart", "reference"):
        rows_, ring_, records_ = _stamp(w, fwd.view, [w.records, other], how, written)
        assert rows == rows_, how
        assert all(torch.equal(x, y) for x, y in zip(records, records_)), how
        for name in ("count", "kernel_runs", "slot_runs"):
            assert torch.equal(getattr(ring, name), getattr(ring_, name)), (how, name)
    new = w.slots(a, LEN, LEN + 3)
    assert not torch.equal(records[0][new, FIELD_PREV_HASH], records[1][new, FIELD_PREV_HASH])
    assert {(r[COL_TAG], r[COL_SLOT], r[COL_REASONS]) for r in rows} >= {
        (tag, w.slot(a, LEN + 1), Reason.WRITE_POSITION) for tag in TAGS}
