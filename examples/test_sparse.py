"""Sparse attention, DeepSeek-V3.2-style (NSA/DSA): each query attends to the index_topk tokens its
layer's indexer selects, through a small FP8 key cache kept beside the latent KV. The indexer keys
are guarded as a group of their own, "indexer" (the FULL group's slots and mapping, fingerprinted
with their scales), and every index a layer selects is checked before its attention reads it
(phase SELECT): it must point at the query's own slot of a position the query sees."""

import pytest
import torch

from pytest_kvcanary.canary.seam import capabilities_of

# The Triton kernels on a GPU; their bit-identical torch references on a CPU, where Triton interprets.
pytestmark = pytest.mark.kv_canary(kernels="triton" if torch.cuda.is_available() else "torch")

SYSTEM = "Answer in one short line, please, and keep it short. "  # longer than index_topk (16)
QUESTIONS = ["What is an indexer?", "What is top-k?", "Why guard an index?", "What is DSA?"]


@pytest.mark.kv_attention("sparse")
def test_sparse_attention_with_shared_prefixes_is_clean(kv_engine, kv_canary):
    """Fails when no prefix is reused, or when a selection or an indexer key is damaged."""
    kv_engine.generate([SYSTEM + QUESTIONS[0]], max_new_tokens=5)
    before = kv_canary.written_slots()
    kv_engine.generate([SYSTEM + q for q in QUESTIONS[1:]], max_new_tokens=5)
    if capabilities_of(kv_engine.engine).prefix_cache:
        assert kv_canary.written_slots() - before < 3 * len(SYSTEM), "no cached prefix was reused"
    kv_canary.assert_no_violation()


@pytest.mark.kv_attention("sparse")
@pytest.mark.kv_perturb("index_stale", target_group="indexer", warmup_steps=1, prob=0.3)
def test_a_stale_selected_index_is_caught_before_the_attention_reads_it(kv_engine, kv_canary):
    """An index left pointing at a slot its request does not hold there (a freed slot, or another
    request's): SELECT of that layer names the slot and the position, in the forward that read it."""
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    found = kv_canary.assert_violation("verify_index", phase="SELECT", group="indexer")
    assert all(v.stored == v.slot != v.expected for v in found)
    kv_canary.assert_perturbations_detected()


@pytest.mark.kv_attention("sparse")
@pytest.mark.parametrize("mode", [
    pytest.param(mode, marks=pytest.mark.kv_perturb(mode, target_group="indexer", warmup_steps=1))
    for mode in ("real_kv_used", "real_kv_post_forward")])
def test_a_flipped_bit_of_an_indexer_key_is_caught_at_its_slot(kv_engine, kv_canary, mode):
    """An indexer key's byte flipped before a forward reads it, or right after the forward that wrote
    it: the next check that reads the slot (HEAD, or a sweep) names it."""
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=5)
    found = kv_canary.assert_violation("verify_real_kv_hash", group="indexer")
    assert {v.slot for v in found} <= {i.slot for i in kv_canary.perturbations()}
