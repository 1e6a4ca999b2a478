"""The adapter's view of vLLM, checked without the canary: after every forward, each (row,
position) the mapping gives holds exactly the K and V a cacheless transformers forward computes
for that request's tokens (every layer and head, through the adapter's per-half views, K stored
transposed included); the view says what vLLM scheduled; block 0 (slot 0) is never a request's;
the cache walk's slots hold what its tokens make."""

from __future__ import annotations

import random

import pytest
import torch

from .support import (
    INSTALL, count_same_step_hits, make_engine, prompts_with_shared_prefixes, reference_kv, stems, unsupported,
)

pytest.importorskip("vllm", reason=INSTALL)

from kvcanary_kernels.records import PREV_CHAIN_HEAD  # noqa: E402

ATOL = 2e-4


class MappingChecker:
    """Forward hooks that gather, after each forward, the K/V every batch row's positions map
    to, and check them against the reference once the request is done."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.group = engine.canary_groups()[0]
        self.gathered: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = {}  # book id -> tokens, K, V
        self.rows_checked = 0

    def before_forward(self, view) -> None:
        pass

    def kv_stored(self, kind, layer, k, v) -> None:
        pass

    def after_forward(self, view) -> None:
        bs, table = self.group.page_size, self.group.mapping.table
        step = len(self.engine._steps) - 1
        for row in range(view.rows.numel()):
            prefix, extend = int(view.prefix_lens[row]), int(view.extend_lens[row])
            request, _ = self.engine.request_at(row, step)
            tokens = view.token_table[row, :prefix + extend].tolist()
            assert -1 not in tokens, "the token table holds every position the row reads or writes"
            positions = torch.arange(prefix + extend)
            slots = table[row, positions // bs] * bs + positions % bs
            assert (slots >= bs).all(), "block 0 is vLLM's null block: never a request's"
            k = torch.stack([layer[slots // bs, slots % bs] for layer in self.group.k_layers])
            v = torch.stack([layer[slots // bs, slots % bs] for layer in self.group.v_layers])
            self.gathered[request] = (tokens, k.clone(), v.clone())
            self.rows_checked += 1

    def end_forward(self) -> None:
        pass


def test_mapped_slots_hold_the_kv_transformers_computes(engine, reference_model, monkeypatch):
    engine.reset()
    monkeypatch.setattr(engine.book, "plan", engine.book.plan)  # restored after the test
    same_step_hits = count_same_step_hits(engine.book)
    checker = MappingChecker(engine)
    engine.set_forward_hooks(checker)
    rng = random.Random(0)
    shared = stems(rng, count=2)
    try:
        for _ in range(3):
            prompts = prompts_with_shared_prefixes(rng, 6, shared)
            outputs = engine.generate(prompts, 6)
            assert [len(o) for o in outputs] == [6] * len(prompts)
    finally:
        engine.set_forward_hooks(None)
    assert len(checker.gathered) == 18 and checker.rows_checked > 18
    assert same_step_hits[0] > 0, "the workload has requests that hit blocks their own step computes"
    heads = reference_model.config.num_key_value_heads
    for tokens, k, v in checker.gathered.values():
        for layer, (ref_k, ref_v) in enumerate(reference_kv(reference_model, tokens)):
            for head in range(heads):
                i = layer * heads + head
                torch.testing.assert_close(k[i], ref_k[head], atol=ATOL, rtol=0)
                torch.testing.assert_close(v[i], ref_v[head], atol=ATOL, rtol=0)


def test_the_walk_names_what_the_cached_slots_hold(engine, reference_model):
    engine.reset()
    rng = random.Random(1)
    prompts = prompts_with_shared_prefixes(rng, 6, stems(rng, count=2))
    outputs = engine.generate(prompts, 4)
    walk = engine.cache_walk()
    assert walk is not None and walk.slots.numel() > 0
    assert not walk.locked.any(), "no request runs: nothing is locked"
    by_slot = dict(zip(walk.slots.tolist(), zip(walk.positions.tolist(), walk.tokens.tolist(),
                                                 walk.prev_slots.tolist())))
    for slot, (position, token, prev) in by_slot.items():
        if position == 0:
            assert prev == PREV_CHAIN_HEAD
        else:
            assert by_slot[prev][0] == position - 1, "the previous slot holds the previous position"
    # Every cached slot holds the K/V of the tokens the walk says lead to it.
    group = engine.canary_groups()[0]
    bs = group.page_size
    sequences = {tuple(p + o) for p, o in zip(prompts, outputs)}
    for slot, (position, token, _) in by_slot.items():
        chain = []
        s = slot
        while s != PREV_CHAIN_HEAD:
            chain.append(by_slot[s][1])
            s = by_slot[s][2]
        tokens = chain[::-1]
        assert any(seq[:len(tokens)] == tuple(tokens) for seq in sequences)
    first = next(s for s, (p, _, _) in by_slot.items() if p == bs - 1)
    chain, s = [], first
    while s != PREV_CHAIN_HEAD:
        chain.append(s)
        s = by_slot[s][2]
    slots = torch.tensor(chain[::-1])
    ref_k, ref_v = reference_kv(reference_model, [by_slot[s][1] for s in slots.tolist()])[0]
    torch.testing.assert_close(group.k_layers[0][slots // bs, slots % bs], ref_k[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(group.v_layers[0][slots // bs, slots % bs], ref_v[0], atol=ATOL, rtol=0)


def test_both_halves_are_fingerprinted_in_the_layout_vllm_keeps():
    """On vLLM's portable CPU paths K is stored dimension-major inside a block (the fingerprint
    reads it element by element), V one contiguous run per slot."""
    engine = make_engine("swa")
    for group in engine.canary_groups():
        assert group.opaque_halves == frozenset() and group.fingerprintable
        assert all(layer[0].is_contiguous() for layer in group.v_layers)
        assert all(layer[0].transpose(0, 1).is_contiguous() for layer in group.k_layers)
    full, swa = engine.canary_groups()
    assert swa.window == 24 - 1, "a token reads the window before it, itself excluded"
    assert len(full.k_layers) == len(swa.k_layers) == 2 * 2  # 2 layers of each kind x 2 KV heads


def test_a_latent_cache_is_one_fingerprinted_row_per_token():
    if reason := unsupported("mla"):
        pytest.skip(reason)
    (latent,) = make_engine("mla", num_blocks=40).canary_groups()
    assert latent.v_layers == [] and latent.fingerprintable and not latent.opaque_halves
    assert latent.page_size == 16, "vLLM's CPU MLA backend sets 16-token blocks"
    assert all(layer[0].is_contiguous() and layer.shape[1:] == (16, 512 + 64) for layer in latent.k_layers)
