"""Prefill/decode disaggregation: a fault after the prefill stamp surfaces on the decode side."""

import pytest


@pytest.mark.kv_attention("mha", "swa")
def test_pd_baseline_is_clean(kv_pd, kv_canary):
    kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()


# No sweeps: one on the prefill side would also see the damaged slot its radix cache keeps.
@pytest.mark.kv_canary(sweep_interval=0)
@pytest.mark.kv_attention("mha", "swa")
@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", target_group="full")
def test_transfer_is_guarded(kv_pd, kv_canary):
    """Fails when the canary records no longer travel with the KV (mutation: PDHandle._on_transfer
    does nothing): the decode side then reports other reasons, or other positions, than the
    damaged bytes."""
    kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=4)
    kv_canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD",
                               require_distinct_prompts=True)
    damaged = {i.position for i in kv_canary.perturbations()}
    seen = {(v.position, v.reasons) for v in kv_canary.violations(side="decode")}
    assert seen == {(p, ("verify_real_kv_hash",)) for p in damaged}
    kv_canary.assert_no_violation(side="prefill")
