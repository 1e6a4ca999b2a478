"""Kernels == torch references, bit for bit, on random pools, mappings, forwards and corruptions.

Every launch goes through ``World.launch``, which runs the kernel and its reference on copies of
the same state and compares records, ring rows and counters.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels import view_stamp
from kvcanary_kernels.records import PREV_CHAIN_HEAD, PREV_SKIP, UNKNOWN, Reason

from kv_world import Forward, World, i64

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

LAYOUTS = {
    "none": ((BF16, 1, 64, "none"),),
    "1src-all": ((BF16, 1, 64),),
    "2src-paged-strided": ((BF16, 4, 64), (FP32, 2, 8, "partial", 4)),
    "3src": ((FP16, 16, 8), (BF16, 1, 24, "partial"), (FP32, 2, 4)),
    "4src-mixed": ((FP16, 1, 8), (BF16, 2, 16, "partial"), (FP32, 4, 12, "all", 4), (FP16, 8, 8)),
    # partial mode dealing 4 KV heads over 2 layers (heads 0, 2 and 1, 3: strided samples)
    "2src-heads": ((BF16, 2, 64, "partial", 8, 4, (0, 2)), (FP16, 1, 64, "partial", 0, 4, (1, 2))),
    # feature-major pages (vLLM's CPU K), read element by element, beside a page of runs
    "3src-feature-major": ((BF16, 4, 32, "all", 0, 1, (0, 1), True), (FP32, 2, 8, "partial", 4),
                           (FP16, 8, 16, "partial", 8, 1, (0, 1), True)),
    # feature-major pages of one byte a value (vLLM's CPU K in an FP8 cache), read byte by byte
    "2src-fp8-feature-major": ((torch.float8_e4m3fn, 16, 32, "all", 0, 1, (0, 1), True),
                               (torch.uint8, 4, 48, "partial", 0, 1, (0, 1), True)),
    # tiled, packed pages (vLLM's AMX path: K in 16-slot tiles of dimension pairs, V in slot pairs)
    "4src-tiled": ((BF16, 32, 32, "all", 0, 1, (0, 1), True, 16, 2), (BF16, 32, 32, "partial", 0, 1, (0, 1), True, 2),
                   (FP32, 2, 8, "partial", 4), (FP16, 8, 16, "all", 8, 1, (0, 1), True, 4, 4)),
}
# Small tiles walk a row's positions in several tiles and each slot's words in several chunks,
# the last one partial where read_words is not a multiple of the chunk.
TILINGS = {"default": None, "small": K.Tiling(block=32, chunk=4, num_warps=1)}
# The last column: HEAD keeps the last source's hashes and RECHECK compares with them (read_hashes).
CASES = [
    ("token", "1src-all", "default", 11, False),
    ("token", "4src-mixed", "small", 12, True),
    ("block4", "2src-paged-strided", "default", 13, False),
    ("block16", "3src", "small", 14, True),
    ("ring", "1src-all", "small", 15, True),
    ("ring-block4", "4src-mixed", "default", 16, False),
    ("full_to_group", "2src-paged-strided", "small", 17, True),
    ("full_to_group", "none", "default", 18, False),
    ("block4", "2src-heads", "small", 19, True),
    ("token", "2src-heads", "default", 20, False),
    ("block4", "3src-feature-major", "small", 21, True),
    ("token", "3src-feature-major", "default", 22, False),
    ("block16", "4src-tiled", "small", 23, True),
    ("token", "4src-tiled", "default", 24, False),
    ("block16", "2src-fp8-feature-major", "small", 25, True),
    ("block4", "2src-fp8-feature-major", "default", 26, False),
]


def _written_source_hashes(w: World, fwd: Forward, written: list[int]) -> torch.Tensor:
    """What the forward computed for each token (write-through), per source: the written slots'
    source hashes, a few of them wrong, anything for padding tokens, and spare columns past them."""
    n_tokens = fwd.view.input_ids.shape[0]
    hashes = torch.randint(-(2**62), 2**62, (len(w.sources), n_tokens + w.randint(0, 3)), generator=w.gen)
    hashes[:, : len(written)] = w.source_hashes(written).cpu()
    for _ in range(w.randint(0, 2)):
        if written:
            hashes[w.randint(0, len(w.sources)), w.randint(0, len(written))] ^= 1
    return hashes.to(w.device)


def _corrupt_write_inputs(w: World, view: K.ForwardView) -> K.ForwardView:
    """Random engine-input mismatches: positions that disagree with the batch, input ids that
    disagree with the token table."""
    n = int(view.extend_lens.sum())
    positions, input_ids = view.positions.clone(), view.input_ids.clone()
    for _ in range(w.randint(0, 3)):
        if n:
            positions[w.randint(0, n)] += 1
            input_ids[w.randint(0, n)] += 7
    return replace(view, positions=positions, input_ids=input_ids)


def _damage_inside_the_forward(w: World, fwd: Forward) -> None:
    """Sometimes a bit of a slot the forward read flips in one source, or slot 0's first byte."""
    read = sorted({s for req, prefix, _ in fwd.batch for s in w.slots(req, 0, prefix)} - {0})
    if not w.sources or w.randint(0, 2):
        return
    if read and w.randint(0, 3):
        w.flip_kv_bit(w.randint(0, len(w.sources)), read[w.randint(0, len(read))])
    else:
        w.kv_bytes(len(w.sources) - 1, 0)[0] ^= 0x40


def _forward(w: World, batch, window: int, tokens_known: bool, sentinel: bool) -> int:
    """HEAD, write (damaging a read slot at times), TAIL (with write-through and corrupted
    inputs), RECHECK; returns rows logged."""
    fwd = w.forward(batch, pad_rows=w.randint(0, 3), pad_tokens=w.randint(0, 4), known_tokens=tokens_known,
                    context=bool(w.randint(0, 4)))
    rows = w.verify(fwd.view, tag=0, window=window, sentinel=sentinel)
    written = w.write(fwd)
    _damage_inside_the_forward(w, fwd)
    view = _corrupt_write_inputs(w, fwd.view)
    hashes = _written_source_hashes(w, fwd, written) if w.sources and w.randint(0, 2) else None
    rows += w.stamp(view, tag=2, check_tokens=bool(w.randint(0, 4)), check_write_inputs=bool(w.randint(0, 4)),
                    written_source_hashes=hashes)
    rows += w.verify(fwd.view, tag=12, window=window, check_tokens=bool(w.randint(0, 2)), sentinel=sentinel,
                     after_forward=True)
    w.commit(fwd)
    w.ring.advance_step()
    return len(rows)


def _corrupt_state(w: World, reqs) -> None:
    """Random KV bit flips, record overwrites, mapping entries moved or dropped, slot 0 written."""
    live = sorted({s for r in reqs for s in w.slots(r, 0, r.cached)} - {0})
    for _ in range(4):
        slot = live[w.randint(0, len(live))]
        what = w.randint(0, 4)
        if what == 0 and w.sources:
            w.flip_kv_bit(w.randint(0, len(w.sources)), slot)
        elif what == 1:
            w.records[slot, w.randint(0, 4)] += w.randint(1, 1000)
        else:
            row = reqs[w.randint(0, len(reqs))].row
            col = w.randint(0, w.table.shape[1])
            w.table[row, col] = 0 if what == 2 else w.table[reqs[0].row, 0]
    if w.sources and w.randint(0, 2):
        w.kv_bytes(0, 0)[0] ^= 0x80


@pytest.mark.parametrize("mapping, layout, tiling, seed, read_hashes", CASES)
def test_view_kernels_match_reference(world_factory, mapping, layout, tiling, seed, read_hashes):
    w = world_factory(seed, mapping, specs=LAYOUTS[layout])
    w.tiling = TILINGS[tiling]
    if read_hashes:
        w.use_read_hashes()
    ring = w.kind.ring
    window = 8 if ring else w.randint(0, 2) * w.randint(1, 12)
    longest = 40 if ring else w.max_context  # a ring of 16 wraps
    roots = [w.add_request(w.randint(10, longest), context_key=w.randint(0, 2) * w.randint(1, 2**40))
             for _ in range(3)]
    sentinel, tokens_known = bool(seed % 2), bool(seed % 3)
    logged = 0
    # Chunked prefill (longer than a ring of 16 at times) and decode.
    while any(r.cached < len(r.tokens) for r in roots):
        batch = [(r, min(w.randint(1, 25), len(r.tokens) - r.cached))
                 for r in roots if r.cached < len(r.tokens)]
        logged += _forward(w, batch, window, tokens_known, sentinel)
    reqs = list(roots)
    if not ring:  # prefix reuse: a new row shares a root's first blocks
        page = w.kind.page_size
        root = roots[0]
        shared = page * w.randint(1, root.cached // page + 1) if root.cached >= page else 0
        derived = w.add_request(shared + w.randint(1, 6), prefix=root, shared=shared, context_key=root.context_key)
        logged += _forward(w, [(derived, len(derived.tokens) - shared)], window, tokens_known, sentinel)
        reqs.append(derived)
    assert logged > 0

    _corrupt_state(w, reqs)
    view = w.head_view(reqs, pad_rows=1)
    rows = w.verify(view, tag=8, window=window, sentinel=True)
    rows += w.verify(view, tag=9, window=0 if ring else 5, check_tokens=False)
    assert rows


def test_clean_forwards_log_nothing(world_factory):
    """No corruption, every option on: chunked prefill, prefix reuse, decode, padding."""
    for mapping in ("token", "block4", "full_to_group"):
        w = world_factory(21, mapping, specs=LAYOUTS["2src-paged-strided"])
        a, b = w.add_request(20, context_key=99), w.add_request(9)
        assert w.step([(a, 7), (b, 9)], pad_rows=2, pad_tokens=3) == []
        assert w.step([(a, 13), (b, 0)], pad_rows=1) == []
        c = w.add_request(16 + 3, prefix=a, shared=16, context_key=99)
        for _ in range(3):
            assert w.step([(c, 1)], window=4) == []
        view = w.head_view([a, b, c], pad_rows=2)
        assert w.verify(view, window=0, sentinel=True) == []
        assert w.verify(view, window=6, sentinel=True) == []
        assert int(w.ring.count) == 0


def _sweep_entries(w: World, reqs, pad: int) -> K.VerifyEntries:
    """SWEEP entries over the cached positions of each request, the last one's from a random start
    (a window start: chain skipped); tokens sometimes unknown."""
    cols: dict[str, list[int]] = {k: [] for k in K.VerifyEntries._fields}
    for req in reqs:
        start = w.randint(0, req.cached) if req is reqs[-1] else 0
        for p in range(start, req.cached):
            cols["slots"].append(w.slot(req, p))
            cols["positions"].append(p)
            cols["prev_slots"].append(PREV_CHAIN_HEAD if p == 0 else PREV_SKIP if p == start else w.slot(req, p - 1))
            cols["tokens"].append(req.tokens[p] if w.randint(0, 4) else UNKNOWN)
            cols["rows"].append(-1)
            cols["context_keys"].append(req.context_key)
    for values in cols.values():
        values.extend([0] * pad)
    return K.VerifyEntries(**{k: i64(v) for k, v in cols.items()})


@pytest.mark.parametrize("layout", ["none", "4src-mixed"])
def test_sweep_matches_reference(world_factory, layout):
    w = world_factory(31, specs=LAYOUTS[layout])
    reqs = [w.add_request(w.randint(3, 20), context_key=k) for k in (0, 12345, -7)]
    assert w.step([(r, len(r.tokens)) for r in reqs]) == []
    assert w.sweep(_sweep_entries(w, reqs, pad=3)) == []
    _corrupt_state(w, reqs)
    entries = _sweep_entries(w, reqs, pad=1)
    context = entries.context_keys.clone()
    context[entries.prev_slots == PREV_CHAIN_HEAD] += 1  # another context reused the cached KV
    assert w.sweep(entries._replace(context_keys=context))
    w.tiling = TILINGS["small"]
    assert w.sweep(entries, check_tokens=False)


@pytest.mark.parametrize("dtype, shape, read_bytes, sample_offset, sample_stride", [
    (BF16, (37, 4, 16), 128, 0, 16),
    (FP32, (5, 8), 16, 0, 16),
    (FP16, (70, 48), 48, 0, 16),
    (BF16, (37, 8, 16), 64, 32, 64),  # partial mode: heads 1, 3, 5, 7 of 8
])
def test_source_hash_rows_matches_reference_and_the_slot_fingerprint(device, dtype, shape, read_bytes,
                                                                     sample_offset, sample_stride):
    sampling = dict(sample_offset=sample_offset, sample_stride=sample_stride)
    gen = torch.Generator().manual_seed(41)
    padded = torch.randint(-(2**62), 2**62, (shape[0], 2 * 64), generator=gen).view(torch.uint8)
    width = torch.Size(shape[1:]).numel() * torch.empty(0, dtype=dtype).element_size()
    rows = padded[:, :width].view(dtype).view(shape).to(device)  # rows strided past their bytes
    out, ref = (torch.full((shape[0],), 5, dtype=torch.int64, device=device) for _ in range(2))
    K.source_hash_rows(rows, read_bytes, out, **sampling)
    K.source_hash_rows_ref(rows, read_bytes, ref, **sampling)
    assert torch.equal(out, ref)
    # A pool slot holding row t's bytes fingerprints as mix(out[t]) (one source).
    pool = K.RealKvSource(rows.contiguous().view(shape[0], -1), 1, width, read_bytes, **sampling)
    slots = torch.arange(shape[0], device=device)
    assert torch.equal(K.mix_torch(out), K.fingerprint_ref([pool], slots))
    K.source_hash_rows(rows, read_bytes, out, tiling=TILINGS["small"], **sampling)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mapping", ["token", "ring-block4"])
def test_lengths_outside_what_the_kernels_check_are_clamped_and_reported_as_the_reference_does(world_factory,
                                                                                              mapping):
    """A prefix outside [0, max_context] (verify) or an extend outside [0, T] (stamp) is clamped
    and reported once as view_out_of_range; rows and positions off the tables read nothing."""
    w = world_factory(21, mapping=mapping)
    reqs = [w.add_request(10), w.add_request(7)]
    assert w.step([(reqs[0], 6), (reqs[1], 4)]) == []
    fwd = w.forward([(reqs[0], 2), (reqs[1], 1)], pad_rows=2, pad_tokens=3)
    bad = replace(fwd.view, prefix_lens=i64([-3, w.max_context + 5, 1 << 40, 2]),
                            extend_lens=i64([-1, 1 << 40, 2, 0]), rows=i64([reqs[0].row, reqs[1].row, -1, 1 << 40]))
    out_of_range = int(Reason.VIEW_OUT_OF_RANGE)
    for after_forward in (False, True):
        rows = w.verify(bad, after_forward=after_forward)
        assert sorted(r[4] for r in rows if r[0] == out_of_range) == [-3, w.max_context + 5, 1 << 40]
    rows = w.stamp(bad)
    assert sorted(r[6] for r in rows if r[0] == out_of_range) == [-1, 1 << 40]


@pytest.mark.parametrize("mapping, layout, tiling, seed, read_hashes", CASES[::3])
def test_chains_scanned_over_several_tiles_match_reference(world_factory, monkeypatch, mapping, layout, tiling,
                                                           seed, read_hashes):
    """TAIL's chain carried from one scan tile to the next: tiles of 16 entries, rows of up to 64."""
    monkeypatch.setattr(view_stamp, "CHAIN_MAX_BLOCK", 16)
    test_view_kernels_match_reference(world_factory, mapping, layout, tiling, seed, read_hashes)
