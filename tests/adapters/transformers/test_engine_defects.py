"""A defect of transformers itself, proven apart from the canary and named in its reports: 5.17 matches
a prompt of a whole number of pages in full and recomputes its last token into the last matched
block, a cached block another request may be reading. The bytes there change (by rounding only), the
canary reports it at RECHECK in the forward that rewrote it, and the adapter names the write
(EngineDefect), so the workload soak calls the round an engine defect, not a false alarm. From 5.18
the last page stays out of the match: the same workload writes no cached block."""

from __future__ import annotations

import pytest
import torch

from .support import INSTALL, KERNELS, make_engine

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb.versions import (  # noqa: E402
    DEFECT_CACHED_BLOCK_REWRITE, BlockManagerLayout,
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
    map_batch, compute = engine._map_batch, engine._compute

    def rows(slot: int) -> torch.Tensor:
        block, offset = divmod(slot, full.page_size)
        return torch.stack([layer[block, offset] for layer in (*full.k_layers, *full.v_layers)]).clone()

    def mapping(pair):
        noted = len(engine._defects)
        map_batch(pair)
        rewrites.extend([d.step, slot, rows(slot), None] for d in engine._defects[noted:] for slot in d.slots)

    def computing(model, batch_data):
        compute(model, batch_data)
        for rewrite in rewrites:
            if rewrite[3] is None:
                rewrite[3] = rows(rewrite[1])

    engine._map_batch, engine._compute = mapping, computing
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
