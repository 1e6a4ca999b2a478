"""Prefill/decode across processes: each engine in a process of its own, the KV and its canary
records moving over torch.distributed point-to-point (gloo on a CPU, NCCL on two GPUs).

The tests share one pair (started once, reset before each; no sweeps: one on the prefill side
would also see damage its radix cache keeps); the last one kills its prefill process, and a pair
launched by torchrun runs apart from the fixture.
"""

import json
import subprocess
import sys

import pytest
import torch

KERNELS = "triton" if torch.cuda.is_available() else "torch"  # on a CPU, their bit-identical references
pytestmark = [pytest.mark.kv_pd(transport="processes"), pytest.mark.kv_canary(kernels=KERNELS, sweep_interval=0)]


def send_fresh_prompts(kv_pd, test):
    """Four prompts of this test's own, from their first token on (the shared pair's slots still
    hold the last test's KV, and stale bytes of the same tokens would be the right ones)."""
    prompts = [f"{test} {i}: once upon a time" for i in range(4)]
    kv_pd.generate(prompts, 3)
    return prompts


def first_request(kv_pd, kv_canary, prompt):
    """The decode side's violations, after checking they all name the request of `prompt`."""
    found = kv_canary.violations(side="decode")
    labels = {kv_pd.request_label(v) for v in found}
    assert len(labels) == 1 and f"'{prompt[:20]}" in labels.pop(), labels
    return found


def test_clean_transfers(kv_pd, kv_canary):
    kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
    kv_canary.assert_no_violation()
    assert kv_pd.transfer_aborts() == []


@pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", target_group="full")
def test_damage_after_the_prefill_stamp_surfaces_in_the_decode_process(kv_pd, kv_canary):
    kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=4)
    kv_canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD", require_distinct_prompts=True)
    kv_canary.assert_no_violation(side="prefill")


def test_a_transport_that_reports_success_over_stale_bytes(kv_pd, kv_canary):
    """The records land, the bytes do not: every position of the first request's prompt fails its
    fingerprint at the first decode forward."""
    kv_pd.arm_transport_fault("stale_bytes", transfer=0)
    (prompt, *_) = send_fresh_prompts(kv_pd, "stale bytes")
    found = first_request(kv_pd, kv_canary, prompt)
    assert {(v.phase, v.reasons) for v in found} == {("HEAD", ("verify_real_kv_hash",))}
    assert {v.position for v in found} == set(range(len(prompt)))


def test_blocks_sent_under_logical_ids(kv_pd, kv_canary):
    """Slots 0, 1, ... instead of the request's own: the records that arrive name other positions."""
    kv_pd.arm_transport_fault("logical_ids", transfer=0)
    (prompt, *_) = send_fresh_prompts(kv_pd, "logical ids")
    found = first_request(kv_pd, kv_canary, prompt)
    assert "verify_position" in {r for v in found for r in v.reasons}
    kv_canary.assert_no_violation(side="prefill")


# NCCL matches sends to receives in order: a transfer sent after later ones is for gloo only.
gloo_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a late transfer reorders sends: gloo (CPU) only")


@gloo_only
def test_a_late_transfer_aborts_its_request(kv_pd, kv_canary):
    """The decode side gives up on the first transfer and aborts its request; its slots are freed
    only once the late bytes drained, so nothing reads them: no violation."""
    kv_pd.set_transfer_timeout(1.0)
    kv_pd.arm_transport_fault("late_transfer", transfer=0)
    outputs = kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=4)
    (aborted,) = kv_pd.transfer_aborts()
    assert aborted.prompt.startswith("0 ") and "timed out" in aborted.reason
    assert len(outputs[0]) == 1 and all(len(out) == 4 for out in outputs[1:])  # the prefill's token only
    kv_canary.assert_no_violation()


@gloo_only
def test_a_transfer_written_into_slots_freed_meanwhile(kv_pd, kv_canary):
    """The defect: the late transfer's slots go to a request of the next batch, and the late bytes
    land over its KV. That request's first decode reads another prompt at position 0."""
    kv_pd.set_transfer_timeout(1.0)
    kv_pd.arm_transport_fault("late_transfer", transfer=0)
    kv_pd.arm_transport_fault("freed_slots", transfer=0)
    kv_pd.send_parallel_requests(12, distinct_prompts=True, max_new_tokens=4)  # two prefill batches
    assert [a.prompt[:2] for a in kv_pd.transfer_aborts()] == ["0 "]
    victims = {kv_pd.request_label(v) for v in kv_canary.violations(side="decode")}
    assert len(victims) == 1 and "'0 " not in victims.pop()
    found = kv_canary.assert_violation("verify_token", side="decode", phase="HEAD")
    assert {v.position for v in found} == {0}  # the prompts differ there only


def test_a_pair_launched_by_torchrun(tmp_path):
    """The same pair joins the world torchrun starts (env://): rank 0 decodes, rank 1 prefills."""
    from pytest_kvcanary.adapters.reference import make_reference_engine

    prompts = [f"{i} torchrun {i * 7} tokens" for i in range(3)]
    others = [f"{i} other prompt {i * 7}" for i in range(3)]  # stale bytes of the same prompt would be right
    ranks_on_gpus = torch.cuda.device_count() >= 2  # torchrun's ranks take a GPU each, else both the CPU
    job = {"spec": {"attention": "mha", "seed": 0, "canary": {"kernels": "triton" if ranks_on_gpus else "torch"}},
           "commands": [["reset", 0], ["generate", prompts, 4], ["reset", 0], ["fault", "stale_bytes", 0],
                        ["generate", others, 4], ["collect"]]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                    "-m", "pytest_kvcanary.handles.pd_side", f"--job={tmp_path / 'job.json'}", f"--out={out}"],
                   check=True, timeout=300)
    clean, _, collected = [json.loads(line)["result"] for line in out.read_text().splitlines()]
    assert clean["outputs"] == make_reference_engine("mha", "cpu", 0).generate(prompts, 4)
    assert clean["aborted"] == {} and clean["failure"] is None
    decode = collected["decode"]["violations"]
    assert decode and {tuple(v["reasons"]) for v in decode} == {("verify_real_kv_hash",)}
    assert collected["prefill"]["violations"] == []


def test_the_prefill_process_killed_mid_transfer(kv_pd):
    """The prefill process dies between a transfer's KV and its records: the decode side aborts
    every request whose transfer did not complete and decodes none of them; the call fails at once
    with that account, and the pair is replaced for the next test."""
    kv_pd.arm_transport_fault("prefill_killed", transfer=1)
    with pytest.raises(RuntimeError, match=r"the prefill process is gone.*the decode side aborted \d request"):
        kv_pd.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=4)
    assert not kv_pd.healthy()
