"""Async batching on transformers (GPU only: transformers runs it on CUDA streams). The canary reads
each forward's inputs from the IO pair that forward consumed; a run is clean and generates what
synchronous batching generates; a decode forward fed a wrong carried-over token (the device-side
hand-over async batching adds) is reported at the slot it wrote by that forward's TAIL: the token
table holds the token the forward before sampled for that position. A prompt found whole in the
prefix cache is clean too, though transformers 5.17 hashes the block after it before it is written; two
such prompts at once share that block on 5.17, and the soak names it the engine's defect."""

from __future__ import annotations

import random

import pytest
import torch

from .support import INSTALL, make_engine, make_handle, reference_kv

pytest.importorskip("transformers", reason=INSTALL)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="async batching needs a CUDA device")

from kvcanary_kernels.records import GroupKind  # noqa: E402
from pytest_kvcanary.adapters.transformers_cb.versions import (  # noqa: E402
    DEFECT_SHARED_DECODE_BLOCK, BlockManagerLayout,
)
from pytest_kvcanary.config import CanaryConfig  # noqa: E402
from pytest_kvcanary.handles.single import EngineHandle  # noqa: E402
from pytest_kvcanary.soak.verdicts import CLEAN, ENGINE_DEFECT, FALSE_ALARM  # noqa: E402

PROMPTS = [[11 + i for i in range(37)], [90 + i for i in range(21)]]
NEW_TOKENS = 12
WRONG_STEP = 3  # a decode forward whose inputs are carried over from the forward before


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_async_batching_is_clean_and_generates_what_sync_does(graphs):
    engine = make_engine("mha", use_async_batching=True, use_cuda_graph=graphs, canary_graphs=graphs)
    handle = EngineHandle(engine, CanaryConfig(real_data="all", sweep_interval=2, kernels="triton"))
    handle.reset(0, ())
    outputs = handle.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    handle.side.runtime.drain()
    assert handle.violations() == []
    if graphs:  # each IO pair's forwards replay from that pair's graphs, the canary inside
        assert len(engine._io.device_ios) == 2 and all(io.graphs._storage for io in engine._io.device_ios)
    assert outputs == make_engine("mha").generate(PROMPTS, max_new_tokens=NEW_TOKENS)


def test_a_prompt_found_whole_in_the_prefix_cache_is_clean():
    """transformers 5.17 matches such a prompt in full; under async batching the block after it is
    already allocated for the next forward when the first token is sampled, and transformers hashes
    it then, with one of its tokens known. The block log leaves it out until its tokens are known
    (before, the sweeps reported every slot of it: the logged tokens were the first one repeated)."""
    handle = make_handle("mha", use_async_batching=True)
    page = handle.engine.page_size
    prompt = [random.Random(1).randrange(256) for _ in range(2 * page)]
    for _ in range(2):  # the second time the prompt's pages come from the prefix cache
        handle.generate([prompt], max_new_tokens=page)
    handle.side.runtime.drain()
    assert handle.violations() == []
    assert handle.side.runtime.sweeps > 0


def test_a_wrong_carried_over_token_is_reported_by_the_tail_of_that_forward_at_its_slot():
    handle = make_handle("mha", use_async_batching=True)
    engine = handle.engine
    io = engine.processor.inputs_and_outputs
    carry = io.carry_over_tokens
    full = next(g for g in engine.groups if g.kind is GroupKind.FULL)
    written: dict[str, tuple[int, int]] = {}  # request id -> (position, slot) the wrong token went to

    def carry_one_higher(input_ids, carry_over_ids, prev_output_ids):
        if engine._forward.steps != WRONG_STEP:
            return carry(input_ids, carry_over_ids, prev_output_ids)
        for future in io.io_pairs[io.current_pair].host_io.requests_in_batch:
            position = future.state.position_offset - 1
            table = engine.layout.block_ids(full, future.state.request_id)
            written[future.state.request_id] = (position, table[position // full.page_size] * full.page_size +
                                                position % full.page_size)
        return carry(input_ids, carry_over_ids, prev_output_ids + 1)

    io.carry_over_tokens = carry_one_higher
    outputs = handle.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert len(written) == len(PROMPTS)

    # The damage, without the canary: the slot holds K of another token than the request generated.
    for prompt, output, (position, slot) in zip(PROMPTS, outputs, written.values()):
        keys = reference_kv(engine.model, prompt + output)[0][0]
        held = full.k_layers[0].reshape(-1, *keys.shape[1:])
        assert torch.allclose(held[slot - 1].float(), keys[position - 1].float(), atol=1e-3)  # the one before: right
        assert not torch.allclose(held[slot].float(), keys[position].float(), atol=1e-3)

    handle.side.runtime.drain()
    violations = handle.violations()
    first = {(v.position, v.slot) for v in violations
             if v.phase == "TAIL" and v.step == WRONG_STEP and "write_token" in v.reasons}
    assert first == set(written.values()), violations[:4]
    assert min(v.step for v in violations) == WRONG_STEP
    assert {v.slot for v in violations} == {slot for _, slot in written.values()}  # nowhere else


def test_without_the_wrong_token_async_decoding_reports_nothing():
    handle = make_handle("mha", use_async_batching=True)
    handle.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    handle.side.runtime.drain()
    assert handle.violations() == []


# A workload the soak shrank to 7 requests on transformers 5.17 (swa, 48 blocks of 16): a batch of three
# rows shrinks to two on one IO pair and comes back whole on the other, whose staged lanes had never held
# the third row's (HEAD then read a request's blocks into another request's lane: verify_token over
# that whole lane, a suspected false alarm while every output was right).
SHRUNK_REPLAY = ("0/5,2:-1.0+422903.202*5@2;4.16+953999.190*12@2;2.33+50154.202*27@0;5.33+475397.1*19@2;"
                 "1.48+123725.217*8@2;5.32+509682.15*13@2;1.47+710858.246*24@2")


def test_every_forward_stages_the_lane_of_each_of_its_rows_and_the_soak_replay_is_trustworthy():
    engine = make_engine("swa", num_blocks=48, max_batch_tokens=256, max_requests_per_batch=8, max_context=512,
                         use_async_batching=True)
    handle = EngineHandle(engine, CanaryConfig(real_data="partial", kernels="triton"))
    handle.reset(0, ())
    wrong = []
    staging = engine._staging
    map_batch = staging.map

    def checked(io, pair, step):
        map_batch(io, pair, step)
        batch = io.requests_in_batch
        staged = staging.buffers._hosts[pair]["lanes"][0, :len(batch)].tolist()
        lanes = [staging.lanes.lane_of[future.state.request_id] for future in batch]
        if staged != lanes:
            wrong.append((step, pair, staged, lanes))

    staging.map = checked
    result = handle.run_workload(replay=SHRUNK_REPLAY, shrink_trials=0)
    assert wrong == [], wrong[:3]
    assert result.trustworthy and result.forwards > 20, result.summary()


# A round the soak found on transformers 5.17 (mha, 48 blocks of 16) and shrank to 3 requests: one
# prompt of three whole pages, sent three times (two at once, one a wave later).
SHARED_BLOCK_REPLAY = "1014/2:4.16+1043604.32*35@1/:4.16+1043604.32*17@0;4.16+1043604.32*35@0"


def test_two_identical_prompts_decoding_into_one_block_are_named_the_engine_defect_on_5_17():
    """Under async batching 5.17 hashes the block after a prompt matched in full before it is written,
    and the identical request at the same point adopts it: both decode into it. The writes are
    noted as the engine's defect in every forward (same-batch decode steps included), so the round
    is an engine defect, not a suspected false alarm; 5.18+ keeps the blocks apart: clean."""
    engine = make_engine("mha", num_blocks=48, max_batch_tokens=256, max_requests_per_batch=8, max_context=512,
                         use_async_batching=True)
    handle = EngineHandle(engine, CanaryConfig(real_data="partial", kernels="triton"))
    handle.reset(0, ())
    shared = []  # (step, block) a block two running requests' tables both hold, each written that forward
    map_batch, full = engine._staging.map, engine.groups[0]

    def checked(io, pair, step):
        map_batch(io, pair, step)
        owners = {}
        for future in io.requests_in_batch:
            blocks = engine.layout.block_ids(full, future.state.request_id)
            written = blocks[(future.state.position_offset - 1) // engine.page_size]
            if owners.setdefault(written, future.state.request_id) != future.state.request_id:
                shared.append((step, written))

    engine._staging.map = checked
    result = handle.run_workload(replay=SHARED_BLOCK_REPLAY, shrink_trials=0)
    counts = result.counts()
    if not isinstance(engine.layout, BlockManagerLayout):  # 5.18+
        assert shared == [] and counts[CLEAN] == len(result.rounds) and handle.violations() == []
        return
    assert shared, "two requests write one block in one forward (transformers' own block tables say so)"
    assert counts[FALSE_ALARM] == 0 and counts[ENGINE_DEFECT] >= 1, result.summary()
    assert DEFECT_SHARED_DECODE_BLOCK in result.engine_defects(), result.engine_defects()
    assert result.trustworthy
