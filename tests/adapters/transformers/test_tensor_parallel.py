"""transformers' continuous batching split over two tensor-parallel ranks (gloo on the CPU), each
rank with its own canary and the cross-rank check around its forwards.

Clean: the greedy outputs are those of one process and nothing fires. The bug: rank 1's allocator
hands the first two requests each other's first block (each rank stays consistent with itself, so
its own canary has nothing to see and the outputs do not change); proved without the canary by
the block tables transformers keeps on each rank and by rank 1's pool bytes, and reported by rank
1's rank_divergence.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from pytest_kvcanary.adapters.transformers_cb import transformers_shards
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine.parallel.topology import Topology
from pytest_kvcanary.handles.factories import install_hint
from pytest_kvcanary.handles.parallel import ParallelHandle
from pytest_kvcanary.handles.rank import RankContext, RankSpec

from .support import INSTALL, make_handle

pytest.importorskip("transformers", reason=INSTALL)
pytest.importorskip("accelerate", reason=f"accelerate (transformers' tensor parallel) is not installed: "
                                         f"{install_hint('transformers')}")

# Prompts plus new tokens fit one block (16 tokens): a block never completes, so no block is hashed
# and the swapped blocks keep transformers' prefix cache consistent on rank 1.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 101, 102, 103, 104]]
NEW_TOKENS = 6
# With two GPUs one rank on each (NCCL, the Triton kernels); else both ranks on the CPU (gloo, the
# torch kernels, bit-identical to the Triton ones).
TWO_GPUS = torch.cuda.device_count() >= 2
DEVICES = ("cuda:0", "cuda:1") if TWO_GPUS else ("cpu", "cpu")
CANARY = CanaryConfig(kernels="triton" if TWO_GPUS else "torch", real_data="all", sweep_interval=1)


def start(attention: str, setup: Any = None) -> ParallelHandle:
    spec = RankSpec("single", transformers_shards(attention, 0, None), CANARY, Topology(tp=2), DEVICES,
                    setup=setup, timeout_s=120.0)
    handle = ParallelHandle(spec)
    handle.reset(0, ())
    return handle


@pytest.mark.parametrize(("kind", "topology", "message"), [
    ("single", Topology(tp=3), "tp=3 must divide the model's num_attention_heads (4)"),
    ("single", Topology(tp=2, pp=2), "engine 'transformers' runs tensor parallel only"),
    ("pd", Topology(tp=2), "kind 'pd' needs prefill/decode pairs"),
])
def test_what_does_not_split_is_refused_before_any_rank_starts(kind: str, topology: Topology, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RankSpec(kind, transformers_shards("mha", 0, None), CANARY, topology, ("cpu",) * topology.world)


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_two_ranks_generate_what_one_process_does_and_agree(attention: str) -> None:
    single = make_handle(attention)
    expected = single.generate(PROMPTS, NEW_TOKENS)
    handle = start(attention)
    try:
        assert handle.generate(PROMPTS, NEW_TOKENS) == expected
        assert handle.violations() == []
        stats = handle.stats()
        assert sorted(stats) == ["single rank 0", "single rank 1"]
        assert all(s["forwards"] > 0 for s in stats.values()), stats
        kv_heads = handle.call(_kv_heads)
        assert kv_heads == [1, 1]  # 2 KV heads, one per rank
    finally:
        handle.close()


def _kv_heads(context: RankContext) -> int:
    return context.engines["single"].groups[0].k_layers[0].shape[2]


def _allocators(context: RankContext) -> list[Any]:
    cache = context.engines["single"].processor.cache
    allocators = getattr(cache, "cache_allocators", None)  # 5.18+: by attention type
    return list(allocators.values()) if allocators is not None else list(cache.group_cache_managers)  # 5.17


def _hand_blocks(context: RankContext, cross: bool) -> None:
    """Record each request's blocks as transformers' allocator hands them (in every rank); with
    cross, the bug on rank 1 only: the first two requests get each other's first block."""
    engine = context.engines["single"]
    engine.handed = {}
    for allocator in _allocators(context):
        name = "allocate_cache_to_request" if hasattr(allocator, "allocate_cache_to_request") else "allocate_blocks"
        allocate = getattr(allocator, name)

        def handing(*args: Any, allocator: Any = allocator, allocate: Any = allocate) -> Any:
            result = allocate(*args)
            table = allocator.block_table
            if cross and context.rank == 1 and len(engine.handed) == 1 and len(table) == 2:  # the second request's
                a, b = table.values()
                a[0], b[0] = b[0], a[0]
            engine.handed.update({r: list(blocks) for r, blocks in table.items()})
            return result

        setattr(allocator, name, handing)


def _handed(context: RankContext) -> dict[str, list[int]]:
    return context.engines["single"].handed


def _block_bytes(blocks: list[tuple[int, int]], context: RankContext) -> list[bytes]:
    """This rank's K and V bytes of every layer in the first n slots of each (block, n) (the slots
    a request wrote: the others hold what the allocation left there, on 5.17 whatever memory held)."""
    group = context.engines["single"].groups[0]
    layers = (*group.k_layers, *group.v_layers)
    return [b"".join(t[block, :n].contiguous().cpu().numpy().tobytes() for t in layers) for block, n in blocks]


def _run(cross: bool) -> tuple[list[list[int]], list[dict[str, list[int]]], list[list[bytes]], list[Any]]:
    """Outputs, each rank's block tables, each rank's bytes in the slots the first two requests wrote
    in rank 0's blocks, and the violations, of PROMPTS on two ranks (with cross: the bug on rank 1)."""
    handle = start("mha", setup=functools.partial(_hand_blocks, cross=cross))
    try:
        outputs = handle.generate(PROMPTS, NEW_TOKENS)
        handed = handle.call(_handed)
        written = [(handed[0][r][0], len(prompt) + NEW_TOKENS - 1) for r, prompt in zip(handed[0], PROMPTS[:2])]
        return outputs, handed, handle.call(functools.partial(_block_bytes, written)), handle.violations()
    finally:
        handle.close()


def test_a_rank_whose_allocator_hands_other_blocks_is_named() -> None:
    clean_outputs, clean_handed, clean_bytes, clean_found = _run(cross=False)
    assert clean_found == []
    assert clean_handed[0] == clean_handed[1]

    outputs, handed, found_bytes, found = _run(cross=True)
    # Without the canary: rank 1 holds the first two requests' KV in blocks other than rank 0's
    # (transformers' own block tables differ, and rank 1's bytes in rank 0's blocks are not the
    # clean run's), while each rank is consistent with itself (the outputs do not change).
    first_two = list(handed[0])[:2]
    assert [handed[1][r][0] for r in first_two] == [handed[0][r][0] for r in reversed(first_two)]
    assert found_bytes[0] == clean_bytes[0]
    assert found_bytes[1] != clean_bytes[1]
    assert outputs == clean_outputs
    # The canary: rank 1's rank_divergence, naming rank 0 as the reference; nothing on rank 0 and
    # nothing else on rank 1 (its own checks see a consistent rank).
    assert found, "the cross-rank check missed a rank whose blocks diverged"
    assert {(v.reason, v.rank) for v in found} == {("rank_divergence", 1)}, found
    assert all(v.peer == 0 for v in found), found
    # At the forward that first wrote the crossed blocks (the first: both prompts' prefill), then at
    # every forward writing into them (no block fills, so no cache walk holds them).
    assert [v.step for v in found] == list(range(NEW_TOKENS)), found
    assert all(v.phase == "TAIL" and v.slot == -1 for v in found), found


PLUGIN_RUN = """
import pytest

@pytest.mark.kv_parallel(tp=2)
def test_two_ranks(kv_engine, kv_canary):
    assert kv_engine.generate([[5, 6, 7], [40, 41, 42, 43]], 3)
    kv_canary.assert_no_violation()
    assert sorted(kv_engine.stats()) == ["single rank 0", "single rank 1"]

@pytest.mark.kv_parallel(pp=2)
def test_two_stages(kv_engine):
    pass
"""


def test_the_plugin_runs_transformers_tensor_parallel(pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_parallel(tp=2) on --kv-canary-engine=transformers runs two ranks; kv_parallel(pp=2) skips,
    saying why."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makepyfile(PLUGIN_RUN)
    result = pytester.runpytest_subprocess("--kv-canary", "--kv-canary-engine=transformers", "-rs", "-p",
                                           "no:randomly")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*kv_parallel(pp=...) must be 1 with engine 'transformers': it runs parallel over "
                                 "tp only*"])
