"""The fault injector, which reaches engines only through the seam, damages transformers' KV and
the canary names each fault at its slot with its mode's reason, over ten seeds per mode and pool
group; a request's block table pointed at another live block is caught at the next HEAD; and
transformers 5.17's own write into a shared block is caught after the forward that makes it."""

from __future__ import annotations

import random
from contextlib import nullcontext
from typing import Callable, ContextManager

import pytest
from packaging.version import Version

from .support import INSTALL, make_handle

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.canary.seam import ForwardView  # noqa: E402
from pytest_kvcanary.config import PerturbSpec  # noqa: E402
from pytest_kvcanary.perturb.ledger import DETECTING_REASONS  # noqa: E402

SEEDS = range(10)
# Where each mode's damage is read first: the forward's own HEAD, the sweep over idle cached
# blocks, or the next forward's HEAD (the sweep when the block went idle first).
# A forward fed another token is reported by its own TAIL.
PHASES = {"req_to_token": {"HEAD"}, "real_kv_used": {"HEAD"}, "real_kv_unused_cache": {"SWEEP"},
          "real_kv_post_forward": {"HEAD", "SWEEP"}, "next_token_swap": {"TAIL"}}
CASES = [("mha", mode, "full") for mode in PHASES] + [
    ("swa", mode, group) for mode in ("req_to_token", "real_kv_used", "real_kv_post_forward", "next_token_swap")
    for group in ("full", "swa") if (mode, group) != ("next_token_swap", "swa")]


@pytest.fixture(scope="module")
def handles():
    """One engine per attention kind, reset for each run."""
    return {attention: make_handle(attention) for attention in ("mha", "swa")}


def two_waves(handle, seed: int) -> None:
    """Two waves of four distinct prompts of 18-40 tokens (each opens with a token of its own, so
    none shares a block with another); the first wave's blocks stay cached, idle, while the second
    runs. A final sweep reads whatever damage is still there."""
    rng = random.Random(seed)
    for wave in range(2):
        prompts = [[256 + 4 * wave + i] + [rng.randrange(256) for _ in range(rng.randrange(17, 40))] for i in range(4)]
        handle.generate(prompts, max_new_tokens=6)
    handle.side.runtime.sweep()
    handle.side.runtime.drain()


@pytest.mark.parametrize("attention,mode,group", CASES)
def test_every_injected_fault_is_named_at_its_slot(handles, attention, mode, group):
    handle = handles[attention]
    detected = 0
    for seed in SEEDS:
        handle.reset(seed, (PerturbSpec(mode, target_group=group, warmup_steps=2),))
        two_waves(handle, seed)
        injections = handle.injections()
        violations = handle.violations()
        assert injections, f"seed {seed}: nothing injected"
        for inj in injections:
            assert inj.status in ("detected", "escaped"), f"seed {seed}: {inj.describe()}"
            if inj.status == "escaped":
                assert inj.cause, inj.describe()
                continue
            v = inj.detected_by
            assert set(v.reasons) & set(DETECTING_REASONS[mode]) and v.phase in PHASES[mode], inj.describe()
            assert v.group.lower() == inj.group and (inj.group == group or mode == "next_token_swap")
            if mode == "req_to_token":
                assert (v.step, v.row) == (inj.step, inj.row)
            else:
                assert v.slot == inj.slot
            detected += 1
        # Nothing else is reported: every violation is at a damaged slot, or about a request one of
        # whose mapping entries was wrong (TAIL seeds its chain from the last position read, so a
        # wrong entry there shows again at the next forward).
        request_at = handle.engine.request_at
        flipped = {inj.slot for inj in injections if mode != "req_to_token"}
        remapped = {request_at(inj.row, inj.step) for inj in injections if mode == "req_to_token"}
        stray = [v for v in violations if v.slot not in flipped and request_at(v.row, v.step) not in remapped]
        assert not stray, f"seed {seed}: {stray[:3]}"
    assert detected >= len(SEEDS)


class DamageBlockTable:
    """Forward hooks around the runtime: once `at` forwards ran, point the second block-table entry
    of a running request at another running request's first block (in transformers' own table,
    which the adapter copies before the next forward), and put it back after that forward."""

    def __init__(self, handle, at: int) -> None:
        self.runtime, self.engine, self.at = handle.side.runtime, handle.engine, at
        self.damage = None  # (request id, table, original block, wrong block, forward it is read in)

    def before_forward(self, view: ForwardView) -> None:
        self.runtime.before_forward(view)

    def after_forward(self, view: ForwardView) -> None:
        self.runtime.after_forward(view)
        if self.damage is not None:
            _, table, original, _, _ = self.damage
            table[1] = original

    def end_forward(self, device_work: Callable[[], ContextManager[None]] = nullcontext) -> None:
        self.runtime.end_forward(device_work)
        if self.damage is None and self.runtime.forwards == self.at:
            full = self.engine.groups[0]
            states = sorted(self.engine.processor.scheduler.active_requests.values(), key=lambda s: s.request_id)
            victim, other = states[0], states[1]
            table = self.engine.layout.block_ids(full, victim.request_id)
            assert victim.position_offset >= 2 * full.page_size + 1, "the damaged entry is only read, never written"
            wrong = self.engine.layout.block_ids(full, other.request_id)[0]
            self.damage = (victim.request_id, table, table[1], wrong, self.runtime.forwards)
            table[1] = wrong


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_block_table_entry_pointed_at_another_live_block_is_caught_at_head(attention):
    handle = make_handle(attention)
    hooks = DamageBlockTable(handle, at=4)
    handle.engine.set_forward_hooks(hooks)
    rng = random.Random(0)
    prompts = [[256 + i] + [rng.randrange(256) for _ in range(40)] for i in range(3)]
    handle.generate(prompts, max_new_tokens=8)
    handle.side.runtime.drain()
    request_id, _, _, wrong, step = hooks.damage
    page = handle.engine.page_size
    first = min(handle.violations(), key=lambda v: (v.step, v.position))
    assert (first.phase, first.group, first.step) == ("HEAD", "FULL", step)
    assert handle.engine.request_at(first.row, first.step)[0] == request_id
    assert first.position == page and first.slot == wrong * page
    assert "verify_position" in first.reasons and "verify_chain_hash" in first.reasons


def test_recomputing_a_fully_cached_prompt_writes_a_shared_block_before_5_18():
    """transformers 5.17 matches a prompt of whole pages in full, then recomputes its last token:
    the KV of that position is written again into the cached block every request with the prompt
    reads, so a request reading it in the same forward sees its bytes change (RECHECK), and with
    write-through TAIL may find the slot holding another row's write of it. 5.18 keeps the last
    page out of the match."""
    import transformers

    handle = make_handle("mha")
    page = handle.engine.page_size
    prompt = [random.Random(1).randrange(256) for _ in range(2 * page)]
    handle.generate([prompt], max_new_tokens=3)  # both pages cached
    handle.generate([prompt, prompt + [7], prompt], max_new_tokens=3)
    handle.side.runtime.drain()
    found = {(v.phase, v.reasons, v.position) for v in handle.violations()}
    if Version(transformers.__version__) < Version("5.18"):
        recheck = ("RECHECK", ("verify_real_kv_hash",), 2 * page - 1)
        assert recheck in found
        assert found <= {recheck, ("TAIL", ("write_real_kv_hash",), 2 * page - 1)}
    else:
        assert found == set()
