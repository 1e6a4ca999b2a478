"""Each fault mode is injected and the canary must name it."""

import pytest


@pytest.mark.kv_attention("mha", "swa")
@pytest.mark.kv_perturb("real_kv_used", target_group="full", warmup_steps=2)
def test_flipped_byte_in_a_read_slot_is_caught_at_head(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=6)
    kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="full")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("mha")
@pytest.mark.kv_perturb("req_to_token", warmup_steps=2)
def test_wrong_mapping_entry_is_caught_at_head(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=6)
    kv_canary.assert_violation("verify_chain_hash", phase="HEAD")
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("mha")
@pytest.mark.kv_canary(sweep_interval=2)
@pytest.mark.kv_perturb("real_kv_unused_cache", warmup_steps=3)
def test_idle_cached_slot_is_caught_by_the_sweep(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=4)
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=6)
    kv_canary.assert_violation("verify_real_kv_hash", phase="SWEEP")


@pytest.mark.kv_attention("swa")
@pytest.mark.kv_perturb("real_kv_post_forward", target_group="swa", warmup_steps=1)
def test_slot_damaged_after_the_stamp_is_caught_by_the_next_read(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=6)
    kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="swa")


@pytest.mark.kv_attention("mha")
@pytest.mark.kv_perturb("next_token_swap", warmup_steps=1)
def test_a_forward_fed_another_token_is_caught_at_its_tail(kv_engine, kv_canary):
    """Each forward feeds one request another token than the one the engine holds for it (the
    token another request is fed): the TAIL of that very forward names the slot it wrote. Runs on
    every engine with a token table (reference, transformers, vLLM); one that cannot feed a forward
    another token skips."""
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=4)
    kv_canary.assert_violation("write_token", phase="TAIL", group="full")
    kv_canary.assert_perturbations_detected()
