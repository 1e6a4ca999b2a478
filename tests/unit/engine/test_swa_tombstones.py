"""SWA: slid-out slots are freed, cached as tombstones, matches end where the window is resident,
and a later insert revives a tombstone with the inserting request's SWA slots."""

from __future__ import annotations


def _residency(engine, tokens):
    """(FULL slot, SWA-resident?) per position of the cached path for tokens."""
    walk = engine.cache_walk()
    mapped = engine.pools.swa.full_to_swa.cpu()
    path = {}
    for slot, pos, tok in zip(walk.slots.tolist(), walk.positions.tolist(), walk.tokens.tolist()):
        if pos < len(tokens) and tok == tokens[pos]:
            path.setdefault(pos, []).append(slot)
    return [(path[p][0], bool(mapped[path[p][0]])) for p in range(len(path))]


def test_slide_out_tombstones_and_match_cut(make_engine, assert_reference, shadow_canary, check_invariants):
    engine = make_engine("swa")
    window = engine.config.model.window
    canary = shadow_canary(engine)
    prompt = list(b"12345678")  # 8 tokens, > window
    a = engine.submit(prompt, 10)
    while engine.scheduler.has_work:
        engine.step()
    check_invariants(engine)
    assert_reference(engine, [prompt], [a.output_ids])

    # The prompt was cached (resident) after prefill; decode slid positions [8, 16 - window) out
    # (the last slide ran after the forward that reached kv_len 16); [12, 17) stayed resident.
    tokens = a.token_ids[:17]
    resident = [r for _, r in _residency(engine, tokens)]
    assert resident == [True] * 8 + [False] * (16 - window - 8) + [True] * (17 - (16 - window))

    cut = engine.radix_cache.match_prefix(tokens[:11] + [(tokens[11] + 1) % 256])
    assert cut.slots.numel() == 8, "a match must not end inside the tombstone"
    assert engine.radix_cache.match_prefix(tokens[:14]).slots.numel() == 8, "only 2 resident tokens after the tombstone"
    through = engine.radix_cache.match_prefix(tokens[:16])
    assert through.slots.numel() == 16, "a tombstone may sit before a resident window"

    # C reuses 16 tokens through the tombstone; its windowed layers read only [12, 16).
    c_prompt = tokens[:16] + [7]
    c = engine.submit(c_prompt, 3)
    engine.step()
    assert canary.views[-1].prefix_lens.tolist() == [16]
    while engine.scheduler.has_work:
        engine.step()
    assert_reference(engine, [c_prompt], [c.output_ids])


def test_insert_revives_tombstone(make_engine, assert_reference, shadow_canary, check_invariants):
    engine = make_engine("swa")
    canary = shadow_canary(engine)
    prompt = list(b"abcdefgh")
    a = engine.submit(prompt, 10)
    while engine.scheduler.has_work:
        engine.step()
    tokens = a.token_ids[:17]
    before = _residency(engine, tokens)
    assert not before[8][1] and not before[10][1]

    # B shares 11 tokens with A's cached path; it may reuse only 8 (the tombstone starts there),
    # computes positions 8..12 itself, and on insert hands its SWA slots for 8..10 to the tree.
    b_prompt = tokens[:11] + [1, 2]
    b = engine.submit(b_prompt, 4)
    engine.step()
    view = canary.views[-1]
    assert view.prefix_lens.tolist() == [8] and view.extend_lens.tolist() == [5]
    b_own = canary.written[-1][:3].tolist()
    after = _residency(engine, tokens)
    assert [s for s, _ in after[:11]] == [s for s, _ in before[:11]], "tree kept its FULL slots"
    assert [r for _, r in after[8:11]] == [True] * 3 and not after[11][1], "only B's span revived"
    assert engine.req_to_token_pool.read(b.row, 8, 11).tolist() == [s for s, _ in before[8:11]]
    assert set(b_own) <= set(engine.pools.full.free_slots.tolist()), "B's duplicate slots not freed"
    check_invariants(engine)
    while engine.scheduler.has_work:
        engine.step()
    assert_reference(engine, [b_prompt], [b.output_ids])
