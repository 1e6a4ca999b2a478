"""A recurrent state's records (a hybrid model's STATE group), chained onto the FULL record of the
state's last token: state_launch (HEAD and TAIL over a forward's rows) and verify_records with
prev_records (the sweep's checkpoints), kernels == torch references bit for bit on fresh random
inputs, and each kind of damage reported with its reason at its slot."""

from __future__ import annotations

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import FIELD_POSITION, FIELD_PREV_HASH, FIELD_TOKEN, UNKNOWN, GroupKind, Half, Phase, Reason
from kvcanary_kernels.records import launch_tag

from kv_world import DEVICE, clone_ring, new_rows, random_bits

STATE_SLOTS, FULL_SLOTS, ROWS, COLS = 40, 96, 6, 12
HEAD = launch_tag(Phase.HEAD, Half.K, GroupKind.STATE)
TAIL = launch_tag(Phase.TAIL, Half.K, GroupKind.STATE)
SWEEP = launch_tag(Phase.SWEEP, Half.K, GroupKind.STATE)


class World:
    """Two state layers ([slots, 3, 48] and [slots, 4, 256] float32, a hybrid model's conv and
    flattened matrix states), noisy state and FULL records, a FULL block table of pages of 4 (some
    entries the null block), and a batch: distinct state slots (slot 0 among them at times), rows,
    lengths (0 at times) and extends; `width` more entries per row ([B], or [B, width] as a
    speculative decode's rollback states, when width > 1)."""

    def __init__(self, seed: int, mode: str, batch: int = 10, width: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layers = [random_bits(gen, (STATE_SLOTS, 3, 48), torch.float32).to(DEVICE),
                       random_bits(gen, (STATE_SLOTS, 4, 256), torch.float32).to(DEVICE)]
        sources = [K.layer_source(layer, 1, K.RealDataMode(mode), share=(j, 2)) for j, layer in enumerate(self.layers)]
        self.sources = [s for s in sources if s is not None]
        self.records = torch.randint(-(2**62), 2**62, (STATE_SLOTS, 4), generator=gen).to(DEVICE)
        self.full = torch.randint(-(2**62), 2**62, (FULL_SLOTS, 4), generator=gen).to(DEVICE)
        table = torch.randint(0, FULL_SLOTS // 4, (ROWS, COLS), generator=gen)
        self.mapping = K.SlotMapping(table.to(DEVICE), page_size=4)
        self.rows = torch.randint(0, ROWS, (batch,), generator=gen).to(DEVICE)
        distinct = torch.randperm(STATE_SLOTS, generator=gen)
        shape = (batch, width) if width > 1 else (batch,)
        self.slots = distinct[:batch].to(DEVICE)
        self.more_slots = distinct[batch:batch * (1 + width)].view(shape).to(DEVICE)
        self.more_lengths = torch.randint(1, COLS * 4, shape, generator=gen).to(DEVICE)
        self.lengths = torch.where(torch.rand(batch, generator=gen) < 0.2, 0,
                                   torch.randint(1, COLS * 4, (batch,), generator=gen)).to(DEVICE)
        self.extend = torch.randint(0, 5, (batch,), generator=gen).to(DEVICE)

    def launch(self, tag: int, *, stamp: bool, extend: torch.Tensor | None = None,
               more: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[tuple[int, ...]]:
        """The kernel and its reference on copies; asserts records, counters and rows agree."""
        ring = K.ViolationRing(256, DEVICE)
        ref_records, ref_ring = self.records.clone(), clone_ring(ring)
        args = (self.sources, self.full, self.mapping, self.rows, self.slots, self.lengths)
        K.state_launch_ref(ref_records, *args, ref_ring, tag, stamp=stamp, extend=extend, more=more)
        K.state_launch(self.records, *args, ring, tag, stamp=stamp, extend=extend, more=more)
        assert torch.equal(self.records, ref_records)
        for name in ("count", "kernel_runs", "slot_runs"):
            assert torch.equal(getattr(ring, name), getattr(ref_ring, name)), name
        rows = new_rows(ring, 0)
        assert rows == new_rows(ref_ring, 0)
        return rows


@pytest.mark.parametrize("mode", ["none", "partial", "all"])
@pytest.mark.parametrize("seed, width", [(31, 1), (32, 1), (33, 3)])
def test_head_and_tail_match_their_references(seed, width, mode):
    w = World(seed, mode, width=width)
    assert w.launch(HEAD, stamp=False), "noise records pass HEAD"
    w.launch(TAIL, stamp=True, extend=w.extend, more=(w.more_slots, w.more_lengths))  # running states, checkpoints
    w.lengths += w.extend
    assert w.launch(HEAD, stamp=False) == [], "a state just stamped fails HEAD"
    assert w.launch(HEAD, stamp=False, more=(w.more_slots, w.more_lengths)) == [], "a checkpoint just stamped fails"
    w.layers[1][int(w.slots[w.slots != 0][0])].view(torch.int32)[0, 0] ^= 1 << 9
    w.records[:, FIELD_POSITION] += (torch.arange(STATE_SLOTS, device=DEVICE) % 7 == 3)
    assert w.launch(HEAD, stamp=False), "no damage reported"


def test_a_stamped_state_chains_onto_its_last_tokens_full_record():
    """The record says the prefix: the token of the FULL record of its last token, its length, and
    that record's successor hash; the initial state (length 0) the head hash of context 0."""
    w = World(5, "all", batch=2)
    w.rows[:], w.slots[:], w.lengths[:] = torch.tensor([2, 3]), torch.tensor([7, 8]), torch.tensor([17, 0])
    w.launch(TAIL, stamp=True)
    last = int(w.mapping.table[2, 16 // 4]) * 4 + 16 % 4
    assert int(w.records[7, FIELD_TOKEN]) == int(w.full[last, FIELD_TOKEN]) and int(w.records[7, FIELD_POSITION]) == 17
    link = K.link_int(int(w.full[last, FIELD_PREV_HASH]), int(w.full[last, FIELD_TOKEN]), int(w.full[last, FIELD_POSITION]))
    assert int(w.records[7, FIELD_PREV_HASH]) == K.to_signed(link)
    assert (int(w.records[8, FIELD_TOKEN]), int(w.records[8, FIELD_POSITION])) == (UNKNOWN, 0)
    assert int(w.records[8, FIELD_PREV_HASH]) == K.to_signed(K.head_hash_int(0))


@pytest.mark.parametrize("damage, reason", [
    ("bytes", Reason.VERIFY_REAL_KV_HASH),
    ("another prefix", Reason.VERIFY_CHAIN_HASH),
    ("another length", Reason.VERIFY_POSITION),
])
def test_each_damage_is_reported_at_its_slot(damage, reason):
    """A state stamped for its row's prefix, then: a bit of its bytes flipped; read for a row whose
    last token's FULL record is another one (another prefix); read at another length."""
    w = World(7, "all", batch=1)
    w.rows[:], w.slots[:], w.lengths[:] = 2, 6, 30
    w.launch(TAIL, stamp=True)
    if damage == "bytes":
        w.layers[1][6].view(torch.int32)[1, 20] ^= 1 << 20
    elif damage == "another prefix":
        w.rows[:] = 4
    else:
        w.lengths[:] = 31
    rows = w.launch(HEAD, stamp=False)
    assert len(rows) == 1
    reasons, _, _, slot, position, row = rows[0][:6]
    assert reasons & reason and (slot, position, row) == (6, int(w.lengths[0]), int(w.rows[0]))


def test_the_sweep_checks_a_checkpoint_against_another_groups_record():
    """verify_records with prev_records: each entry's predecessor is read from the FULL records."""
    w = World(9, "partial", batch=3)
    w.launch(TAIL, stamp=True)
    prev = K.mapping_slot_ref(w.mapping, w.rows, w.lengths - 1)
    entries = K.VerifyEntries(w.slots, w.lengths, torch.where(w.lengths > 0, prev, -1), torch.full_like(w.slots, UNKNOWN),
                              torch.full_like(w.slots, -1), torch.zeros_like(w.slots))
    ring, ref_ring = K.ViolationRing(16, DEVICE), K.ViolationRing(16, DEVICE)
    K.verify_records(w.records, entries, w.sources, ring, SWEEP, check_tokens=False, prev_records=w.full)
    K.verify_records_ref(w.records.clone(), entries, w.sources, ref_ring, SWEEP, check_tokens=False, prev_records=w.full)
    assert new_rows(ring, 0) == new_rows(ref_ring, 0) == []
    w.full[prev[w.lengths > 0][0], FIELD_TOKEN] += 1  # the path's last token is another one now
    K.verify_records(w.records, entries, w.sources, ring, SWEEP, check_tokens=False, prev_records=w.full)
    assert [r[0] & Reason.VERIFY_CHAIN_HASH for r in new_rows(ring, 0)] != []


def test_prev_records_of_another_shape_is_refused():
    w = World(9, "none")
    with pytest.raises(ValueError, match="records must be"):
        K.state_launch(w.records, w.sources, w.full[:, :3], w.mapping, w.rows, w.slots, w.lengths,
                       K.ViolationRing(4, DEVICE), TAIL, stamp=True)
