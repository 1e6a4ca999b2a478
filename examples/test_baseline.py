"""A clean workload: the canary must stay silent."""

import pytest


@pytest.mark.kv_attention("mha", "swa")
def test_clean_batch_has_no_violation(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(6, distinct_prompts=True, max_new_tokens=6)
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("mha")
def test_shared_prefixes_reuse_the_radix_cache_cleanly(kv_engine, kv_canary):
    """Fails when no prefix is reused (mutation: RadixCache.match_prefix always returns an empty
    match), or when reusing one reads a damaged slot. Skips on an engine without a prefix cache."""
    kv_engine.require("prefix_cache")
    prefix = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps over "
    kv_engine.generate([prefix + "a cat"], max_new_tokens=5)
    before = kv_canary.written_slots()
    kv_engine.generate([prefix + tail for tail in ("a dog", "a log")], max_new_tokens=5)
    # Without reuse each prompt writes a slot per token, the prefix included.
    assert kv_canary.written_slots() - before < 2 * len(prefix), "no cached prefix was reused"
    kv_canary.assert_no_violation()
