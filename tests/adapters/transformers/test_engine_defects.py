"""A defect of transformers itself, proven apart from the canary and named in its reports: 5.17 matches
a prompt of a whole number of pages in full and recomputes its last token into the last matched
block, a cached block another request may be reading. The bytes there change (by rounding only), the
canary reports it at RECHECK in the forward that rewrote it, and the adapter names the write
(EngineDefect), so the workload soak calls the round an engine defect, not a false alarm. From 5.18
the last page stays out of the match: the same workload writes no cached block.

Under async batching 5.17 also hands the block after such a prompt to two identical requests at once
(the soak's replay of it runs on a GPU, tests/adapters/transformers/test_async_batching.py); shown
here on transformers' own cache, in the order async batching calls it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .support import INSTALL, KERNELS, make_engine

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb.versions import (  # noqa: E402
    DEFECT_CACHED_BLOCK_REWRITE, DEFECT_SHARED_DECODE_BLOCK, BlockManagerLayout,
)
from pytest_kvcanary.config import CanaryConfig  # noqa: E402
from pytest_kvcanary.handles.single import EngineHandle  # noqa: E402
from pytest_kvcanary.soak.verdicts import CLEAN, ENGINE_DEFECT  # noqa: E402

# The soak's shrunk replay: a prompt of two whole pages (16 + 16 tokens), then the same prompt again
# while the first decodes (it arrives 5 forwards later and reads the cached pages).
REPLAY = "0/5,2:0.15+374491.17*10@0;0.15+374491.17*5@1"


def test_a_prompt_matched_in_full_rewrites_the_last_cached_block_on_5_17_only():
    engine = make_engine("mha", num_blocks=48, max_batch_tokens=256, max_context=512)
    handle = EngineHandle(engine, CanaryConfig(real_data="partial", kernels=KERNELS))
    handle.reset(0, ())
    full = engine.groups[0]
    rewrites = []  # (step, slot, bytes before the forward, bytes after it)
    map_batch, compute = engine._staging.map, engine._forward._compute

    def rows(slot: int) -> torch.Tensor:
        block, offset = divmod(slot, full.page_size)
        return torch.stack([layer[block, offset] for layer in (*full.k_layers, *full.v_layers)]).clone()

    def mapping(io, pair, step):
        noted = len(engine._hashed_writes.defects)
        map_batch(io, pair, step)
        rewrites.extend([d.step, slot, rows(slot), None] for d in engine._hashed_writes.defects[noted:] for slot in d.slots)

    def computing(model, batch_data):
        compute(model, batch_data)
        for rewrite in rewrites:
            if rewrite[3] is None:
                rewrite[3] = rows(rewrite[1])

    engine._staging.map, engine._forward._compute = mapping, computing
    result = handle.run_workload(replay=REPLAY, shrink_trials=0)
    violations = handle.violations()
    if not isinstance(engine.layout, BlockManagerLayout):  # 5.18+
        assert rewrites == [] and violations == [] and result.counts()[CLEAN] == 1
        return
    assert [(r[0], r[1] % full.page_size) for r in rewrites] == [(rewrites[0][0], full.page_size - 1)]
    step, slot, before, after = rewrites[0]
    assert not torch.equal(before, after), "the rewrite changed the cached bytes"
    assert torch.allclose(before, after, atol=1e-3), "by rounding only: the same token at the same position"
    assert {(v.step, v.phase, v.half, v.reasons, v.slot) for v in violations} == {
        (step, "RECHECK", half, ("verify_real_kv_hash",), slot) for half in ("K", "V")}
    assert result.counts()[ENGINE_DEFECT] == 1 and result.engine_defects() == {DEFECT_CACHED_BLOCK_REWRITE: 2}
    assert result.trustworthy


def test_async_batching_order_on_5_17_gives_two_identical_requests_one_block_to_decode_into():
    """5.17's cache, called as async batching calls it: the next forward's block is allocated before
    the last forward's update marks blocks complete. A prompt of two whole pages matched in full
    recomputes its last token (one block completed, says the scheduler), and the update hashes the
    block after it, which holds one generated token. The identical request adopts it: both tables
    end in one block, and the adapter notes both requests' next writes there as the defect, also in a
    decode step of the same batch (where it looks only at requests marked with a hashed block ahead)."""
    engine = make_engine("mha", num_blocks=48, max_batch_tokens=256, max_context=512)
    if not isinstance(engine.layout, BlockManagerLayout):
        pytest.skip("transformers 5.18+ leaves the last page out of a prefix match")
    from transformers.generation.continuous_batching.requests import RequestState

    page, full = engine.page_size, engine.groups[0]
    prompt = list(range(3, 3 + 2 * page))
    engine.generate([prompt], max_new_tokens=2)  # its two pages are hashed in the prefix cache
    cache = engine.processor.cache
    states = [RequestState(request_id=name, initial_tokens=list(prompt)) for name in ("a", "b")]
    for state in states:
        assert cache.search_prefix_match(state.request_id, prompt) == 2 * page  # matched in full
        cache.allocate_blocks(1, state.request_id, 2)  # the next forward's block, before the update
        state.generated_tokens = [7]  # what the recompute of the last prompt token sampled
        state.position_offset = 2 * page
        cache.mark_shareable_blocks_as_complete(state, 1)
    tables = [engine.layout.block_ids(full, state.request_id) for state in states]
    assert tables[0] == tables[1] and len(tables[0]) == 3, tables  # one block for both to decode into

    decode = [SimpleNamespace(state=state, query_length=1) for state in states]  # both write position 32
    for state in states:
        state.position_offset = 2 * page + 1
    engine._hashed_writes.defects.clear()
    engine._hashed_writes.note(decode, engine._forward.steps, every_row=False)  # a decode step of the same batch
    slot = tables[0][2] * page
    assert [(d.name, d.slots) for d in engine.engine_defects()] == [(DEFECT_SHARED_DECODE_BLOCK, (slot, slot))]
