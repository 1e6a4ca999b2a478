"""Hybrid models: full-attention layers beside recurrent (Mamba-style) layers, whose state a request
carries from token to token and the prefix cache keeps as checkpoints. The canary guards each state
slot as a group of its own, "state": before a forward, the state a row starts from must summarize
that row's prefix (its length and chain) and hold the bytes stamped when it was written."""

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig

SYSTEM = "You are a careful assistant; keep each answer to one short line. "


@pytest.mark.kv_attention("hybrid")
def test_reused_prefixes_restore_their_checkpoints_cleanly(kv_engine, kv_canary):
    """A -> B -> A: the second A starts from the checkpoint its first run left, after B ran. Fails
    when no checkpoint is restored (mutation: RadixCache.match_prefix ignores Node.state), or when
    a restored state is not the prefix's."""
    a, b = SYSTEM + "What is a state?", SYSTEM + "What is a cache?"
    first = kv_engine.generate([a], max_new_tokens=6)
    kv_engine.generate([b], max_new_tokens=6)
    before = kv_canary.written_slots()
    again = kv_engine.generate([a], max_new_tokens=6)
    assert again == first
    # The repeated prompt computed one token; the rest came from its checkpoint and cached KV.
    assert kv_canary.written_slots() - before < len(a), "no checkpoint was restored"
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("hybrid")
@pytest.mark.kv_perturb("real_kv_used", target_group="state", warmup_steps=1)
def test_a_flipped_state_byte_is_caught_before_the_forward_reads_it(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    found = kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="state")
    injected = {(i.slot, i.step) for i in kv_canary.perturbations()}
    assert {(v.slot, v.step) for v in found} & injected, "no violation names a damaged slot at its forward"
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("hybrid")
@pytest.mark.kv_perturb("real_kv_post_forward", target_group="state", warmup_steps=1)
def test_a_state_damaged_after_its_stamp_is_caught(kv_engine, kv_canary):
    """A running state is read by the next forward's HEAD; a checkpoint by the sweep or the HEAD
    of the request that restores it."""
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_violation("verify_real_kv_hash", group="state")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("hybrid")
@pytest.mark.kv_canary(sweep_interval=1)
@pytest.mark.kv_perturb("real_kv_unused_cache", target_group="state", warmup_steps=3)
def test_a_damaged_idle_checkpoint_is_caught_by_the_sweep(kv_engine, kv_canary):
    kv_engine.generate([SYSTEM + "first"], max_new_tokens=4)  # leaves a checkpoint no request holds
    kv_engine.generate([SYSTEM + "second, longer"], max_new_tokens=6)
    kv_canary.assert_violation("verify_real_kv_hash", phase="SWEEP", group="state")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("hybrid")
@pytest.mark.kv_perturb("state_wrong_restore", target_group="state", warmup_steps=2)
def test_a_state_restored_from_another_prefix_is_caught(kv_engine, kv_canary):
    """The forward would start from a checkpoint of another prefix (or a slot never written for
    this one): HEAD names the row's state slot, whose record summarizes another prefix."""
    kv_engine.generate([SYSTEM + "one"], max_new_tokens=3)
    kv_engine.generate([SYSTEM + "two"], max_new_tokens=3)
    kv_engine.generate([SYSTEM + "one", SYSTEM + "two"], max_new_tokens=4)
    found = kv_canary.violations(phase="HEAD", group="state")
    assert found and {r for v in found for r in v.reasons} & {"verify_chain_hash", "verify_position"}
    injected = {(i.slot, i.step) for i in kv_canary.perturbations()}
    assert {(v.slot, v.step) for v in found} & injected, "no violation names the wrongly restored slot"
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("hybrid")
@pytest.mark.kv_perturb("real_kv_used", target_group="full", warmup_steps=2)
def test_the_attention_layers_kv_is_still_guarded(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="full")
    assert not kv_canary.violations(group="state")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("hybrid")
def test_prefill_decode_moves_the_state_with_its_record(kv_pd, kv_canary):
    """Fails when the states' records no longer travel with the states (mutation:
    PDHandle._on_state_transfer does nothing): the decode side's first HEAD then finds each
    transferred state's slot holding another prefix's record."""
    kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("hybrid")
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", target_group="state")
def test_a_state_damaged_before_its_transfer_is_caught_on_the_decode_side(kv_pd, kv_canary):
    """A running state damaged after the prefill stamped it travels to the decode side, whose first
    HEAD names it there. (A fault may land in a checkpoint instead, which stays on the prefill side:
    requests are sent until one lands in a transferred state.)"""
    for _ in range(8):  # a prefill forward each, a fault each
        kv_pd.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=4)
        moved = [i for i in kv_canary.perturbations() if i.moved_to]
        if moved:
            break
    assert moved, "no fault landed in a transferred state"
    found = kv_canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD", group="state")
    assert {v.slot for v in found} == {p.slot for i in moved for p in i.moved_to}
    assert all(i.status == "detected" and i.detected_by.side == "decode" for i in moved)


def test_speculative_decoding_rolls_the_state_back_cleanly():
    """Speculative decoding on a hybrid model: the target writes its state after each proposal,
    and keeps the one of the accepted length; outputs equal plain decoding's, proposals were
    rejected (so states were rolled back), and the canary is silent."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [SYSTEM + "speculate on this", SYSTEM + "and on this one"]
    plain = make_reference_engine("hybrid", device, seed=0).generate(prompts, 10)
    engine = make_reference_engine("hybrid", device, seed=0, speculative_k=3)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2,
                                        kernels="triton" if device == "cuda" else "torch"), engine)
    engine.set_forward_hooks(canary)
    assert engine.generate(prompts, 10) == plain
    assert engine.drafter.proposed > engine.drafter.accepted > 0
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []


def _hybrid_with_a_host_tier():
    """Pages of 16 tokens, a device pool of 9 pages and a host tier of 64, guarded by hand (as
    examples/test_host_tier.py does for attention KV)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = make_reference_engine("hybrid", device, seed=0, page_size=16, num_slots=160, host_num_slots=1024)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2,
                                        kernels="triton" if device == "cuda" else "torch"), engine)
    engine.set_forward_hooks(canary)
    return engine, canary


FIRST = [SYSTEM + "the first prompt, which goes to host memory and comes back"]
SECOND = [SYSTEM + "a second prompt, which pushes the first out", SYSTEM + "and a third one, as long as that"]


def test_checkpoints_written_back_with_their_pages_come_back_clean():
    engine, canary = _hybrid_with_a_host_tier()
    before = engine.generate(FIRST, 6)
    engine.generate(SECOND, 6)  # the first prompt's pages and checkpoint go to host memory
    assert engine.generate(FIRST, 6) == before  # ... and come back: its checkpoint is restored
    tier = engine.host_tier
    assert tier.num_states_written_back > 0 and tier.num_states_loaded_back > 0
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []


def test_a_checkpoint_damaged_on_the_host_is_reported_before_it_is_read():
    engine, canary = _hybrid_with_a_host_tier()
    engine.generate(FIRST, 6)
    engine.generate(SECOND, 6)
    on_host = [n for n in engine.radix_cache._nodes() if n.host_state is not None and n.state is None]
    assert on_host, "no checkpoint is only in host memory"
    state = next(p for p in engine.host_tier.pools if p.kind.name == "STATE")
    for node in on_host:  # every checkpoint only the host holds, the one the prompt comes back to among them
        for layer in state.k_layers:  # a bit of every layer: whichever the fingerprint samples
            layer[node.host_state].view(-1).view(torch.uint8)[0] ^= 1
    loading = canary.forwards  # the next forward loads the checkpoint back and starts from it
    engine.generate(FIRST, 6)
    canary.drain()
    first = canary.log.violations[0]
    assert (first.step, first.phase, first.group, first.reasons) == (loading, "HEAD", "STATE", ("verify_real_kv_hash",))
