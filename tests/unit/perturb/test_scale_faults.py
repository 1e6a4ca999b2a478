"""Faults in FP8 KV's dequantization scales (the scales group) and in its quantized bytes: each is
detected through the ledger, at the forward it was injected in (a scale) or at the first read of
the damage (a byte), with the reason its mode must produce, at the damaged layer and head (slot)."""

from __future__ import annotations

import pytest

from pytest_kvcanary.config import PerturbSpec
from pytest_kvcanary.perturb.injector import PerturbError

from perturb_support import final_sweep, make_handle, send_waves


@pytest.mark.parametrize("mode", ["scale_corrupt", "scale_reset"])
def test_a_damaged_scale_is_reported_by_the_head_of_the_forward_handed_it(mode):
    handle = make_handle("fp8", real_data="partial")
    engine = handle.engine
    before = engine.model.kv_scales.k.clone(), engine.model.kv_scales.v.clone()
    handle.reset(0, (PerturbSpec(mode, target_group="scales", warmup_steps=1, prob=0.5),))
    send_waves(handle, seed=0, waves=2)
    injections = handle.injections()
    assert len(injections) > 2
    for inj in injections:
        v = inj.detected_by
        assert inj.status == "detected", inj.describe()
        assert (v.phase, v.group.lower(), v.reasons, v.step) == ("HEAD", "scales", ("verify_scale",), inj.step)
        assert (v.slot, v.position, v.half) == (inj.layer, inj.position, inj.half)
        if mode == "scale_reset":
            assert v.stored == 0x3F800000  # 1.0's float32 bits
    # Each damaged scale was put back after its forward: the engine's scales are as they were.
    assert all(t.equal(b) for t, b in zip(engine.model.kv_scales, before))
    assert {v.group.lower() for v in handle.violations()} == {"scales"}


@pytest.mark.parametrize("mode", ["real_kv_used", "real_kv_post_forward"])
def test_a_flipped_bit_of_a_quantized_byte_is_reported_at_its_slot(mode):
    handle = make_handle("fp8", real_data="partial")
    assert handle.engine.pools.full.k_layers[0].element_size() == 1
    handle.reset(1, (PerturbSpec(mode, target_group="full", warmup_steps=1),))
    send_waves(handle, seed=1, waves=2)
    final_sweep(handle)  # damage only the prefix cache holds is read there
    injections = handle.injections()
    assert injections and all(i.status in ("detected", "escaped") for i in injections)
    detected = [i for i in injections if i.status == "detected"]
    assert detected and all(i.detected_by.reasons == ("verify_real_kv_hash",) and i.detected_by.slot == i.slot
                            for i in detected)


@pytest.mark.parametrize("spec,message", [
    (PerturbSpec("scale_reset", target_group="full"), "mode 'scale_reset' damages a dequantization scale: it needs "
                                                      "target_group='scales'"),
    (PerturbSpec("real_kv_used", target_group="scales"), "mode 'real_kv_used' damages KV slots; the scales group holds"),
    (PerturbSpec("scale_corrupt"), "mode 'scale_corrupt' damages a dequantization scale: it needs "
                                   "target_group='scales'"),
])
def test_a_scale_fault_aimed_elsewhere_or_a_slot_fault_aimed_at_the_scales_is_refused(spec, message):
    with pytest.raises(PerturbError, match=message.replace("(", r"\(")):
        make_handle("fp8").reset(0, (spec,))


def test_a_slot_fault_needs_no_target_group_where_the_only_other_group_is_the_scales():
    """FULL beside SCALES: a KV mode has one group to damage, as on an unquantized engine."""
    handle = make_handle("fp8")
    handle.reset(1, (PerturbSpec("real_kv_used"),))
    send_waves(handle, seed=1, waves=1)
    injections = handle.injections()
    assert injections and {i.group for i in injections} == {"full"}


def test_a_scale_fault_needs_an_engine_with_scales():
    with pytest.raises(PerturbError, match="target_group='scales' is not a pool group of this engine; its groups: full$"):
        make_handle("mha").reset(0, (PerturbSpec("scale_corrupt", target_group="scales"),))
