"""The selection check (SELECT of an INDEXER group) against its torch reference, on fresh seeded
random mappings and selections with random damage (a stale slot, a foreign slot, a position the
query cannot see): the same rows and counters, and exactly the damaged entries reported."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels import (
    ForwardView, SelectedInputs, SlotMapping, ViolationRing, map_slot_ref, verify_selected, verify_selected_ref,
)
from kvcanary_kernels.records import (
    COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STORED, RECORD_WIDTH, GroupKind, Half, Phase,
    Reason, launch_tag,
)

from kv_world import DEVICE

TAG = launch_tag(Phase.SELECT, Half.K, GroupKind.INDEXER)
NUM_SLOTS = 512


def _case(seed: int, page_size: int, topk: int):
    """A batch of rows over a random mapping, each token's clean selection (a random subset of its
    visible positions, -1 past them), a damaged copy and the damaged (token, k) entries."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 6, 64 // page_size
    table = torch.randint(1, NUM_SLOTS // page_size, (rows, cols), generator=g)
    mapping = SlotMapping(table.to(DEVICE), page_size)
    batch = torch.randperm(rows, generator=g)[:4]
    prefix = torch.randint(0, 40, (4,), generator=g)
    extend = torch.randint(1, 6, (4,), generator=g)
    extend[2] = 0  # a padded row
    positions, slots, owner = [], [], []
    for b in range(4):
        for j in range(int(extend[b])):
            query = int(prefix[b]) + j
            chosen = torch.randperm(query + 1, generator=g)[:topk].sort().values
            pos = torch.full((topk,), -1, dtype=torch.int64)
            pos[:chosen.numel()] = chosen
            row = torch.full((topk,), int(batch[b]))
            slot = torch.where(pos >= 0, map_slot_ref(mapping, row.to(DEVICE), pos.to(DEVICE), NUM_SLOTS).cpu(), 0)
            positions.append(pos), slots.append(slot), owner.append(query)
    positions, slots = torch.stack(positions), torch.stack(slots)
    clean = SelectedInputs(positions.clone(), slots.clone())
    damaged = set()
    for kind in ("stale", "foreign", "future"):
        t = int(torch.randint(positions.shape[0], (), generator=g))
        k = 0
        if kind == "stale":
            slots[t, k] = slots[t, k] % (NUM_SLOTS - 1) + 1  # another slot: freed, or someone else's
        elif kind == "foreign":
            slots[t, k] = int(table[(int(batch[0]) + 1) % rows, 0]) * page_size  # another row's first slot
        else:
            positions[t, k] = owner[t] + 1 + int(torch.randint(4, (), generator=g))
        damaged.add((t, k))
    view = ForwardView(batch.to(DEVICE), prefix.to(DEVICE), extend.to(DEVICE),
                       torch.zeros(positions.shape[0], dtype=torch.int64, device=DEVICE),
                       torch.zeros(positions.shape[0], dtype=torch.int64, device=DEVICE),
                       selected=SelectedInputs(positions.to(DEVICE), slots.to(DEVICE)))
    records = torch.zeros(NUM_SLOTS, RECORD_WIDTH, dtype=torch.int64, device=DEVICE)
    return mapping, view, records, clean, damaged


@pytest.mark.parametrize("seed,page_size,topk", [(1, 1, 4), (2, 16, 8), (3, 4, 3), (4, 1, 16)])
def test_the_kernel_and_its_reference_log_the_same_rows(seed, page_size, topk):
    mapping, view, records, clean, damaged = _case(seed, page_size, topk)
    rings = {}
    clean_view = ForwardView(view.rows, view.prefix_lens, view.extend_lens, view.input_ids, view.positions,
                             selected=SelectedInputs(clean.positions.to(DEVICE), clean.slots.to(DEVICE)))
    for name, launch in (("kernel", verify_selected), ("reference", verify_selected_ref)):
        ring = rings[name] = ViolationRing(256, DEVICE)
        launch(records, mapping, view, ring, TAG)
        launch(records, mapping, clean_view, ring, TAG)  # clean: counted, nothing logged
    kernel, ref = (sorted(map(tuple, r.rows[:int(r.count)].tolist())) for r in rings.values())
    assert kernel == ref
    positions, slots = (t.cpu() for t in view.selected)
    # every damaged entry that changed its selection is reported, at its slot and position, and nothing else
    changed = {(t, k) for t, k in damaged
               if (positions[t, k], slots[t, k]) != (clean.positions[t, k], clean.slots[t, k])}
    assert changed and {(row[COL_SLOT], row[COL_POSITION]) for row in kernel} == {
        (int(slots[t, k]), int(positions[t, k])) for t, k in changed}
    for row in kernel:
        assert row[COL_REASONS] == Reason.VERIFY_INDEX and row[COL_STORED] == row[COL_SLOT]
        assert row[COL_ROW] in view.rows.tolist() and row[COL_EXPECTED] != row[COL_STORED]
    used = int((clean.positions != -1).sum())
    for ring in rings.values():
        assert int(ring.kernel_runs[TAG]) == 2 and int(ring.slot_runs[TAG]) == 2 * used


def test_bad_selection_args_raise_naming_the_argument():
    mapping, view, records, clean, _ = _case(5, 1, 4)
    ring = ViolationRing(8, DEVICE)
    bad = ForwardView(view.rows, view.prefix_lens, view.extend_lens, view.input_ids, view.positions,
                      selected=SelectedInputs(view.selected.positions[:-1], view.selected.slots[:-1]))
    none = ForwardView(view.rows, view.prefix_lens, view.extend_lens, view.input_ids, view.positions)
    for launch in (verify_selected, verify_selected_ref):
        with pytest.raises(ValueError, match=r"ForwardView.selected.positions must be a contiguous int64 tensor"):
            launch(records, mapping, bad, ring, TAG)
        with pytest.raises(ValueError, match="ForwardView.selected is None"):
            launch(records, mapping, none, ring, TAG)
