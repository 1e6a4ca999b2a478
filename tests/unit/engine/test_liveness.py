"""The reference engine's liveness counts (what a soak's liveness gate reads): each counts the path
it names, and only when that path ran."""

from __future__ import annotations

import random

from pytest_kvcanary.reference_engine.pd import PDPair


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


def test_a_prefix_hit_and_a_host_load_are_counted_once_each(make_engine):
    engine = make_engine("mha", page_size=4, num_slots=48, max_running=2, host_num_slots=256)
    rng = random.Random(0)
    first = _prompt(rng, 20)
    engine.generate([first], 1)
    assert engine.liveness() == {"prefix hits": 0, "retractions": 0, "pauses": 0, "host loads": 0}
    engine.generate([first + [7]], 1)  # the first prompt's pages, still on the device
    assert engine.liveness()["prefix hits"] == 1 and engine.liveness()["host loads"] == 0
    for _ in range(3):  # other prompts push it out of the 11-page pool, into host memory
        engine.generate([_prompt(rng, 30)], 1)
    engine.generate([first + [9]], 1)
    assert engine.liveness()["prefix hits"] == 2 and engine.liveness()["host loads"] == 5  # 20 tokens: 5 pages of 4


def test_a_pair_counts_its_transfers_and_both_sides(make_engine):
    pair = PDPair(make_engine("mha"), make_engine("mha"))
    rng = random.Random(1)
    stem = _prompt(rng, 12)
    pair.generate([stem + [1], stem + [2], _prompt(rng, 9)], 2)
    counts = pair.liveness()
    assert counts["transfers"] == 3 and counts["retractions"] == 0
    pair.generate([stem + [3]], 2)
    assert pair.liveness()["transfers"] == 4 and pair.liveness()["prefix hits"] > counts["prefix hits"]
