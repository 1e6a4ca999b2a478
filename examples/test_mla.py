"""Latent (MLA) KV pools: one latent row per token and layer, guarded as a group with one half."""

import pytest


@pytest.mark.kv_attention("mla")
def test_latent_pool_with_shared_prefixes_is_clean(kv_engine, kv_canary):
    prefix = "one latent row per token holds its keys and values: "
    kv_engine.generate([prefix + tail for tail in ("keys", "values", "both")], max_new_tokens=5)
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("mla")
@pytest.mark.kv_perturb("real_kv_used", warmup_steps=2)
def test_flipped_latent_byte_is_caught_at_head(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=6)
    found = kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="full")
    assert {v.half for v in found} == {"K"}  # a latent pool has one half
    kv_canary.assert_perturbations_detected()
