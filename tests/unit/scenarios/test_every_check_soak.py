"""Zero false positives with every check on: recheck, write-through, the reserved-slot sentinel,
missing slots, token checks, the sweep and context keys, under eager and padded decode, mha and
swa, with shared prefixes read in several contexts, eviction, retraction and sliding windows.
(tests/e2e/test_soak.py soaks the defaults longer, in one context and eager decode only.)"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pytest_kvcanary.reference_engine import Engine

from scenario_support import attach_canary, first_reports, make_engine, off_greedy_reference

CONTEXTS = (0, 3, 8)


def count_prefix_hits(engine: Engine) -> Counter[int]:
    """Per context, how many prefix lookups of the radix cache matched at least one token."""
    hits: Counter[int] = Counter()
    match = engine.radix_cache.match_prefix

    def counted(key, context=0):
        result = match(key, context)
        hits[context] += result.slots.numel() > 0
        return result

    engine.radix_cache.match_prefix = counted
    return hits


@pytest.mark.parametrize("decode_mode", ["eager", "padded"])
@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_every_check_on_reports_nothing_under_pressure(attention, decode_mode):
    """24 requests over 3 stems and 8 tails in 3 contexts, arriving 1-4 at a time, 1-10 new
    tokens each, through pools that hold about two of the longest; max_running 6 pads decode
    batches of 3 and 5."""
    engine = make_engine(attention, num_slots=72, swa_num_slots=40, max_running=6, decode_mode=decode_mode)
    runtime = attach_canary(engine, sweep_interval=4)
    hits = count_prefix_hits(engine)
    causes: Counter[str] = Counter()
    engine.add_free_listener(lambda group, slots, cause: causes.update([cause]))
    rng = random.Random(2)
    stems = [[rng.randrange(1, 256) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    tails = [[rng.randrange(1, 256) for _ in range(rng.randrange(1, 13))] for _ in range(8)]
    requests = []
    while len(requests) < 24:
        for _ in range(rng.randrange(1, 5)):
            prompt = rng.choice(stems) + rng.choice(tails)
            requests.append(engine.submit(prompt, rng.randrange(1, 11), rng.choice(CONTEXTS)))
        for _ in range(rng.randrange(1, 3)):
            engine.step()
    while engine.scheduler.has_work:
        engine.step()

    assert first_reports(runtime) == (None, set())
    assert runtime.health_problems() == [] and runtime.sweeps == engine.forward_count // 4
    assert not any(off_greedy_reference(engine, r) for r in requests)
    assert engine.radix_cache.num_evicted > 0 and engine.scheduler.num_retracted > 0
    assert any("radix dedup" in cause for cause in causes), causes
    assert all(hits[c] > 0 for c in CONTEXTS), hits
    if attention == "swa":
        assert causes["slid out of the attention window"] > 0 and engine.radix_cache.num_swa_evicted > 0
