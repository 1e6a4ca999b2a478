"""splitmix64 and the chain link in their three forms, and the real-KV fingerprint's sensitivity."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kvcanary_kernels as K
from kvcanary_kernels.hashing import CHAIN_HEAD_HASH_U64, as_i64, as_u64, head_hash, head_hash_torch, link, mix
from kvcanary_kernels.records import ANCHOR, Reason


@triton.jit
def _mix_kernel(x_ptr, out_ptr, link_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = as_u64(tl.load(x_ptr + offs, mask=m))
    tl.store(out_ptr + offs, as_i64(mix(x)), mask=m)
    tl.store(link_ptr + offs, as_i64(link(x, x + 1, x * 3)), mask=m)


def _edge_and_random(seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    edges = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), ANCHOR], dtype=torch.int64)
    return torch.cat([edges, torch.randint(-(2**63), 2**63 - 1, (58,), generator=gen, dtype=torch.int64)]).to(device)


def test_splitmix64_known_value():
    # First output of splitmix64 seeded with 0: mix(0 + golden gamma).
    assert K.mix_int(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert K.mix_int(0) == 0
    assert K.CHAIN_HEAD_HASH == K.to_signed(K.mix_int(ANCHOR)) == K.to_signed(CHAIN_HEAD_HASH_U64)
    assert K.head_hash_int(0) == CHAIN_HEAD_HASH_U64


@triton.jit
def _head_hash_kernel(keys_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, as_i64(head_hash(tl.load(keys_ptr + offs, mask=m))), mask=m)


def test_head_hash_int_torch_and_triton_agree(device):
    keys = _edge_and_random(seed=8, device=device)
    want = [K.to_signed(K.mix_int(ANCHOR ^ (k & (2**64 - 1)))) for k in keys.tolist()]
    assert [K.to_signed(K.head_hash_int(k)) for k in keys.tolist()] == want
    assert head_hash_torch(keys).tolist() == want
    out = torch.empty_like(keys)
    _head_hash_kernel[(1,)](keys, out, keys.numel(), BLOCK=64)
    assert out.tolist() == want
    assert len(set(want)) == len(want)  # every context key anchors its own chain


def test_mix_int_torch_and_triton_agree(device):
    x = _edge_and_random(seed=7, device=device)
    u = [v & (2**64 - 1) for v in x.tolist()]
    want = [K.to_signed(K.mix_int(v)) for v in u]
    want_link = [K.to_signed(K.link_int(v, v + 1, v * 3)) for v in u]
    assert K.mix_torch(x).tolist() == want
    assert K.link_torch(x, x + 1, x * 3).tolist() == want_link
    out, out_link = torch.empty_like(x), torch.empty_like(x)
    _mix_kernel[(1,)](x, out, out_link, x.numel(), BLOCK=64)
    assert out.tolist() == want
    assert out_link.tolist() == want_link


def test_links_compose_and_the_multiplier_inverts():
    """What the chain kernel's prefix scan relies on: a run of links is one affine map of the
    running hash (composed in order), and LINK_INVERSE takes an entry's term back out."""
    from kvcanary_kernels.hashing import LINK, LINK_INVERSE

    u64 = (1 << 64) - 1
    gen = torch.Generator().manual_seed(11)
    entries = torch.randint(0, 2**40, (12, 2), generator=gen).tolist()
    start = 0x1234_5678_9ABC_DEF0
    serial, m, a = start, 1, 0
    for token, position in entries:
        term = K.link_int(0, token, position)
        serial = K.link_int(serial, token, position)
        m, a = (m * LINK) & u64, (a * LINK + term) & u64
        assert (start * m + a) & u64 == serial
    assert (LINK * LINK_INVERSE) & u64 == 1
    h = K.link_int(start, 7, 3)
    assert ((h - K.link_int(0, 7, 3)) * LINK_INVERSE) & u64 == start


def _flip_pool(word_bytes: int, variants: list[torch.Tensor], device) -> tuple[K.RealKvSource, torch.Tensor]:
    """A source whose slot i+1 holds variants[i] (int64 words of one slot)."""
    rows = torch.zeros(len(variants) + 1, word_bytes // 8, dtype=torch.int64)
    rows[1:] = torch.stack(variants)
    source = K.RealKvSource(rows.to(device), page_size=1, num_bytes_per_token=word_bytes, read_bytes=word_bytes)
    return source, torch.arange(1, len(variants) + 1, device=device)


def _key_cancelling_word(i: int) -> int:
    """The word whose halves plus word i's key halves are both 0 mod 2**32 (a zero term factor)."""
    key = K.mix_int(i + 1)
    low, high = -key & 0xFFFFFFFF, -(key >> 32) & 0xFFFFFFFF
    return K.to_signed(high << 32 | low)


@pytest.mark.parametrize("words", ["random", "key-cancelling"])
def test_fingerprint_changes_on_every_single_bit_flip(world_factory, words):
    w = world_factory(3)
    base = torch.randint(-(2**62), 2**62, (4,), generator=w.gen, dtype=torch.int64)
    if words == "key-cancelling":  # a plain product of the keyed halves would miss flips here
        base = torch.tensor([_key_cancelling_word(i) for i in range(4)], dtype=torch.int64)
    variants = [base]
    for bit in range(4 * 64):
        flipped = base.clone()
        flipped[bit // 64] ^= K.to_signed(1 << (bit % 64))
        variants.append(flipped)
    source, slots = _flip_pool(32, variants, w.device)
    fp = K.fingerprint_ref([source], slots)
    assert (fp[1:] != fp[0]).all()
    _assert_kernel_fingerprint_matches([source], slots, fp)


def test_fingerprint_changes_on_every_swap_of_two_words(world_factory):
    w = world_factory(4)
    base = torch.randint(-(2**62), 2**62, (6,), generator=w.gen, dtype=torch.int64)
    variants = [base]
    for i in range(6):
        for j in range(i + 1, 6):
            swapped = base.clone()
            swapped[[i, j]] = base[[j, i]]
            variants.append(swapped)
    source, slots = _flip_pool(48, variants, w.device)
    fp = K.fingerprint_ref([source], slots)
    assert (fp[1:] != fp[0]).all()
    _assert_kernel_fingerprint_matches([source], slots, fp)


def test_fingerprint_depends_on_source_order(world_factory):
    w = world_factory(5, specs=((torch.float16, 1, 16), (torch.float32, 1, 8)))
    slots = torch.arange(1, 9, device=w.device)
    assert not torch.equal(K.fingerprint_ref(w.sources, slots), K.fingerprint_ref(w.sources[::-1], slots))
    assert torch.equal(K.fingerprint_ref([], slots), torch.zeros_like(slots))


def _assert_kernel_fingerprint_matches(sources, slots, want):
    """The write-through kernel hashes the same bytes as rows: one source folds to mix(hash)."""
    (source,) = sources
    out = torch.empty(source.tensor.shape[0], dtype=torch.int64, device=slots.device)
    K.source_hash_rows(source.tensor, source.read_bytes, out)
    assert torch.equal(K.mix_torch(out[slots]), want)


def _byte_flip_rows(world_factory, mode: str, byte: int) -> list[tuple[int, ...]]:
    w = world_factory(6, specs=((torch.bfloat16, 1, 32, mode),))  # 64 bytes per slot
    req = w.add_request(6)
    assert w.step([(req, 6)]) == []
    w.kv_bytes(0, w.slot(req, 2))[byte] ^= 0x10
    return w.verify(w.head_view([req]))


def test_partial_mode_reads_only_the_first_16_bytes(world_factory):
    assert _byte_flip_rows(world_factory, "partial", byte=20) == []
    assert len(_byte_flip_rows(world_factory, "partial", byte=15)) == 1


def test_partial_mode_deals_every_kv_head_over_the_sampled_layers(world_factory):
    """4 KV heads of 32 bytes over 2 sampled layers: layer 0 reads heads 0, 2, layer 1 heads 1, 3;
    a flip in the first 16 bytes of any head of a slot is seen, one past them is not."""
    specs = ((torch.bfloat16, 1, 64, "partial", 0, 4, (0, 2)), (torch.bfloat16, 1, 64, "partial", 0, 4, (1, 2)))
    assert [(s.sample_offset, s.sample_stride, s.read_bytes) for s in world_factory(7, specs=specs).sources] \
        == [(0, 64, 32), (32, 64, 32)]
    for head in range(4):
        for byte, seen in ((head * 32, True), (head * 32 + 15, True), (head * 32 + 16, False)):
            w = world_factory(7, specs=specs)
            req = w.add_request(6)
            assert w.step([(req, 6)]) == []
            w.kv_bytes(head % 2, w.slot(req, 2))[byte] ^= 0x10
            assert len(w.verify(w.head_view([req]))) == int(seen), (head, byte)


def test_all_mode_catches_a_flip_past_byte_16(world_factory):
    rows = _byte_flip_rows(world_factory, "all", byte=20)
    assert [r[0] for r in rows] == [Reason.VERIFY_REAL_KV_HASH]


# (spec, slots per tile, bytes per sample): feature-major pages (vLLM's CPU K; in an FP8 cache one
# byte a value), and tiled packed ones (its AMX path: K in 16-slot tiles of dimension pairs, V in
# slot pairs)
PACKED = {
    "feature-major": ((torch.bfloat16, 8, 32, "all", 0, 1, (0, 1), True), 0, 2),
    "fp8-feature-major": ((torch.float8_e4m3fn, 16, 32, "all", 0, 1, (0, 1), True), 0, 1),
    "amx-k": ((torch.bfloat16, 32, 32, "all", 0, 1, (0, 1), True, 16, 2), 16, 4),
    "amx-v": ((torch.bfloat16, 32, 32, "all", 0, 1, (0, 1), True, 2), 2, 2),
}


@pytest.mark.parametrize("packing", PACKED)
@pytest.mark.parametrize("mode", ["partial", "all"])
def test_a_packed_page_is_read_feature_by_feature(world_factory, packing, mode):
    """A page keeping its slots' features apart (feature-major, or tiled and packed): a flip in a
    feature the mode reads changes that slot's fingerprint alone, one past them changes nothing,
    and each slot's features hash as they would as one contiguous run (what write-through hashes)."""
    spec, tile, sample_bytes = PACKED[packing]
    elem = spec[0].itemsize
    features_read = 16 // elem if mode == "partial" else 32  # partial: the first 16 bytes
    w = world_factory(8, specs=((*spec[:3], mode, *spec[4:]),))
    (source,) = w.sources
    assert (source.tile, source.sample_bytes, source.read_bytes) == (tile, sample_bytes, elem * features_read)
    slots = torch.arange(1, 128, device=w.device)
    runs = torch.stack([w.kv_bytes(0, s).reshape(-1) for s in range(128)]).view(spec[0])  # features in order
    out = torch.empty(runs.shape[0], dtype=torch.int64, device=w.device)
    K.source_hash_rows(runs, source.read_bytes, out, **dict(zip(("sample_offset", "sample_stride"), source.row_read())))
    before = K.fingerprint_ref([source], slots)
    assert torch.equal(K.mix_torch(out[slots]), before)
    page = source.page_size
    for slot in (page - 1, page + (tile or 1) + 1):
        for feature, seen in ((0, True), (features_read - 1, True), (features_read, False)):
            if feature == 32:
                continue
            samples = w.kv_bytes(0, slot)  # [samples, sample bytes]
            per = sample_bytes // elem  # features a sample
            at = feature // per, elem * (feature % per) + elem - 1  # the feature's top byte
            samples[at] ^= 0x10
            after = K.fingerprint_ref([source], slots)
            changed = (after != before).nonzero().flatten().add(1).tolist()
            assert changed == ([slot] if seen else []), (slot, feature, changed)
            samples[at] ^= 0x10
