"""Latent (MLA) KV pools: one latent row per token and layer, guarded as a group with one half."""

import pytest

from pytest_kvcanary.canary.seam import capabilities_of


@pytest.mark.kv_attention("mla")
def test_latent_pool_with_shared_prefixes_is_clean(kv_engine, kv_canary):
    """Fails when no prefix is reused (mutation: RadixCache.match_prefix always returns an empty
    match), or when reusing one reads a damaged latent row."""
    prefix = "one latent row per token holds its keys and values, and so on and on: "
    kv_engine.generate([prefix + "both"], max_new_tokens=5)
    before = kv_canary.written_slots()
    kv_engine.generate([prefix + tail for tail in ("keys", "values")], max_new_tokens=5)
    # Without reuse each prompt writes a slot per token, the prefix included. (vLLM's CPU build
    # runs latent attention without a prefix cache, so there is nothing to reuse there.)
    if capabilities_of(kv_engine.engine).prefix_cache:
        assert kv_canary.written_slots() - before < 2 * len(prefix), "no cached prefix was reused"
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("mla")
@pytest.mark.kv_perturb("real_kv_used", warmup_steps=2)
def test_flipped_latent_byte_is_caught_at_head(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=6)
    found = kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="full")
    assert {v.half for v in found} == {"K"}  # a latent pool has one half
    kv_canary.assert_perturbations_detected()
