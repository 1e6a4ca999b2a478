"""Parallel engines: the reference engine split over tensor-parallel ranks and pipeline stages (one
process per rank: gloo on a CPU, NCCL on GPUs), each rank guarded by its own canary, and the
ranks' stamps compared with one another after every forward."""

import pytest


@pytest.mark.kv_parallel(tp=2)
def test_tensor_parallel_ranks_are_clean_and_agree(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=3)
    kv_canary.assert_no_violation()
    assert kv_canary.written_slots() > 0


@pytest.mark.kv_parallel(pp=2)
def test_pipeline_stages_are_clean_and_agree(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=3)
    kv_canary.assert_no_violation()


@pytest.mark.kv_parallel(tp=2)
@pytest.mark.kv_perturb("real_kv_used", warmup_steps=2, rank=1)
def test_a_fault_on_one_rank_is_reported_on_that_rank_only(kv_engine, kv_canary):
    """A flipped byte in rank 1's shard: rank 1's canary names it; rank 0's shard is intact, and
    the ranks still agree on every slot, token, position and chain."""
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=4)
    kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", rank=1)
    kv_canary.assert_no_violation(rank=0)
    assert not kv_canary.violations("rank_divergence")
    kv_canary.assert_perturbations_detected()


# No sweeps: one on the prefill side would also see the damaged slot its radix cache keeps.
@pytest.mark.kv_canary(sweep_interval=0)
@pytest.mark.kv_parallel(tp=2)
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", rank=1)
def test_pd_with_tensor_parallel_sides(kv_pd, kv_canary):
    """Prefill and decode both tp=2, rank r's shard moving from prefill rank r to decode rank r
    with its records: damage on prefill rank 1 after its stamp surfaces on decode rank 1."""
    kv_pd.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=3)
    kv_canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD", rank=1,
                               require_distinct_prompts=True)
    kv_canary.assert_no_violation(side="prefill")
    kv_canary.assert_no_violation(rank=0)
