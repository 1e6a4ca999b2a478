"""PD baseline soak: many requests in several batches (mixed lengths, shared prefixes, duplicates,
decode short of rows and memory) and no fault: neither side may report anything."""

from __future__ import annotations

import pytest
import torch

from pd_support import assert_idle_and_whole, make_engine, make_handle


def soak_batches(seed: int) -> list[tuple[list[str], int]]:
    """4 batches of 12 prompts (3..90 bytes) over a few shared stems, each with a duplicate; and
    each batch's max_new_tokens."""
    gen = torch.Generator().manual_seed(seed)
    stems = ["", "Once upon a time, ", "In a cache far away, there lived ", "0123456789" * 4]

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    batches = []
    for _ in range(4):
        prompts = [stems[pick(4)] + "".join(chr(97 + pick(26)) for _ in range(3 + pick(40))) for _ in range(11)]
        batches.append((prompts + [prompts[0]], 2 + pick(10)))
    return batches


@pytest.mark.parametrize("real_data", ["partial", "all"])
@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_pd_baseline_soak_is_clean(attention, real_data):
    engine_kw = {"num_slots": 300, "swa_num_slots": 160, "max_running": 6}
    handle = make_handle(attention, real_data=real_data, sweep_interval=3, **engine_kw)
    single = make_engine(attention)
    handle.reset(0, ())
    for prompts, max_new_tokens in soak_batches(0):
        assert handle.generate(prompts, max_new_tokens) == single.generate(prompts, max_new_tokens)
    assert handle.violations() == [] and handle.healthy()
    stats = handle.stats()
    assert stats["prefill"]["forwards"] >= 8 and stats["decode"]["forwards"] > stats["prefill"]["forwards"]
    assert all(s["protected_tokens"] > 0 and s["sweeps"] > 0 for s in stats.values())
    assert handle.decode.engine.scheduler.num_retracted > 0, "decode never ran short of memory"
    for side in handle.sides:
        assert_idle_and_whole(side.engine)


def test_pd_baseline_is_clean_with_triton_kernels():
    handle = make_handle("swa", kernels="triton", real_data="all", sweep_interval=1)
    handle.reset(0, ())
    prompts, _ = soak_batches(1)[0]
    handle.generate(prompts[:6] + [prompts[0]], 3)
    assert handle.violations() == [] and handle.healthy()
    assert all(s["sweeps"] > 0 for s in handle.stats().values())
