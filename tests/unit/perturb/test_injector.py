"""The fault injector's switches: off, warm-up, seeding, and the specs it refuses."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pytest_kvcanary.canary.seam import ForwardHooks, ForwardView
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import PERTURB_MODES, PerturbSpec, SCALE_MODES
from pytest_kvcanary.handles.single import EngineHandle
from pytest_kvcanary.perturb.injector import PerturbError

from perturb_support import BYTE_TOKENS, KV_MODES, POOL_GROUPS, final_sweep, make_handle, send_waves


REAL_KV_MODES = [m for m in PERTURB_MODES if m.startswith("real_kv")]


class MappingGuard(ForwardHooks):
    """Forward hooks around the canary runtime: the mapping table must be as the engine left it
    once the runtime (and the injector inside it) is done with the forward."""

    def __init__(self, runtime: CanaryRuntime) -> None:
        self.runtime = runtime
        self.table = runtime.groups[0].mapping.table
        self.saved = self.table.clone()  # as of the forward under way

    def before_forward(self, view: ForwardView) -> None:
        self.saved = self.table.clone()
        self.runtime.before_forward(view)

    def kv_stored(self, kind, layer, k, v) -> None:
        self.runtime.kv_stored(kind, layer, k, v)

    def after_forward(self, view: ForwardView) -> None:
        self.runtime.after_forward(view)
        assert torch.equal(self.table, self.saved), "a wrong mapping outlived its forward"

    def end_forward(self) -> None:
        self.runtime.end_forward()


def ledger_of(handle: EngineHandle, seed: int, specs: tuple[PerturbSpec, ...]) -> list[dict]:
    """The ledger of one run of the same workload, faults seeded by `seed`."""
    handle.reset(seed, specs)
    send_waves(handle, seed=0)
    return [i.to_json() for i in handle.injections()]


@pytest.mark.parametrize("attention", POOL_GROUPS)
def test_no_fault_armed_no_violation_and_an_empty_ledger(attention):
    handle = make_handle(attention, real_data="all", sweep_interval=1)
    handle.reset(0, ())
    send_waves(handle, seed=0)
    final_sweep(handle)
    assert handle.violations() == [] and handle.injections() == []
    stats = handle.stats()["single"]
    assert stats["forwards"] > 0 and stats["sweeps"] == stats["forwards"] + 1 and stats["health"] == "ok"


@pytest.mark.parametrize("mode", PERTURB_MODES)
def test_nothing_is_injected_before_the_warm_up_ends(mode):
    warmup = 5
    engine, group = {"real_kv_host": ("host", "full"), "state_wrong_restore": ("hybrid", "state"),
                     "scale_corrupt": ("fp8", "scales"), "scale_reset": ("fp8", "scales"),
                     "index_stale": ("sparse", "indexer")}.get(mode, ("swa", "swa"))
    handle = make_handle(engine)
    handle.reset(0, (PerturbSpec(mode, target_group=group, warmup_steps=warmup),))
    send_waves(handle, seed=0)
    steps = [i.step for i in handle.injections()]
    assert steps and min(steps) >= warmup
    if mode == "real_kv_post_forward":  # every forward writes a slot to flip
        assert min(steps) == warmup


def test_a_seed_replays_its_faults_and_another_seed_places_them_elsewhere():
    """Every mode at once, on the engine with pages and a host tier."""
    specs = tuple(PerturbSpec(mode, target_group="full") for mode in KV_MODES)
    handle = make_handle("host")
    first = ledger_of(handle, 1, specs)
    assert {i["mode"] for i in first} == set(KV_MODES)
    assert ledger_of(handle, 2, specs) != first
    # Again after another run of the same engine, and on a new one (a replay in isolation).
    assert ledger_of(handle, 1, specs) == first
    assert ledger_of(make_handle("host"), 1, specs) == first


def test_wrong_mappings_are_put_back_after_their_forward_even_one_entry_remapped_twice():
    remapped_twice = 0
    for seed in range(40):
        handle = make_handle("mha")
        handle.engine.set_forward_hooks(MappingGuard(handle.side.runtime))
        handle.reset(seed, (PerturbSpec("req_to_token"),) * 2)
        send_waves(handle, seed)
        entries = Counter((i.step, i.row, i.position) for i in handle.injections())
        remapped_twice += sum(n == 2 for n in entries.values())
        if remapped_twice:
            break
    assert remapped_twice, "no run remapped one entry twice in a forward"


def test_each_wrong_mapping_is_one_of_its_own_and_detected():
    """One request, so the few entries make a repeat of an earlier remap likely; the log reports a
    repeated row once, so the injector makes each remap only once."""
    for seed in range(10):
        handle = make_handle("mha")
        handle.reset(seed, (PerturbSpec("req_to_token"),))
        handle.generate([[BYTE_TOKENS, 1]], max_new_tokens=12)
        remaps = [(i.row, i.position, i.full_slot) for i in handle.injections()]
        assert len(set(remaps)) == len(remaps) > 0
        assert all(i.status == "detected" for i in handle.injections()), [i.describe() for i in handle.injections()]


@pytest.mark.parametrize("mode", [m for m in PERTURB_MODES
                                  if m not in ("next_token_swap", "index_stale") and m not in SCALE_MODES])
def test_a_model_with_two_pool_groups_needs_target_group(mode):
    with pytest.raises(PerturbError, match=r"target_group is required: this engine has pool groups full, swa; allowed: full, swa$"):
        make_handle("swa").reset(0, (PerturbSpec(mode),))


def test_a_swapped_token_needs_no_target_group_and_is_recorded_in_every_group_it_was_written_to():
    """The token lands in every pool group the forward writes: one injection per group, each
    detected by that group's TAIL write_token at the same row and position."""
    handle = make_handle("swa", real_data="none")
    handle.reset(0, (PerturbSpec("next_token_swap", warmup_steps=1),))
    handle.generate([[BYTE_TOKENS] + list(range(1, 12))], max_new_tokens=3)
    injections = handle.injections()
    by_step = Counter(i.step for i in injections)
    assert by_step == {1: 2, 2: 2}, by_step  # the two decodes, once per group
    assert {(i.step, i.row, i.position) for i in injections if i.group == "full"} == \
        {(i.step, i.row, i.position) for i in injections if i.group == "swa"}
    for inj in injections:
        v = inj.detected_by
        assert (v.phase, v.group.lower(), v.reasons, v.slot) == ("TAIL", inj.group, ("write_token",), inj.slot)


def test_a_host_fault_needs_an_engine_with_a_host_tier():
    with pytest.raises(PerturbError, match=r"^kv_perturb\('real_kv_host'\): the full group of this engine has no host "
                                           r"tier to damage$"):
        make_handle("mha").reset(0, (PerturbSpec("real_kv_host"),))
    assert make_handle("mha").unsupported((PerturbSpec("real_kv_host"),)) == (
        "kv_perturb('real_kv_host') needs an engine with a host-memory tier (GuardedEngine.host_tier); the single "
        "engine (Engine) has none")
    assert make_handle("host").unsupported((PerturbSpec("real_kv_host"),)) is None


def test_an_engine_that_cannot_feed_another_token_is_named_by_the_reason_to_skip():
    handle = make_handle("mha")
    assert handle.unsupported((PerturbSpec("req_to_token"),)) is None
    assert handle.unsupported((PerturbSpec("next_token_swap"),)) is None
    handle.side.engine = _HostWithoutFreeReports(handle.engine)  # the bare seam: no feed_token
    assert handle.unsupported((PerturbSpec("next_token_swap"),)) == (
        "kv_perturb('next_token_swap') needs an engine that can feed a forward another token "
        "(GuardedEngine.feed_token); the single engine (_HostWithoutFreeReports) has none")


@pytest.mark.parametrize("mode", PERTURB_MODES)
def test_target_group_swa_on_an_mha_model_is_refused(mode):
    with pytest.raises(PerturbError, match=r"target_group='swa' is not a pool group of this engine; its groups: full$"):
        make_handle("mha").reset(0, (PerturbSpec(mode, target_group="swa"),))


@pytest.mark.parametrize("mode", REAL_KV_MODES)
def test_real_kv_modes_need_real_data(mode):
    with pytest.raises(PerturbError, match=r"real_data partial or all; got real_data='none'$"):
        make_handle("mha", real_data="none").reset(0, (PerturbSpec(mode),))


def test_req_to_token_needs_no_real_data():
    handle = make_handle("mha", real_data="none")
    handle.reset(0, (PerturbSpec("req_to_token"),))
    send_waves(handle, seed=0, waves=1)
    assert handle.injections() and all(i.status == "detected" for i in handle.injections())


class _HostWithoutFreeReports:
    """The reference engine seen through the bare GuardedEngine seam (no add_free_listener)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def canary_groups(self):
        return self.engine.canary_groups()

    def canary_capacities(self):
        return self.engine.canary_capacities()

    def cache_walk(self):
        return self.engine.cache_walk()


def test_without_free_reports_a_damaged_slot_written_again_is_escaped_as_overwritten():
    from pytest_kvcanary.adapters.reference import make_reference_engine
    from pytest_kvcanary.config import CanaryConfig
    from pytest_kvcanary.perturb.injector import FaultInjector
    from pytest_kvcanary.perturb.ledger import Ledger

    from perturb_support import DEVICE, SEED_SWEEP_KERNELS

    engine = make_reference_engine("mha", DEVICE, seed=0)
    host = _HostWithoutFreeReports(engine)
    runtime = CanaryRuntime(CanaryConfig(sweep_interval=0, kernels=SEED_SWEEP_KERNELS), host)
    ledger = Ledger()
    injector = FaultInjector(host, runtime, "single", ledger)
    runtime.observers.append(injector)
    engine.set_forward_hooks(runtime)
    injector.arm((PerturbSpec("real_kv_post_forward"),), seed=0)
    engine.generate([list(range(1, 9))], max_new_tokens=1)  # one prefill; its slots go to the cache
    first = ledger.injections[0]
    assert first.status == "latent"
    engine.reset()  # the slots are freed unreported, and handed out again in the same order
    engine.generate([list(range(11, 19))], max_new_tokens=1)
    assert (first.status, first.cause) == ("escaped", "slot overwritten before any read")
    assert runtime.log.violations == []


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_the_ledger_names_the_flipped_byte(real_data):
    """half, layer and byte say where the flip is: in the slot's row of that half and layer, the
    byte at that offset is the only one that changed. In partial mode a later sampled layer reads
    a later KV head, so its flips sit past byte 0 (at that head's first byte, for real_kv_used)."""
    handle = make_handle("mha", real_data=real_data)
    pool = handle.side.runtime.groups[0].pool
    before: list[dict[str, list[torch.Tensor]]] = []

    class Snapshot:  # runs before the injector
        def before_forward(self, view: ForwardView) -> None:
            before.append({"K": [t.clone() for t in pool.k_layers], "V": [t.clone() for t in pool.v_layers]})

        def after_stamp(self, view: ForwardView) -> None:
            pass

    handle.side.runtime.observers.insert(0, Snapshot())
    handle.reset(0, (PerturbSpec("real_kv_used"),))
    send_waves(handle, seed=0, waves=2)
    injections = handle.injections()
    assert {i.half for i in injections} == {"K", "V"}
    if real_data == "partial":
        assert any(i.byte > 0 for i in injections)
    for i in injections:
        now = (pool.k_layers if i.half == "K" else pool.v_layers)[i.layer][i.slot].view(torch.uint8).flatten()
        then = before[i.step][i.half][i.layer][i.slot].view(torch.uint8).flatten()
        assert (now != then).nonzero().flatten().tolist() == [i.byte], i.describe()
