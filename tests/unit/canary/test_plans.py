"""SweepPlan: a walk is checked and planned again only when the columns the plan reads changed."""

import pytest
import torch

from pytest_kvcanary.canary import plans


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
