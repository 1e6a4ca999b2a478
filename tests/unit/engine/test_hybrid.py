"""A hybrid model (full attention beside recurrent mixers) in the reference engine: greedy outputs
equal a no-cache recomputation while checkpoints are saved, restored and evicted, state slots are
never leaked or held twice, and a canary on every forward stays silent."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig, Request
from pytest_kvcanary.reference_engine.model import DenseState, RecurrentMixer


def check_state_invariants(engine: Engine) -> None:
    """Every state slot but 0 is free, the running state of exactly one running request, or the
    checkpoint of exactly one radix node; a running request's checkpoint is never pending between
    forwards; every host state slot is free or holds exactly one node's checkpoint."""
    held, on_host = [r.state_slot for r in engine.running], []
    assert all(r.checkpoint is None for r in engine.running), "a checkpoint left pending"
    assert all(not r.rollback_slots for r in engine.running), "rollback states left held"
    stack = [c for root in engine.radix_cache.roots.values() for c in root.children.values()]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.state is not None:
            held.append(node.state)
        if node.host_state is not None:
            on_host.append(node.host_state)
    tier = engine.host_tier
    if tier is not None:
        assert len(set(on_host)) == len(on_host) and not set(on_host) & set(tier.free_state_slots)
        assert len(on_host) + len(tier.free_state_slots) == tier.num_state_slots, "a host state slot leaked"
    assert 0 not in held and len(set(held)) == len(held), f"a state slot is held twice: {sorted(held)}"
    assert not set(held) & set(engine.states.free_slots), "a held state slot is also free"
    assert len(held) + engine.states.num_free == engine.states.num_slots - 1, "a state slot leaked"


def run_checked(engine: Engine, prompts: list[list[int]], max_new_tokens: int,
                check_invariants: Callable[[Engine], None]) -> list[Request]:
    """Submit every prompt at once and step until done, checking the pools' and the state pool's
    invariants after each forward; the requests."""
    reqs = [engine.submit(p, max_new_tokens) for p in prompts]
    while engine.scheduler.has_work:
        engine.step()
        check_invariants(engine)
        check_state_invariants(engine)
    return reqs


def _engine(**kw) -> Engine:
    model = ModelConfig(attention="hybrid", max_context=128, seed=3)
    return Engine(EngineConfig(model=model, max_batch_tokens=128, **kw))


@pytest.mark.parametrize("decode_mode", ["eager", "padded"])
def test_outputs_match_a_no_cache_recomputation_under_pressure(decode_mode, random_prompts, assert_reference,
                                                               check_invariants):
    """Pools small enough for KV eviction, retraction and checkpoint eviction; prompts that share a
    prefix and come back (A -> B -> A); decode steps one request at a time, or padded to fixed
    batch sizes as a CUDA graph replays them."""
    engine = _engine(num_slots=56, max_running=4, num_state_slots=9, decode_mode=decode_mode)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=1, kernels="torch"), engine)
    engine.set_forward_hooks(canary)
    prompts = random_prompts(4, 6)
    prompts += [prompts[0], prompts[3], prompts[0]]
    reqs = run_checked(engine, prompts, 16, check_invariants)
    assert_reference(engine, prompts, [r.output_ids for r in reqs])
    assert engine.scheduler.num_restored > 0, "no checkpoint was restored"
    assert engine.radix_cache.num_states_evicted > 0, "no checkpoint was evicted"
    assert engine.scheduler.num_retracted > 0 and engine.radix_cache.num_evicted > 0
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []
    assert canary.sweeps and canary.state is not None


def test_a_scan_in_pieces_equals_one_scan():
    """The state after a sequence's first tokens, carried into the rest, gives the outputs and state
    one scan of the whole sequence gives (what a checkpoint and a decode step rely on)."""
    cfg = ModelConfig(attention="hybrid", seed=1)
    mixer = RecurrentMixer(cfg, 0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
        u = torch.randn(23, mixer.in_proj.out_features, generator=torch.Generator().manual_seed(8))
        zeros = torch.zeros(mixer.width - 1, mixer.channels), torch.zeros(mixer.heads, mixer.dim, mixer.dim)
        whole, end, (mid, mid_12) = mixer.scan(u, *zeros, at=[9, 12])
        head, head_end, _ = mixer.scan(u[:9], *zeros)
        tail, tail_end, _ = mixer.scan(u[9:], *head_end)
    for a, b in zip(mid, head_end):
        torch.testing.assert_close(a, b)
    for a, b in zip(mid_12, mixer.scan(u[9:12], *head_end)[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([head, tail]), whole, rtol=1e-4, atol=1e-5)
    for a, b in zip(tail_end, end):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(DenseState()(mixer, u), whole)
    stepped, (conv, ssm) = mixer.step(u[9:10], head_end[0][None], head_end[1][None])
    first, after_first, _ = mixer.scan(u[9:10], *head_end)
    torch.testing.assert_close(stepped[0], first[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((conv[0], ssm[0]), after_first, rtol=1e-4, atol=1e-5)


def test_a_hybrid_draft_without_an_attention_layer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"needs draft_layers >= model.full_every \(2\).*got draft_layers=1"):
        EngineConfig(model=ModelConfig(attention="hybrid"), speculative_k=2, draft_layers=1)


@pytest.mark.parametrize("k, num_state_slots", [(1, 13), (3, 13), (3, 40)])
def test_speculative_decoding_rolls_the_state_back_to_the_accepted_length(k, num_state_slots, random_prompts,
                                                                          assert_reference, check_invariants):
    """A draft of the target's first two layers (one recurrent, one attention) proposes k tokens;
    the target writes its state after each proposal into rollback slots and keeps the one of the
    accepted length. Outputs equal a no-cache recomputation, proposals are both accepted and
    rejected, no state slot leaks, and a canary on every forward is silent. 13 state slots: too
    few for every request's rollback states at times (those decode one token)."""
    engine = _engine(num_slots=96, max_running=4, num_state_slots=num_state_slots, speculative_k=k, draft_layers=2)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=1, kernels="torch"), engine)
    engine.set_forward_hooks(canary)
    prompts = random_prompts(5, 6)
    prompts += [prompts[0], prompts[3]]
    reqs = run_checked(engine, prompts, 12, check_invariants)
    assert_reference(engine, prompts, [r.output_ids for r in reqs])
    drafter = engine.drafter
    assert 0 < drafter.accepted < drafter.proposed, "no proposal was both made and rejected"
    assert engine.scheduler.num_restored > 0, "no checkpoint was restored"
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []


def test_a_state_pool_too_small_for_the_rows_is_refused():
    with pytest.raises(ValueError, match=r"num_state_slots must be an integer >= 17"):
        EngineConfig(model=ModelConfig(attention="hybrid"), max_running=8, num_state_slots=16)


def test_checkpoints_go_to_the_host_tier_with_their_pages_and_come_back(assert_reference, check_invariants):
    """Pages of 4 tokens, a device pool that holds about two prompts and a host tier: each prompt's
    pages (and checkpoint) are written back as others run, then every prompt comes back; its
    checkpoint is loaded back with its pages and restored, and outputs equal a no-cache
    recomputation with a canary on every forward silent."""
    engine = _engine(num_slots=64, max_running=2, num_state_slots=9, page_size=4, host_num_slots=512)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=1, kernels="torch"), engine)
    engine.set_forward_hooks(canary)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 256, (22,), generator=gen).tolist() for _ in range(4)]
    outputs = [engine.generate([p], 4)[0] for p in prompts + prompts]
    check_invariants(engine)
    check_state_invariants(engine)
    assert_reference(engine, prompts + prompts, outputs)
    tier = engine.host_tier
    assert tier.num_states_written_back > 0 and tier.num_states_loaded_back > 0, "no checkpoint went to the host"
    assert engine.scheduler.num_restored >= tier.num_states_loaded_back
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []
