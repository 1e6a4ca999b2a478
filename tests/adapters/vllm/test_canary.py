"""The canary on vLLM through the harness and the fault injector (which use the seam only), prefix
caching on: a clean workload stays clean, and every perturb mode is caught at the slot it
damaged, with the reason and in the phase that mode calls for, over several seeds."""

from __future__ import annotations

import random

import pytest
import torch

from pytest_kvcanary.config import PerturbSpec

from .support import (
    INSTALL, PrefixCacheCounter, attention_param, make_engine, make_handle, prompts_with_shared_prefixes, stems,
    unsupported,
)

pytest.importorskip("vllm", reason=INSTALL)

SEEDS = range(10)
# mode -> (phases that may catch it, warm-up forwards)
MODES = {
    "real_kv_used": ({"HEAD"}, 2),
    "req_to_token": ({"HEAD"}, 2),
    "real_kv_unused_cache": ({"SWEEP"}, 3),
    "real_kv_post_forward": ({"HEAD", "RECHECK", "SWEEP"}, 1),
    "next_token_swap": ({"TAIL"}, 1),
}
REASONS = {"req_to_token": {"verify_chain_hash", "verify_token", "verify_position"}, "next_token_swap": {"write_token"}}


@pytest.fixture(scope="module")
def engines():
    return {attention: make_engine(attention) for attention in ("mha", "swa", "mla") if not unsupported(attention)}


def clean_workload(handle, seed: int) -> None:
    """Distinct prompts, then prompts sharing prefixes (prefix-cache hits, also within one step)."""
    handle.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=4)
    rng = random.Random(seed)
    handle.generate(prompts_with_shared_prefixes(rng, 5, stems(rng, count=2)), 6)


def fault_workload(handle, seed: int) -> None:
    """Random prompts; other random prompts (the first ones' blocks sit in the prefix cache, held
    by no request); the first prompts extended (they hit those blocks). No two requests of a
    batch share content: a wrong block-table entry pointing at a block of identical content would
    be no fault at all."""
    rng = random.Random(seed)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(256) for _ in range(rng.randrange(40, 90))] for _ in range(3)]

    firsts = prompts()
    handle.generate(firsts, 4)
    handle.generate(prompts(), 6)
    handle.generate([p + [rng.randrange(256) for _ in range(rng.randrange(5, 30))] for p in firsts], 6)


def test_prefix_caching_says_what_vllm_runs_with(engines):
    """The examples expect prefix reuse only where it can happen: vLLM's CPU build runs latent
    attention without a prefix cache, whatever the settings ask."""
    assert all(engine.settings.prefix_caching for engine in engines.values())
    expected = {"mha": True, "swa": True, "mla": False}
    assert {attention: engine.prefix_caching for attention, engine in engines.items()} == {
        attention: expected[attention] for attention in engines}


@pytest.mark.parametrize("real_data", ["partial", "all"])
@pytest.mark.parametrize("attention", [attention_param(a) for a in ("mha", "swa", "mla")])
def test_clean_workload_has_no_violation(engines, attention, real_data, monkeypatch):
    engine = engines[attention]
    handle = make_handle(engine, real_data=real_data)
    counter = PrefixCacheCounter(engine, monkeypatch)
    clean_workload(handle, 0)
    assert handle.violations() == []
    stats = handle.stats()["single"]
    assert stats["forwards"] > 0 and stats["protected_tokens"] > 0 and stats["health"] == "ok"
    if engine.prefix_caching:
        assert counter.hits > 0, "vLLM hit its prefix cache"
        assert stats["sweeps"] > 0


CASES = [attention_param(a, g, m) for a, groups in (("mha", ["full"]), ("swa", ["full", "swa"]), ("mla", ["full"]))
         for g in groups for m in MODES
         # A wrong block-table entry read only from a window start breaks the chain where the block
         # ends, which the fault ledger does not match to the injection yet.
         if (g, m) != ("swa", "req_to_token")
         # Without a prefix cache (mla on vLLM's CPU build) no slot is held by the cache alone.
         and (a, m) != ("mla", "real_kv_unused_cache")
         # A token fed in another lands in every group: recorded (and reported) in each.
         and (m, g) != ("next_token_swap", "swa")]


@pytest.mark.parametrize("attention,group,mode", CASES)
def test_each_fault_is_caught_where_it_was_made(engines, attention, group, mode):
    phases, warmup = MODES[mode]
    reasons = REASONS.get(mode, {"verify_real_kv_hash"})
    for seed in SEEDS:
        handle = make_handle(engines[attention], (PerturbSpec(mode, target_group=group, warmup_steps=warmup),), seed)
        fault_workload(handle, seed)
        injections = handle.injections()
        assert injections, f"seed {seed}: no fault was injected"
        detected = [i for i in injections if i.status == "detected"]
        assert detected, f"seed {seed}: none of {injections} was detected"
        for inj in injections:
            # A fault on the last token a request wrote is never read when vLLM frees that block.
            assert inj.status == "detected" or (inj.status == "escaped" and mode == "real_kv_post_forward"), inj
        for inj in detected:
            v = inj.detected_by
            assert v.group.lower() == inj.group and v.phase in phases and set(v.reasons) & reasons, (inj, v)
            assert inj.group == group or mode == "next_token_swap"
            if mode == "req_to_token":
                assert (v.row, v.step) == (inj.row, inj.step) and v.position in (inj.position, inj.position + 1)
            else:
                assert v.slot == inj.slot and inj.half in (None, v.half)


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_a_k_only_flip_in_a_cached_prefix_is_reported_at_its_slot_on_half_k(engines, real_data):
    """vLLM's CPU attention keeps K dimension-major inside a block; the fingerprint reads it element
    by element, so a flip in K alone, in a block only the prefix cache holds, is found by the sweep
    at that slot, on half K, and nowhere else."""
    from kvcanary_kernels.records import GroupKind, Half

    handle = make_handle(engines["mha"], real_data=real_data, sweep_interval=0)
    fault_workload(handle, seed=0)
    runtime = handle.side.runtime
    runtime.drain()
    assert handle.violations() == []
    walk = runtime.host.cache_walk()
    slot = int(walk.slots[~walk.locked][5])
    group = runtime.group(GroupKind.FULL)
    state = group.halves[Half.K]
    assert state.sources and all(s.elementwise for s in state.sources), "K is read element by element"
    k = group.pool.k_layers[state.source_layers[0]]  # [blocks, block_size, head_dim], dimension-major blocks
    bs = group.pool.page_size
    k.view(torch.int16)[slot // bs, slot % bs, 3] ^= 1  # dimension 3: read in partial mode too
    assert runtime.sweep()
    runtime.drain()
    found = [(v.phase, v.half, v.slot, v.reasons) for v in handle.violations()]
    assert found == [("SWEEP", "K", slot, ("verify_real_kv_hash",))]


def test_a_token_fed_in_another_changes_what_the_forward_computes(engines):
    """next_token_swap writes into the model call's own input ids (the view's are a copy made
    before HEAD): the greedy outputs then differ from a clean run's."""
    prompts = [[random.Random(i).randrange(256) for _ in range(20)] for i in range(3)]
    clean = make_handle(engines["mha"]).generate(prompts, 6)
    swapped = make_handle(engines["mha"], (PerturbSpec("next_token_swap", warmup_steps=1),)).generate(prompts, 6)
    assert swapped != clean
