"""The canary checks what vLLM's forward consumed, not what the scheduler planned: bugs put back
into vLLM's model runner with a monkeypatch feed one request's forward other inputs than its
schedule says, the damage is shown without the canary, the canary reports it with its reason at
its slots, and the same workload runs clean on the unpatched code.

- A slot mapping shifted by one for one request: its K/V is stored one slot late, so the slots
  its block table names hold other than a cacheless forward computes (write_real_kv_hash at TAIL).
- Positions shifted by one for one request after its slots were mapped: its RoPE runs at p + 1,
  so its K is not a cacheless forward's (write_position at TAIL: stored p + 1, expected p).
- Input ids with their lowest bit flipped for one request: its K/V are computed for other tokens
  than the scheduler's (write_token at TAIL: stored the id embedded, expected the scheduler's).
- A block table whose first entry for one decoding request names another request's block: its
  attention reads KV the scheduler never gave it (verify_token at HEAD, at that block's slots).
"""

from __future__ import annotations

import random

import pytest
import torch

from .support import INSTALL, ViewRecorder, make_handle, reference_kv

pytest.importorskip("vllm", reason=INSTALL)

from vllm.v1.worker.block_table import BlockTable  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

ATOL = 2e-4
VICTIM = 1  # the batch row whose inputs the bugs change


def victim_tokens(query_start_loc: torch.Tensor) -> slice:
    return slice(int(query_start_loc[VICTIM]), int(query_start_loc[VICTIM + 1]))


def shift_slot_mapping(monkeypatch, damage: dict) -> None:
    compute = BlockTable.compute_slot_mapping

    def shifted(self, num_reqs, query_start_loc, positions):
        compute(self, num_reqs, query_start_loc, positions)
        if positions.shape[0] > num_reqs:  # a prefill
            self.slot_mapping.gpu[victim_tokens(query_start_loc)] += 1
            damage["forwards"] = damage.get("forwards", 0) + 1

    monkeypatch.setattr(BlockTable, "compute_slot_mapping", shifted)


def change_prepared_prefill(monkeypatch, damage: dict, change) -> None:
    """After vLLM's model runner prepares a prefill's inputs, change(runner, the victim's tokens)."""
    prepare = GPUModelRunner._prepare_inputs

    def changed(self, scheduler_output, num_scheduled_tokens):
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        if scheduler_output.total_num_scheduled_tokens > self.input_batch.num_reqs:  # a prefill
            change(self, victim_tokens(self.query_start_loc.cpu))
            damage["forwards"] = damage.get("forwards", 0) + 1
        return out

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", changed)


def shift_positions(monkeypatch, damage: dict) -> None:
    def shift(runner, tokens: slice) -> None:
        runner.positions[tokens] += 1

    change_prepared_prefill(monkeypatch, damage, shift)


def change_input_ids(monkeypatch, damage: dict) -> None:
    def flip(runner, tokens: slice) -> None:
        runner.input_ids.gpu[tokens] ^= 1

    change_prepared_prefill(monkeypatch, damage, flip)


def borrow_a_block(monkeypatch, damage: dict, manager) -> None:
    """At the first decode, the victim's first block-table entry becomes row 0's (after its slots
    were mapped: only its attention reads through it). `damage` keeps the block and the blocks
    vLLM's KV cache manager gave the victim."""
    prepare = GPUModelRunner._prepare_inputs

    def borrowed(self, scheduler_output, num_scheduled_tokens):
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        if scheduler_output.total_num_scheduled_tokens == batch.num_reqs and "block" not in damage:  # a decode
            table = batch.block_table[0].get_device_tensor(batch.num_reqs)
            damage["block"], damage["given"] = int(table[0, 0]), manager.get_block_ids(batch.req_ids[VICTIM])[0]
            table[VICTIM, 0] = table[0, 0]
        return out

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", borrowed)


def two_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in (45, 70)]  # no block shared, none full at the end


def cache_differs_from_reference(engine, reference_model, prompt: list[int], slots: list[int]) -> set[int]:
    """The slots (of `prompt`'s positions, in order) whose K or V, in any layer and head, is not
    what a cacheless transformers forward computes."""
    group = engine.canary_groups()[0]
    bs, heads = group.page_size, reference_model.config.num_key_value_heads
    at = torch.tensor(slots)
    damaged = set()
    for layer, (ref_k, ref_v) in enumerate(reference_kv(reference_model, prompt)):
        for head in range(heads):
            i = layer * heads + head
            for cache, ref in ((group.k_layers[i], ref_k[head]), (group.v_layers[i], ref_v[head])):
                held = cache[at // bs, at % bs]
                off = ~torch.isclose(held, ref, atol=ATOL, rtol=0).all(dim=-1)
                damaged |= {s for s, bad in zip(slots, off.tolist()) if bad}
    return damaged


@pytest.mark.parametrize("patched", [True, False], ids=["bug", "clean"])
@pytest.mark.parametrize("bug,reason", [(shift_slot_mapping, "write_real_kv_hash"),
                                        (shift_positions, "write_position"),
                                        (change_input_ids, "write_token")])
def test_a_prefill_fed_other_inputs_than_its_schedule_is_reported_at_tail(
        engine, reference_model, monkeypatch, bug, reason, patched):
    engine.reset()
    damage: dict = {}
    if patched:
        bug(monkeypatch, damage)
    handle = make_handle(engine, sweep_interval=0)
    views = ViewRecorder(engine)
    prompts = two_prompts()
    handle.generate(prompts, 1)
    monkeypatch.undo()
    (written,) = views.written  # one forward: both prefills, in vLLM's batch order
    starts = [0, len(prompts[0])]
    own = [written[starts[b]:starts[b] + len(p)] for b, p in enumerate(prompts)]
    damaged = [cache_differs_from_reference(engine, reference_model, p, s) for p, s in zip(prompts, own)]
    violations = handle.violations()
    if not patched:
        assert damaged == [set(), set()] and violations == []
        return
    assert damage["forwards"] == 1
    assert damaged[0] == set() and damaged[VICTIM] == set(own[VICTIM]), "the victim's slots hold other KV"
    assert {v.phase for v in violations} == {"TAIL"}
    assert {v.slot for v in violations} == set(own[VICTIM]), violations
    assert all(v.reasons[0] == reason for v in violations), violations
    if reason == "write_position":
        assert all(v.stored == v.expected + 1 for v in violations), violations
    elif reason == "write_token":
        assert all(v.stored == v.expected ^ 1 for v in violations), violations
    else:
        assert {v.half for v in violations} == {"K", "V"}


@pytest.mark.parametrize("patched", [True, False], ids=["bug", "clean"])
def test_a_decode_reading_another_requests_block_is_reported_at_head(engine, monkeypatch, patched):
    engine.reset()
    damage: dict = {}
    if patched:
        borrow_a_block(monkeypatch, damage, engine.book.manager)
    handle = make_handle(engine, sweep_interval=0)
    prompts = two_prompts()
    handle.generate(prompts, 2)
    monkeypatch.undo()
    violations = handle.violations()
    if not patched:
        assert violations == []
        return
    # The damage, from vLLM's own bookkeeping: the block the victim's attention read is not one its
    # KV cache manager gave it.
    assert damage["block"] not in damage["given"]
    bs = engine.block_size
    heads = [v for v in violations if v.phase == "HEAD" and v.step == 1]
    assert heads and all(v.row == VICTIM for v in heads), violations
    # The borrowed block holds row 0's tokens: each position where they differ from the victim's.
    differ = {damage["block"] * bs + p for p in range(bs) if prompts[0][p] != prompts[VICTIM][p]}
    assert {v.slot for v in heads if "verify_token" in v.reasons} == differ, heads
