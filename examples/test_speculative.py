"""Speculative decoding: a draft model proposes k tokens, the target verifies them in one forward
and rolls back what it rejects. The canary guards the target's pool and the draft's (its own pool
group, DRAFT); greedy outputs equal plain decoding. The reference engine is built with speculation
on and guarded by hand here, through the runtime an engine author wires to their own engine."""

import pytest
import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig

PROMPTS = ["speculative decoding drafts ahead", "speculative decoding rolls back", "a third prompt"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_is_exact_and_guarded(k):
    plain = make_reference_engine("mha", DEVICE, seed=0).generate(PROMPTS, 10)
    engine = make_reference_engine("mha", DEVICE, seed=0, speculative_k=k)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(canary)

    assert engine.generate(PROMPTS, 10) == plain
    assert [g.pool.kind.label for g in canary.groups] == ["full", "draft"]
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []
    assert engine.drafter.proposed > engine.drafter.accepted > 0


def test_damage_in_the_draft_pool_is_reported_there():
    engine = make_reference_engine("mha", DEVICE, seed=0, speculative_k=3)
    canary = CanaryRuntime(CanaryConfig(real_data="all", kernels=KERNELS), engine)
    engine.set_forward_hooks(canary)
    req = engine.submit(PROMPTS[0], 8)
    engine.step()
    slot = int(engine.req_to_token_pool.table[req.row, 2])
    engine.pools.draft.k_layers[0].view(torch.uint8)[slot, 0, 0] ^= 1  # one bit of the draft's KV
    engine.step()
    found = canary.drain()
    assert {(v.group, v.half, v.reasons, v.slot, v.position) for v in found} == {
        ("DRAFT", "K", ("verify_real_kv_hash",), slot, 2)}
    assert "HEAD" in {v.phase for v in found}  # before the forward read it
