"""Faults in a hybrid model's recurrent state (the state group): each mode that reaches it is
detected at the first read of the damage with the reason the mode must produce, at the damaged
state slot; the modes that cannot damage a state are refused by name."""

from __future__ import annotations

import pytest

from pytest_kvcanary.config import PerturbSpec
from pytest_kvcanary.perturb.injector import PerturbError

from perturb_support import final_sweep, make_handle, send_waves

# The phases that may report each mode's state damage first: a state a forward starts from (its
# HEAD), a state just written (the next HEAD of its request, or a sweep once the checkpoint is all
# that holds it), a checkpoint no request holds (the sweep, or the HEAD of a request restoring it),
# a checkpoint in the host tier (the HEAD of the forward that starts from it once loaded back).
PHASES = {
    "real_kv_host": {"HEAD"},
    "real_kv_used": {"HEAD"},
    "real_kv_post_forward": {"HEAD", "SWEEP"},
    "real_kv_unused_cache": {"HEAD", "SWEEP"},
    "state_wrong_restore": {"HEAD"},
}
REASONS = {"state_wrong_restore": {"verify_position", "verify_chain_hash"}}


def _repeats(handle, seed: int) -> None:
    """Waves of distinct prompts, then each wave's prompts again: every repeat restores a checkpoint."""
    send_waves(handle, seed, waves=2, per_wave=3)
    send_waves(handle, seed, waves=2, per_wave=3)


@pytest.mark.parametrize("mode", sorted(PHASES))
def test_every_state_fault_is_detected_at_the_damaged_slot(mode):
    seen = 0
    for seed in range(4):
        handle = make_handle("hybrid-host" if mode == "real_kv_host" else "hybrid", real_data="all", sweep_interval=1)
        handle.reset(seed, (PerturbSpec(mode, target_group="state", warmup_steps=1),))
        _repeats(handle, seed)
        final_sweep(handle)
        for inj in handle.injections():
            assert inj.status != "latent", inj.describe()
            if inj.status == "escaped":
                assert inj.cause, inj.describe()
                continue
            v = inj.detected_by
            slots = {p.slot for p in inj.places if p.side == "single"}  # a host fault: where it was loaded back
            assert v.group.lower() == "state" and v.slot in slots and v.phase in PHASES[mode], v.describe()
            assert set(v.reasons) & REASONS.get(mode, {"verify_real_kv_hash"}), v.describe()
            seen += 1
    # A host fault is read only where its checkpoint comes back: fewer of them are.
    assert seen >= (2 if mode == "real_kv_host" else 4), f"{mode}: only {seen} faults were detected"


@pytest.mark.parametrize("engine, spec, why", [
    ("mha", PerturbSpec("state_wrong_restore"), "needs target_group='state'"),
    ("hybrid", PerturbSpec("state_wrong_restore", target_group="full"), "needs target_group='state'"),
    ("hybrid", PerturbSpec("req_to_token", target_group="state"), "the state group has no mapping"),
])
def test_a_mode_that_cannot_damage_a_state_is_refused_by_name(engine, spec, why):
    with pytest.raises(PerturbError, match=why):
        make_handle(engine).reset(0, (spec,))
