"""`hybrid` on vLLM: a Qwen3-Next alternating gated delta net and full-attention layers, whose
recurrent state vLLM keeps in a ``MambaSpec`` KV cache group (its ``align`` mode under prefix
caching) and the canary guards as its STATE group (states.py). Prompts sharing prefixes restore
cached states and stay clean; a damaged state byte is reported at HEAD, group state, at the
damaged block, before the forward reads it; a restore from another prefix's state, vLLM's copy
put back wrong, is reported too."""

from __future__ import annotations

import random

import pytest

from .support import INSTALL, PrefixCacheCounter, make_engine, make_handle

pytest.importorskip("vllm", reason=INSTALL)

from kvcanary_kernels.records import GroupKind  # noqa: E402
from pytest_kvcanary.config import PerturbSpec  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402

BLOCK = 64  # the random hybrid checkpoint's block: an attention page as large as a state


@pytest.fixture(scope="module")
def engine():
    return make_engine("hybrid")


def shared_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """n prompts of a 150-token stem (two whole blocks, a checkpoint at each) and a 5-59 token tail."""
    stem = [rng.randrange(256) for _ in range(150)]
    return [stem + [rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def test_vllm_keeps_the_recurrent_state_in_one_mamba_group_in_align_mode(engine):
    config = engine.llm.llm_engine.vllm_config.cache_config
    groups = engine.book.manager.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec) for g in groups] == [MambaSpec, FullAttentionSpec]
    assert (config.mamba_cache_mode, engine.block_size, config.hash_block_size) == ("align", BLOCK, BLOCK)
    full, state = engine.canary_groups()
    assert (full.kind, state.kind, state.mapping) == (GroupKind.FULL, GroupKind.STATE, None)
    assert state.num_slots == engine.settings.num_blocks and len(state.k_layers) == 4  # conv and ssm, 2 layers


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_prompts_sharing_prefixes_restore_cached_states_cleanly(engine, real_data, monkeypatch):
    handle = make_handle(engine, real_data=real_data, sweep_interval=1)
    counter = PrefixCacheCounter(engine, monkeypatch)
    prompts = shared_prompts(random.Random(0), 4)
    first = handle.generate(prompts, 12)
    assert handle.generate(prompts, 12) == first
    assert handle.violations() == []
    assert counter.hits > 0, "vLLM hit its prefix cache"
    runtime = handle.side.runtime
    assert runtime.state.restores() > 0, "cached states were restored"
    walk = engine.checkpoint_walk()
    assert walk is not None and set(walk.lengths.tolist()) >= {2 * BLOCK}
    assert handle.stats()["single"]["sweeps"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_a_flipped_state_byte_is_caught_before_the_forward_reads_it(engine, seed):
    handle = make_handle(engine, (PerturbSpec("real_kv_used", target_group="state", warmup_steps=2),), seed)
    handle.generate(shared_prompts(random.Random(seed), 3), 6)
    detected = [i for i in handle.injections() if i.status == "detected"]
    assert detected and all(i.status == "detected" for i in handle.injections()), handle.injections()
    for inj in detected:
        v = inj.detected_by
        assert (v.group.lower(), v.phase, v.slot, v.step) == ("state", "HEAD", inj.slot, inj.step), (inj, v)
        assert "verify_real_kv_hash" in v.reasons


def test_a_restore_from_the_wrong_column_is_caught(engine, monkeypatch):
    """vLLM's state copy put back wrong: a request that hit the prefix cache is restored from the
    block of a column before its hit's (another, shorter prefix's checkpoint, or the null block).
    HEAD names the request's state block: its record summarizes another prefix length."""
    from vllm.v1.worker import mamba_utils

    handle = make_handle(engine)
    rng = random.Random(5)
    prompts = shared_prompts(rng, 2)
    handle.generate(prompts[:1], 2)  # checkpoints at 64 and 128 tokens
    original = mamba_utils.collect_mamba_copy_meta  # the adapter's wrapper: it hears the wrong copy too

    def one_column_early(copy_bufs, kv_cache_config, funcs, group_ids, src, dst, *args, **kwargs):
        return original(copy_bufs, kv_cache_config, funcs, group_ids, max(src - 1, 0), dst, *args, **kwargs)

    monkeypatch.setattr(mamba_utils, "collect_mamba_copy_meta", one_column_early)
    handle.generate(prompts[1:], 2)
    found = [v for v in handle.violations() if v.group.lower() == "state" and v.phase == "HEAD"]
    assert found and all("verify_position" in v.reasons for v in found), handle.violations()
