"""SweepPlan: a walk is checked and planned again only when the columns the plan reads changed (a
paged walk: its version), and a paged walk is planned as its entries are."""

import pytest
import torch

from kvcanary_kernels.records import PREV_SKIP
from pytest_kvcanary.canary import plans
from pytest_kvcanary.canary.seam import PagedWalk
from pytest_kvcanary.canary.walk import paged_entries


def _planned_walks(monkeypatch) -> list:
    checked = []
    check_walk = plans.check_walk

    def counting(walk, space):
        checked.append(walk)
        return check_walk(walk, space)

    monkeypatch.setattr(plans, "check_walk", counting)
    return checked


@pytest.mark.parametrize("window", [None, 3])
def test_a_walk_whose_locks_alone_changed_is_planned_again_only_for_an_unlocked_only_sweep(make_host, monkeypatch,
                                                                                            window):
    host = make_host(window=window, sweep_interval=0)
    host.forward({0: [5, 6, 7, 8], 1: [9, 10]})
    host.cached = [(0, 4), (1, 2)]
    checked = _planned_walks(monkeypatch)
    walk = host.cache_walk()
    plan = plans.SweepPlan(host.runtime.groups, host.groups[0].num_slots, host.runtime.device)
    plan.refresh(walk, unlocked_only=False)
    held = plan.entries[host.groups[0].kind].slots.clone()
    relocked = walk._replace(locked=torch.ones_like(walk.locked))  # every slot now held by a request
    plan.refresh(relocked, unlocked_only=False)
    assert len(checked) == 1 and torch.equal(plan.entries[host.groups[0].kind].slots, held)
    plan.refresh(relocked, unlocked_only=True)
    assert len(checked) == 2 and not plan.entries[host.groups[0].kind].slots.any()  # nothing unlocked
    plan.refresh(relocked, unlocked_only=True)
    assert len(checked) == 2
    plan.refresh(relocked._replace(slots=relocked.slots.clone()), unlocked_only=True)  # another tensor
    assert len(checked) == 3


def _entries_by_slot(entries) -> dict[int, tuple[int, int, int]]:
    """slot -> (position, prev slot, token) of the planned entries that are checked (slot != 0)."""
    rows = zip(*(column.tolist() for column in (entries.slots, entries.positions, entries.prev_slots, entries.tokens)))
    return {slot: tuple(rest) for slot, *rest in rows if slot}


@pytest.mark.parametrize("unlocked_only", [False, True])
def test_a_paged_walk_is_planned_on_the_device_as_its_entries_are_and_again_only_when_its_version_changes(
        make_host, monkeypatch, unlocked_only):
    host = make_host(sweep_interval=0)
    space, page = host.groups[0].num_slots, 4
    pages = space // page
    first, prev = torch.full((pages,), -1), torch.full((pages,), -1)
    # page 3 then page 5 (a chain), page 1 after the reserved slot 0 (its predecessor is not checked)
    first[[3, 5, 1]], prev[[3, 5, 1]] = torch.tensor([0, 4, 1]), torch.tensor([-1, 15, 0])
    locked = torch.zeros(pages, dtype=torch.bool)
    locked[5] = True
    paged = PagedWalk(page, first, prev, torch.arange(space) + 100, locked, version=700)
    checked = _planned_walks(monkeypatch)
    plan = plans.SweepPlan(host.runtime.groups, space, host.runtime.device)
    plan.refresh(paged, unlocked_only)
    expected = plans.walk_entries(paged_entries(paged), space, torch.device("cpu"), unlocked_only=unlocked_only)
    entries = plan.entries[host.groups[0].kind]
    planned = _entries_by_slot(entries)
    assert planned == _entries_by_slot(expected) and len(planned) == (8 if unlocked_only else 12)
    assert planned[4] == (1, PREV_SKIP, 104) and planned[12] == (0, -1, 112) and (entries.rows == -1).all()
    first[7], prev[7] = 0, -1  # updated in place, under the same version
    plan.refresh(paged._replace(version=700), unlocked_only)
    assert len(checked) == (2 if unlocked_only else 1) and (28 in _entries_by_slot(entries)) == unlocked_only
    plan.refresh(paged._replace(version=701), unlocked_only)
    assert len(checked) == (3 if unlocked_only else 2) and _entries_by_slot(entries)[28] == (0, -1, 128)
