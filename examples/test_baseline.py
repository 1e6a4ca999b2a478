"""A clean workload: the canary must stay silent."""

import pytest


@pytest.mark.kv_attention("mha", "swa")
def test_clean_batch_has_no_violation(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(6, distinct_prompts=True, max_new_tokens=6)
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("mha")
def test_shared_prefixes_reuse_the_radix_cache_cleanly(kv_engine, kv_canary):
    prefix = "the quick brown fox jumps over "
    kv_engine.generate([prefix + tail for tail in ("a dog", "a cat", "a log")], max_new_tokens=5)
    kv_engine.generate([prefix + "the lazy dog"], max_new_tokens=5)
    kv_canary.assert_no_violation()
