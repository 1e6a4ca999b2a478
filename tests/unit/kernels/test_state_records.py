"""Records that chain onto another group's (a recurrent state's onto the FULL record of its last
token): stamp_records and verify_records with prev_records, kernels == torch references bit for bit
on fresh random inputs, and each kind of damage reported with its reason at its slot."""

from __future__ import annotations

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import (
    FIELD_POSITION, FIELD_PREV_HASH, FIELD_TOKEN, PREV_CHAIN_HEAD, UNKNOWN, Half, Phase, GroupKind, Reason,
    launch_tag,
)

from kv_world import DEVICE, clone_ring, new_rows, random_bits

STATE_SLOTS, FULL_SLOTS = 40, 96
HEAD = launch_tag(Phase.HEAD, Half.K, GroupKind.STATE)
TAIL = launch_tag(Phase.TAIL, Half.K, GroupKind.STATE)


def _world(seed: int, mode: str):
    """Two state layers ([slots, 3, 48] and [slots, 4, 16, 16] float32, as a hybrid model's conv and
    matrix states), noisy state records and FULL records, and random entries: distinct state slots
    (slot 0 among them at times), lengths, FULL slots of the last token (some PREV_CHAIN_HEAD), context keys."""
    gen = torch.Generator().manual_seed(seed)
    layers = [random_bits(gen, (STATE_SLOTS, 3, 48), torch.float32).to(DEVICE),
              random_bits(gen, (STATE_SLOTS, 4, 16, 16), torch.float32).to(DEVICE)]
    sources = [K.layer_source(layer, 1, K.RealDataMode(mode), share=(j, 2)) for j, layer in enumerate(layers)]
    sources = [s for s in sources if s is not None]
    records = torch.randint(-(2**62), 2**62, (STATE_SLOTS, 4), generator=gen).to(DEVICE)
    full = torch.randint(-(2**62), 2**62, (FULL_SLOTS, 4), generator=gen).to(DEVICE)
    n = 24
    slots = torch.randperm(STATE_SLOTS, generator=gen)[:n]
    lengths = torch.randint(0, 200, (n,), generator=gen)
    prev = torch.where(lengths > 0, torch.randint(1, FULL_SLOTS, (n,), generator=gen), PREV_CHAIN_HEAD)
    tokens = torch.where(torch.rand(n, generator=gen) < 0.3, torch.randint(0, 500, (n,), generator=gen), UNKNOWN)
    entries = K.VerifyEntries(slots, lengths, prev, tokens, torch.randint(-1, 8, (n,), generator=gen),
                              torch.randint(0, 3, (n,), generator=gen))
    return layers, sources, records, full, K.VerifyEntries(*(t.to(DEVICE) for t in entries))


def _both(kernel, reference, records, *args, **kw):
    """Runs the kernel and its reference on copies; asserts records, counters and rows agree."""
    ring = K.ViolationRing(256, DEVICE)
    ref_records, ref_ring = records.clone(), clone_ring(ring)
    reference(ref_records, *args[:-2], ref_ring, args[-1], **kw)
    kernel(records, *args[:-2], ring, args[-1], **kw)
    assert torch.equal(records, ref_records)
    for name in ("count", "kernel_runs", "slot_runs"):
        assert torch.equal(getattr(ring, name), getattr(ref_ring, name)), name
    rows = new_rows(ring, 0)
    assert rows == new_rows(ref_ring, 0)
    return rows


@pytest.mark.parametrize("mode", ["none", "partial", "all"])
@pytest.mark.parametrize("seed", [31, 32])
def test_stamp_and_verify_match_their_references(seed, mode):
    layers, sources, records, full, entries = _world(seed, mode)
    _both(K.stamp_records, K.stamp_records_ref, records, entries, sources, None, TAIL, prev_records=full)
    unknown = torch.full_like(entries.tokens, UNKNOWN)  # the stamp took the last token from the FULL record
    read = entries._replace(tokens=unknown)
    assert _both(K.verify_records, K.verify_records_ref, records, read, sources, None, HEAD, prev_records=full) == []
    layers[1][int(entries.slots[entries.slots != 0][0])].view(torch.int32)[0, 0, 0] ^= 1 << 9  # a flipped bit
    records[:, FIELD_POSITION] += (torch.arange(STATE_SLOTS, device=DEVICE) % 7 == 3)  # some lengths off
    rows = _both(K.verify_records, K.verify_records_ref, records, read, sources, None, HEAD, prev_records=full)
    assert rows, "no damage reported"


def test_a_stamped_state_chains_onto_its_last_tokens_full_record():
    """The record says the prefix: token and position of the FULL record of its last token, its
    successor hash as prev_hash; a chain head's prefix (length 0) the head hash of its context."""
    _, sources, records, full, _ = _world(5, "all")
    ring = K.ViolationRing(16, DEVICE)
    entries = K.VerifyEntries(*(torch.tensor(c, device=DEVICE) for c in (
        [3, 4], [17, 0], [9, PREV_CHAIN_HEAD], [UNKNOWN, UNKNOWN], [0, 1], [0, 5])))
    K.stamp_records(records, entries, sources, ring, TAIL, prev_records=full)
    assert int(records[3, FIELD_TOKEN]) == int(full[9, FIELD_TOKEN])
    assert int(records[3, FIELD_POSITION]) == 17
    link = K.link_int(int(full[9, FIELD_PREV_HASH]), int(full[9, FIELD_TOKEN]), int(full[9, FIELD_POSITION]))
    assert int(records[3, FIELD_PREV_HASH]) == K.to_signed(link)
    assert (int(records[4, FIELD_TOKEN]), int(records[4, FIELD_POSITION])) == (UNKNOWN, 0)
    assert int(records[4, FIELD_PREV_HASH]) == K.to_signed(K.head_hash_int(5))


@pytest.mark.parametrize("damage, reason", [
    ("bytes", Reason.VERIFY_REAL_KV_HASH),
    ("another prefix", Reason.VERIFY_CHAIN_HASH),
    ("another length", Reason.VERIFY_POSITION),
])
def test_each_damage_is_reported_at_its_slot(damage, reason):
    """A state stamped for its prefix, then: a bit of its bytes flipped; read for a row whose last
    token's FULL record is another one (another prefix); read at another length."""
    layers, sources, records, full, _ = _world(7, "all")
    ring = K.ViolationRing(16, DEVICE)
    stamped = K.VerifyEntries(*(torch.tensor(c, device=DEVICE) for c in ([6], [30], [12], [UNKNOWN], [2], [0])))
    K.stamp_records(records, stamped, sources, ring, TAIL, prev_records=full)
    slot, length, prev = 6, 30, 12
    if damage == "bytes":
        layers[1][slot].view(torch.int32)[1, 2, 3] ^= 1 << 20
    elif damage == "another prefix":
        prev = 13
    else:
        length = 31
    read = K.VerifyEntries(*(torch.tensor(c, device=DEVICE) for c in ([slot], [length], [prev], [UNKNOWN], [2], [0])))
    K.verify_records(records, read, sources, ring, HEAD, check_tokens=False, prev_records=full)
    rows = new_rows(ring, 0)
    assert len(rows) == 1
    reasons, _, _, at_slot, position, row = rows[0][:6]
    assert reasons & reason and (at_slot, position, row) == (slot, length, 2)


def test_prev_records_on_another_device_or_shape_is_refused():
    _, sources, records, full, entries = _world(9, "none")
    with pytest.raises(ValueError, match="records must be"):
        K.stamp_records(records, entries, sources, K.ViolationRing(4, DEVICE), TAIL, prev_records=full[:, :3])
