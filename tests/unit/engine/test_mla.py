"""Latent (mla) KV pools: the attention they feed, the canary over their single half, and a
prefill/decode transfer of latent rows."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvcanary_kernels.records import GroupKind, Half
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, ModelConfig, PDPair
from pytest_kvcanary.reference_engine.attention import DenseKV
from pytest_kvcanary.reference_engine.model import CausalLM, LatentAttention, apply_rope, rope_cos_sin

KERNELS = "triton" if torch.cuda.is_available() else "torch"


def attach(engine: Engine, **settings: object) -> CanaryRuntime:
    """Every check on: real-KV fingerprints over whole latent rows, recheck, write-through."""
    runtime = CanaryRuntime(CanaryConfig(**{"real_data": "all", "sweep_interval": 0, "kernels": KERNELS, **settings}),
                            engine)
    engine.set_forward_hooks(runtime)
    return runtime


@torch.no_grad()
def test_latent_attention_equals_attention_over_up_projected_keys_and_values():
    """What LatentAttention computes over latent rows is causal multi-head attention whose keys are
    [W_UK c, k_rope] and values W_UV c, each head up-projected from the latent explicitly."""
    cfg = ModelConfig(attention="mla", num_heads=4, head_dim=16, kv_lora_rank=32, qk_rope_head_dim=16, seed=3)
    attn = CausalLM(cfg).model.layers[1].self_attn
    assert isinstance(attn, LatentAttention)
    x = torch.randn(9, cfg.hidden, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    got = attn(x, cos, sin, DenseKV(positions))

    latent = attn.latent(x, cos, sin)
    c, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    w_uk, w_uv = attn.up_projections()
    keys = torch.cat([torch.einsum("hdr,tr->thd", w_uk, c), k_rope[:, None, :].expand(-1, cfg.num_heads, -1)], -1)
    values = torch.einsum("hdr,tr->thd", w_uv, c)
    q_nope, q_rope = attn.q_proj(x).view(9, cfg.num_heads, -1).split([cfg.head_dim, cfg.qk_rope_head_dim], -1)
    queries = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (queries, keys, values)), is_causal=True)
    expected = attn.o_proj(out.transpose(0, 1).reshape(9, -1))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("decode_mode", ["eager", "padded"])
def test_canary_over_latent_pools_stays_clean_under_sharing_eviction_and_retraction(
        decode_mode, make_engine, check_invariants):
    """20 requests over 3 shared stems, arriving a few at a time through pools that hold about two
    of the longest: prefix reuse, eviction and retraction all happen, greedy outputs equal the
    no-cache recomputation, and the canary (one K half per slot) reports nothing."""
    engine = make_engine("mla", num_slots=64, max_running=5, decode_mode=decode_mode)
    runtime = attach(engine, sweep_interval=3)
    assert [(g.pool.kind, set(g.halves)) for g in runtime.groups] == [(GroupKind.FULL, {Half.K})]
    stored: list[tuple[GroupKind, int, tuple[int, ...], object]] = []
    kv_stored = runtime.kv_stored
    runtime.kv_stored = lambda kind, layer, k, v: (stored.append((kind, layer, tuple(k.shape), v)),
                                                   kv_stored(kind, layer, k, v))
    rng = random.Random(5)
    stems = [[rng.randrange(1, 256) for _ in range(rng.randrange(6, 14))] for _ in range(3)]
    reqs = []
    while len(reqs) < 20:
        for _ in range(rng.randrange(1, 4)):
            prompt = rng.choice(stems) + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 10))]
            reqs.append(engine.submit(prompt, rng.randrange(2, 12)))
        engine.step()
    while engine.scheduler.has_work:
        engine.step()
    check_invariants(engine)

    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    assert runtime.sweeps > 0 and runtime.stats().protected_tokens > 0
    assert engine.radix_cache.num_evicted > 0 and engine.scheduler.num_retracted > 0
    for req in reqs:
        ids = torch.tensor(req.prompt_ids + req.output_ids[:-1], device=engine.device)
        expected = engine.model.logits_without_cache(ids).argmax(-1)[len(req.prompt_ids) - 1:].tolist()
        assert req.output_ids == expected, f"request {req.rid}"
    latent_dim = engine.config.model.latent_dim
    assert {(kind, layer, shape[1:], v) for kind, layer, shape, v in stored} == {
        (GroupKind.FULL, layer, (1, latent_dim), None) for layer in range(engine.config.model.num_layers)}


def test_damage_to_a_latent_row_is_reported_on_its_one_half(make_engine):
    """A flipped bit of a cached latent row: the next forward's HEAD names the slot, the position and
    half K. A latent row the forward stores wrong (its bytes changed after write-through): TAIL
    names write_real_kv_hash."""
    engine = make_engine("mla")
    runtime = attach(engine)
    req = engine.submit(list(b"a latent prompt"), 6)
    engine.step()
    engine.step()
    slot = int(engine.req_to_token_pool.table[req.row, 4])
    engine.pools.full.k_layers[2].view(torch.uint8)[slot, 5] ^= 8
    step = runtime.forwards
    engine.step()
    hits = {(v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.step) for v in runtime.drain()}
    assert ("HEAD", "K", "FULL", ("verify_real_kv_hash",), slot, 4, step) in hits

    engine.pools.full.k_layers[2].view(torch.uint8)[slot, 5] ^= 8  # repaired
    kv_stored = runtime.kv_stored

    written: list[int] = []

    def store_then_scribble(kind, layer, k, v):
        kv_stored(kind, layer, k, v)
        if layer == engine.config.model.num_layers - 1:  # the slot this decode writes, its row just stored
            written.append(int(engine.req_to_token_pool.table[req.row, req.kv_len]))
            engine.pools.full.k_layers[layer][written[0]] += 1.0

    runtime.kv_stored = store_then_scribble
    step = runtime.forwards
    engine.step()
    new = {(v.phase, v.half, v.reasons, v.slot, v.step) for v in runtime.drain()}
    assert new == {("TAIL", "K", ("write_real_kv_hash",), written[0], step)}


def test_prefill_decode_transfer_of_latent_rows(make_engine):
    """The prefill side sends each prompt's latent rows and their records; the decode side's first
    HEAD re-verifies them all, clean, and outputs equal a single engine's."""
    prompts = [list(b"latent transfer one"), list(b"latent transfer two, longer"), list(b"three")]
    single = make_engine("mla").generate(prompts, 6)
    pair = PDPair(make_engine("mla"), make_engine("mla"))
    sides = [attach(pair.prefill), attach(pair.decode)]
    pair.add_transfer_listener(lambda src, dst: sides[1].import_records(dst, sides[0].export_records(src)))
    assert pair.generate(prompts, 6) == single
    for runtime in sides:
        runtime.drain()
        assert runtime.log.violations == [] and runtime.health_problems() == []
    assert sides[1].stats().forwards > 0
