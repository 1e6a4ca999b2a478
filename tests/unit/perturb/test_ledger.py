"""The ledger's bookkeeping: what counts as detecting a fault, and when a fault escaped."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import GroupKind

from pytest_kvcanary.canary.violation import Violation
from pytest_kvcanary.config import PerturbSpec
from pytest_kvcanary.perturb.ledger import Injection, Ledger

from perturb_support import make_handle, send_waves



def flip(slot: int = 10, step: int = 3, group: str = "full") -> Injection:
    return Injection(mode="real_kv_post_forward", side="single", group=group, slot=slot, full_slot=slot,
                     position=7, row=1, byte=2, step=step, half="K")


def remap(step: int = 3) -> Injection:
    return Injection(mode="req_to_token", side="single", group="full", slot=20, full_slot=20, position=7, row=1,
                     byte=-1, step=step)


def violation(slot: int, step: int, reasons: tuple[str, ...] = ("verify_real_kv_hash",), position: int = 7,
              row: int = 1, phase: str = "HEAD") -> Violation:
    return Violation(side="single", step=step, phase=phase, half="K", group="FULL", reasons=reasons, slot=slot,
                     position=position, row=row, stored=1, expected=2)


def test_a_flip_read_before_its_slot_was_freed_is_detected():
    ledger = Ledger()
    ledger.record(inj := flip())
    ledger.escape("single", GroupKind.FULL, {10}, "evicted from the radix cache", step=5)
    assert inj.status == "escaped"
    ledger.match([violation(10, step=4)])
    assert inj.status == "detected" and inj.latency == 1 and inj.cause == ""


def test_a_violation_after_the_free_is_about_the_slot_s_next_owner():
    ledger = Ledger()
    ledger.record(inj := flip())
    ledger.escape("single", GroupKind.FULL, {10}, "evicted from the radix cache", step=5)
    ledger.match([violation(10, step=2), violation(10, step=5), violation(11, step=4)])
    assert (inj.status, inj.cause) == ("escaped", "evicted from the radix cache")


def test_frees_are_followed_only_where_live_damage_can_escape():
    """A free is worth reading (a device sync) only in a group and side with damage escape() would
    still account for: none before an injection, none in another group or side, none once every
    copy is gone; a mapping fault (req_to_token) holds no damaged slot."""
    ledger = Ledger()
    assert not ledger.follows_frees("single", GroupKind.FULL)
    ledger.record(remap())
    assert not ledger.follows_frees("single", GroupKind.FULL)
    ledger.record(flip(group="swa"))
    assert ledger.follows_frees("single", GroupKind.SWA)
    assert not ledger.follows_frees("single", GroupKind.FULL) and not ledger.follows_frees("decode", GroupKind.SWA)
    ledger.escape("single", GroupKind.SWA, {10}, "request released", step=5)
    assert not ledger.follows_frees("single", GroupKind.SWA)


def test_a_free_with_no_damage_in_its_group_reads_no_slot(monkeypatch):
    """The fault injector hears every free: with nothing injected it must not look at the slots
    (reading device slots on the host waits for the device's whole queue, at every free)."""
    injector = make_handle("mha").side.injector
    monkeypatch.setattr(injector, "_escape", lambda *args: pytest.fail("a free with no damage was read"))
    injector._on_free(GroupKind.FULL, torch.tensor([5, 6, 7]), "request released")
    injector.ledger.record(flip(slot=6))
    with pytest.raises(pytest.fail.Exception, match="was read"):
        injector._on_free(GroupKind.FULL, torch.tensor([5, 6, 7]), "request released")


def test_escape_counts_only_its_group_and_side():
    ledger = Ledger()
    ledger.record(inj := flip(group="swa"))
    ledger.escape("single", GroupKind.FULL, {10}, "evicted from the radix cache", step=5)
    ledger.escape("decode", GroupKind.SWA, {10}, "request released", step=5)
    assert inj.status == "latent" and ledger.damaged("single", GroupKind.SWA) == {10}
    ledger.escape("single", GroupKind.SWA, {10}, "SWA slots evicted from the radix cache", step=6)
    assert inj.status == "escaped" and ledger.damaged("single", GroupKind.SWA) == set()


def test_a_wrong_mapping_is_detected_in_its_own_forward_only():
    ledger = Ledger()
    ledger.record(inj := remap())
    chain_break = violation(30, step=3, reasons=("verify_chain_hash",), position=8)
    assert inj.matches(chain_break)
    assert inj.matches(violation(20, step=3, reasons=("verify_position",)))
    assert not inj.matches(violation(30, step=3, reasons=("verify_token",), position=8))
    assert not inj.matches(violation(20, step=4, reasons=("verify_position",)))  # a later forward
    assert not inj.matches(violation(20, step=3, reasons=("verify_position",), row=2))
    ledger.escape("single", GroupKind.FULL, {20}, "evicted from the radix cache", step=4)
    assert inj.status == "latent" and ledger.damaged("single", GroupKind.FULL) == set()  # no bytes were flipped
    ledger.match([chain_break])
    assert inj.status == "detected"


def test_a_free_of_a_full_slot_whose_swa_slot_moved_keeps_the_swa_fault():
    """Radix insert hands a duplicate's SWA slot to the cached copy before freeing the duplicate:
    the damage in that SWA slot lives on under the cached copy's FULL slot."""
    handle = make_handle("swa")
    handle.reset(0, (PerturbSpec("real_kv_post_forward", target_group="swa"),))
    send_waves(handle, seed=0, waves=1)
    inj = next(i for i in handle.injections() if i.slot in handle.ledger.damaged("single", GroupKind.SWA))
    engine = handle.engine
    new_owner = engine.pools.full.alloc(1)
    engine.pools.swa.move(torch.tensor([inj.full_slot]), new_owner)
    engine.pools.free(torch.tensor([inj.full_slot]), "radix dedup freed the duplicate's slot")
    assert inj.slot in handle.ledger.damaged("single", GroupKind.SWA)
    engine.pools.free(new_owner, "evicted from the radix cache")
    assert inj.slot not in handle.ledger.damaged("single", GroupKind.SWA)


def test_a_fault_whose_sighting_repeats_an_earlier_one_is_detected():
    """An engine that serves the same prompt again in the same slots (vLLM reuses block ids) shows a
    later fault's damage exactly as an earlier one's: the log counts that row as a repeat, not a new
    violation, and the ledger still matches it to the later injection (mutation: injections()
    matching the reported violations only leaves the second fault latent)."""
    handle = make_handle("mha")
    handle.reset(0, ())
    log = handle.sides[0].runtime.log
    first, second = flip(step=3), flip(step=9)
    handle.ledger.record(first)
    handle.ledger.record(second)
    log.violations.append(violation(10, step=4))
    log.repeated.append(violation(10, step=10))  # the same row but the step: not reported again
    assert [inj.status for inj in handle.injections()] == ["detected", "detected"]
    assert second.detected_by.step == 10
