"""Faults in a sparse attention's selection and its indexer keys (the indexer group): a selected
index pointed at a slot its row does not hold (index_stale) damages the layer's attention, which a
no-cache recomputation shows, and SELECT of that layer names it (verify_index, at the stale slot and
the selected position, before the attention read it); a flipped bit of an indexer key is found at
its slot by the fingerprint; the mode is refused where it cannot land."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.config import PerturbSpec
from pytest_kvcanary.handles.single import EngineHandle
from pytest_kvcanary.perturb.injector import PerturbError

from perturb_support import BYTE_TOKENS, final_sweep, make_handle, send_waves

FIRST = [BYTE_TOKENS] + list(range(3, 40))  # finishes first: its slots stay cached, read by nobody after
SECOND = [BYTE_TOKENS + 1] + list(range(50, 80))


def _decode_error(stale: bool) -> tuple[float, EngineHandle]:
    """The largest logit error of SECOND's first decode against a no-cache recomputation, with every
    sparse layer's selection damaged in that forward (stale) or not; and the run's injections."""
    handle = make_handle("sparse", real_data="all")
    engine = handle.engine
    first_forwards = 3  # FIRST's prefill and two decodes, then SECOND's prefill
    specs = (PerturbSpec("index_stale", target_group="indexer", warmup_steps=first_forwards + 1),) if stale else ()
    handle.reset(0, specs)
    handle.generate([FIRST], max_new_tokens=first_forwards)
    hidden = []
    forward = engine.model.forward
    engine.model.forward = lambda *args, **kw: hidden.append(forward(*args, **kw)) or hidden[-1]
    out = handle.generate([SECOND], max_new_tokens=2)[0]
    engine.model.forward = forward
    decoded = engine.model.compute_logits(hidden[1])[0]  # SECOND's first decode: its token at len(SECOND)
    truth = engine.model.logits_without_cache(torch.tensor(SECOND + out[:1], device=engine.device))[-1]
    return float((decoded - truth).abs().max()), handle


def test_a_stale_selected_index_damages_the_attention_and_select_names_it_before_the_read():
    clean_error, clean = _decode_error(stale=False)
    assert clean_error < 1e-4 and clean.violations() == [] and clean.healthy()
    error, handle = _decode_error(stale=True)
    assert error > 1e-2  # another token's KV was attended to: the recomputation disagrees
    injections = handle.injections()
    layers = handle.engine.config.model.num_layers
    assert len(injections) >= layers and {i.layer for i in injections} == set(range(layers))
    for inj in injections:
        v = inj.detected_by
        assert inj.status == "detected", inj.describe()
        assert (v.phase, v.group.lower(), v.reasons, v.step) == ("SELECT", "indexer", ("verify_index",), inj.step)
        assert (v.slot, v.position, v.row, v.stored) == (inj.slot, inj.position, inj.row, inj.slot)
        assert v.expected not in (0, inj.slot)  # the row's own slot there
    assert {v.phase for v in handle.violations()} == {"SELECT"}  # the keys and KV themselves are intact


def test_stale_indices_among_concurrent_requests_are_each_detected():
    handle = make_handle("sparse", real_data="partial")
    handle.reset(2, (PerturbSpec("index_stale", target_group="indexer", warmup_steps=1, prob=0.2),))
    send_waves(handle, seed=2, waves=2)
    injections = handle.injections()
    assert len(injections) > 3 and all(i.status == "detected" for i in injections), [
        i.describe() for i in injections]


@pytest.mark.parametrize("mode", ["real_kv_used", "real_kv_post_forward"])
def test_a_flipped_bit_of_an_indexer_key_is_reported_at_its_slot(mode):
    handle = make_handle("sparse", real_data="partial")
    handle.reset(1, (PerturbSpec(mode, target_group="indexer", warmup_steps=1),))
    send_waves(handle, seed=1, waves=2)
    final_sweep(handle)  # damage only the prefix cache holds is read there
    injections = handle.injections()
    assert injections and all(i.status in ("detected", "escaped") for i in injections)
    detected = [i for i in injections if i.status == "detected"]
    assert detected and {i.group for i in injections} == {"indexer"}
    assert all(i.detected_by.reasons == ("verify_real_kv_hash",) and i.detected_by.slot == i.slot
               and i.detected_by.group.lower() == "indexer" for i in detected)


@pytest.mark.parametrize("attention,spec,message", [
    ("sparse", PerturbSpec("index_stale", target_group="full"),
     "mode 'index_stale' damages a sparse attention's selection: it needs target_group='indexer'"),
    ("sparse", PerturbSpec("real_kv_used"), "target_group is required: this engine has pool groups full, indexer"),
    ("mha", PerturbSpec("index_stale", target_group="indexer"),
     "target_group='indexer' is not a pool group of this engine; its groups: full$"),
    ("mha", PerturbSpec("index_stale"), "needs target_group='indexer' .*got target_group=None"),
])
def test_an_index_fault_aimed_elsewhere_is_refused(attention, spec, message):
    with pytest.raises(PerturbError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_handle(attention).reset(0, (spec,))
