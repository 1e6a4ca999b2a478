"""Sparse attention (ModelConfig(attention="sparse")): greedy outputs equal a no-cache recomputation
that makes the same selections, with the canary clean (the indexer keys guarded as the INDEXER group,
every selection checked at SELECT) over seeds, prefix hits and pages; the selection is causal, drops
tokens once a query sees more than index_topk, and breaks ties by the lower position; bad sparse
configurations are refused naming the option, and so is a prefill/decode pair."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import GroupKind, Half, Phase, launch_tag
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.canary.seam import UnsupportedAttention
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig, PDPair
from pytest_kvcanary.reference_engine.sparse import IndexQueries, pack, select, unpack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
TOPK = 4
SELECT = launch_tag(Phase.SELECT, Half.K, GroupKind.INDEXER)


def sparse_engine(seed: int = 0, **engine_kw) -> Engine:
    model = ModelConfig(attention="sparse", max_context=64, seed=seed, index_topk=TOPK)
    return Engine(EngineConfig(model=model, max_batch_tokens=64, device=DEVICE, **engine_kw))


def guarded(engine: Engine) -> CanaryRuntime:
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    return runtime


@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 1), (2, 16), (3, 4)])
def test_outputs_equal_a_no_cache_recomputation_and_the_canary_is_clean(seed, page_size, assert_reference,
                                                                        random_prompts):
    engine = sparse_engine(seed, page_size=page_size, num_slots=512)
    runtime = guarded(engine)
    selections = []  # (query positions, selected positions) of every layer's selection
    checked = runtime.indices_selected

    def spy(view, layer):
        queries = torch.cat([torch.arange(p, p + e) for p, e in zip(view.prefix_lens.tolist(),
                                                                     view.extend_lens.tolist())])
        selections.append((queries, view.selected.positions.cpu().clone()))
        checked(view, layer)

    runtime.indices_selected = spy
    engine.set_forward_hooks(runtime)
    prompts = random_prompts(seed, 4, shared=20)  # stems of a whole page of 16 and more
    outputs = engine.generate(prompts, 6)
    outputs += engine.generate(prompts[:2], 6)  # whole prompts cached: prefix hits
    assert_reference(engine, prompts + prompts[:2], outputs)
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    assert engine.scheduler.num_prefix_hits > 0
    assert "indexer" in {g.pool.kind.label for g in runtime.groups}
    assert int(runtime.ring.kernel_runs[SELECT]) == runtime.forwards * engine.config.model.num_layers
    dropped = 0
    for queries, picked in selections:
        used = picked >= 0
        assert (picked[used] <= queries[:, None].expand_as(picked)[used]).all()  # causal
        assert (used.sum(1) == torch.clamp(queries + 1, max=TOPK)).all()  # all it sees, up to topk
        dropped += int((queries + 1 > TOPK).sum())
    assert dropped > 0  # queries that saw more than topk tokens attended to topk of them


def test_the_selection_prefers_higher_scores_then_lower_positions():
    """Equal keys score equally: the lower positions win; a higher score wins over position."""
    dim = 8
    codes = torch.ones(6, dim, dtype=torch.float64)
    codes[4] = 2.0  # position 4 scores twice the others
    scales = torch.ones(6, dtype=torch.float64)
    queries = IndexQueries(torch.ones(3, 1, dim, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64))
    picked = select(queries, codes, scales, torch.tensor([1, 5, 3]), 3)
    assert picked.tolist() == [[0, 1, -1], [4, 0, 1], [0, 1, 2]]


def test_stored_index_keys_read_back_as_their_fp8_round_trip():
    keys = torch.randn(5, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = pack(keys)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 48)
    codes, scales = unpack(rows, 32)
    assert torch.allclose(codes * scales[:, None], keys, rtol=0.07, atol=1e-3)
    assert rows[:, :4].contiguous().view(torch.float32)[:, 0].tolist() == scales.float().tolist()


@pytest.mark.parametrize("model,engine,message", [
    (dict(kv_dtype="fp8_e4m3"), {}, "attention 'sparse' needs kv_dtype 'auto'"),
    (dict(index_topk=0), {}, "index_topk must be"),
    (dict(index_head_dim=-1), {}, "index_head_dim must be"),
    ({}, dict(speculative_k=2), "attention 'sparse' does not work with speculative_k=2 .*use speculative_k=0"),
    ({}, dict(host_num_slots=64), "attention 'sparse' does not work with host_num_slots=64"),
    ({}, dict(decode_mode="padded"), "attention 'sparse' does not work with decode_mode='padded'"),
    ({}, dict(async_scheduling=True), "attention 'sparse' does not work with async_scheduling=True"),
])
def test_bad_sparse_configurations_are_refused_naming_the_option(model, engine, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=ModelConfig(attention="sparse", **model), **engine)


def test_a_prefill_decode_pair_of_sparse_engines_is_refused_so_its_tests_skip():
    with pytest.raises(UnsupportedAttention, match="no attention kind 'sparse': its transfer moves no indexer keys"):
        PDPair(sparse_engine(), sparse_engine())
