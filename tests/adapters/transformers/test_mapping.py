"""The adapter's view of transformers, checked without the canary: for every forward, each
(row, position) the mapping gives holds exactly the K/V a cacheless transformers forward computes
for that request's tokens, the view (derived on the device from the forward's inputs) says what
transformers' request states say the batch holds, and the cache walk's slots hold what its tokens
make. Block 0 (the reserved slot 0) is never any request's."""

from __future__ import annotations

import random
from contextlib import nullcontext
from typing import Callable, ContextManager

import pytest
import torch

from .support import INSTALL, make_engine, prompts_with_shared_prefixes, reference_kv, stems

pytest.importorskip("transformers", reason=INSTALL)

from pytest_kvcanary.adapters.transformers_cb import load, random_checkpoint  # noqa: E402
from pytest_kvcanary.canary.walk import paged_entries  # noqa: E402
from kvcanary_kernels.records import PREV_CHAIN_HEAD, UNKNOWN, GroupKind  # noqa: E402

ATOL = 1e-4


def mapped_slots(table: torch.Tensor, row: int, positions: torch.Tensor, page: int, ring: int) -> torch.Tensor:
    local = positions % ring if ring else positions
    return table[row, local // page] * page + local % page


def kv_at(layers: tuple[torch.Tensor, ...], i: int, slots: torch.Tensor, page: int) -> torch.Tensor:
    return layers[i][slots // page, slots % page]


class MappingChecker:
    """Forward hooks that check, after each forward, every position each batch row holds, and
    every few forwards the cache walk."""

    def __init__(self, engine, reference_model) -> None:
        self.engine, self.model = engine, reference_model
        self.forwards = self.rows_checked = self.walked_blocks = 0

    def before_forward(self, view) -> None:
        pass

    def after_forward(self, view) -> None:
        engine = self.engine
        tables = {g.kind: table for g, table in zip(engine.groups, (p.mapping.table for p in engine.canary_groups()))}
        batch = engine.processor.inputs_and_outputs.requests_in_batch
        lengths = [(f.state.position_offset - f.query_length, f.query_length) for f in batch]
        padding = [(0, 0)] * (view.rows.numel() - len(batch))
        assert list(zip(view.prefix_lens.tolist(), view.extend_lens.tolist())) == lengths + padding
        start = 0
        for row in range(view.rows.numel()):
            prefix, extend = int(view.prefix_lens[row]), int(view.extend_lens[row])
            if extend == 0:
                assert prefix == 0, "a padded row reads nothing"
                continue
            lane = int(view.rows[row])
            length = prefix + extend
            state = batch[row].state
            tokens = torch.tensor((state.initial_tokens + state.generated_tokens)[:length],
                                  device=view.token_table.device)
            table = view.token_table[lane]
            assert torch.equal(table[:length], tokens), "the table holds the request's tokens (host's or sampled)"
            assert (table[length:] == UNKNOWN).all(), "nothing past the request's tokens (a lane's old request's)"
            assert torch.equal(view.input_ids[start:start + extend], tokens[prefix:])
            assert torch.equal(view.positions[start:start + extend],
                               torch.arange(prefix, length, device=view.positions.device))
            start += extend
            reference = reference_kv(self.model, tokens.tolist())
            for group in engine.groups:
                first = max(0, length - group.ring) if group.ring else 0
                positions = torch.arange(first, length, device=view.positions.device)
                slots = mapped_slots(tables[group.kind], lane, positions, group.page_size, group.ring)
                assert (slots // group.page_size != 0).all(), "block 0 holds the reserved slot 0"
                for i, layer in enumerate(group.layers):
                    k, v = reference[layer]
                    torch.testing.assert_close(kv_at(group.k_layers, i, slots, group.page_size), k[first:],
                                               atol=ATOL, rtol=0)
                    torch.testing.assert_close(kv_at(group.v_layers, i, slots, group.page_size), v[first:],
                                               atol=ATOL, rtol=0)
            self.rows_checked += 1

    def end_forward(self, device_work: Callable[[], ContextManager[None]] = nullcontext) -> None:
        self.forwards += 1
        if self.forwards % 3 == 0:
            self.check_walk()

    def check_walk(self) -> None:
        """Each walked block's slots hold the K/V of the token path the walk gives up to it."""
        walk = self.engine.cache_walk()
        if walk is None:
            return
        walk = paged_entries(walk)
        group = self.engine.groups[0]
        page = group.page_size
        entry = {s: (t, p, prev) for s, t, p, prev in zip(walk.slots.tolist(), walk.tokens.tolist(),
                                                          walk.positions.tolist(), walk.prev_slots.tolist())}
        for slot, (_, position, _) in entry.items():
            if slot % page != page - 1:
                continue  # one check per block, from its last slot
            path, cursor = [], slot
            while cursor != PREV_CHAIN_HEAD:
                token, pos, prev = entry[cursor]
                path.append((cursor, token, pos))
                cursor = prev
            path.reverse()
            assert [p for _, _, p in path] == list(range(position + 1))
            reference = reference_kv(self.model, [t for _, t, _ in path])
            slots = torch.tensor([s for s, _, _ in path[-page:]], device=walk.slots.device)
            for i, layer in enumerate(group.layers):
                torch.testing.assert_close(kv_at(group.k_layers, i, slots, page), reference[layer][0][-page:],
                                           atol=ATOL, rtol=0)
            self.walked_blocks += 1


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_every_mapped_slot_holds_what_transformers_computed(attention):
    # 64-token forwards split the longer prompts' prefill; 96 blocks keep the prefix cache busy.
    engine = make_engine(attention, max_batch_tokens=64, num_blocks=96)
    checker = MappingChecker(engine, load(random_checkpoint(attention, 0), engine.device.type)[0])
    engine.set_forward_hooks(checker)
    rng = random.Random(0)
    shared = stems(rng)
    for wave in range(3):
        engine.generate(prompts_with_shared_prefixes(rng, 6, shared), max_new_tokens=rng.randrange(4, 12))
    assert checker.rows_checked > 50
    if attention == "mha":
        assert checker.walked_blocks > 10
    else:
        assert [g.kind for g in engine.groups] == [GroupKind.FULL, GroupKind.SWA]
        assert engine.cache_walk() is None  # transformers shares no prefix in hybrid models


def test_reset_frees_every_block_and_says_so():
    engine = make_engine("mha")
    freed = []
    engine.add_free_listener(lambda kind, slots, cause: freed.append((kind, cause, slots.numel())))
    engine.generate([[5] * 40, [6] * 40], max_new_tokens=4)
    hashed, locked = (set(blocks) for blocks in engine.layout.hashed_blocks())
    assert hashed and not locked  # cached, no request holds them
    freed.clear()
    engine.reset()
    assert not any(engine.layout.hashed_blocks()) and not paged_entries(engine.cache_walk()).slots.numel()
    assert sum(n for _, cause, n in freed if cause == "engine reset") == len(hashed) * engine.page_size
    assert engine.request_at(0, 0) is None


class Passive:
    def before_forward(self, view) -> None:
        pass

    def after_forward(self, view) -> None:
        pass

    def end_forward(self, device_work: Callable[[], ContextManager[None]] = nullcontext) -> None:
        pass


def test_request_at_names_the_request_of_each_row_and_forward():
    engine = make_engine("mha")
    engine.set_forward_hooks(Passive())
    engine.generate(["first prompt", "second prompt"], max_new_tokens=2)
    assert engine.request_at(0, 0) == ("kvcanary-0", "first prompt")
    assert engine.request_at(1, 0) == ("kvcanary-1", "second prompt")
    assert engine.request_at(2, 0) is None
    ids = (7, 8, 9)  # a prompt of token ids is named by its ids
    engine.generate([ids], max_new_tokens=1)
    last = engine._forward.steps - 1
    held = {engine.request_at(lane, last) for lane in range(engine._staging.lanes.count)}
    assert ("kvcanary-2", "[7, 8, 9]") in held


def test_a_prompt_of_token_ids_outside_the_vocabulary_is_refused_naming_the_first():
    engine = make_engine("mha")
    vocab = engine.model.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, vocab_size={vocab}\); got {bad}$"):
            engine.generate([[1] * 300 + [bad, vocab + 5]], max_new_tokens=1)


class TableChecker(Passive):
    """Compares, at each HEAD, every batch row's block-table rows (derived on the device from the
    forward's read and write indices) with the block ids transformers holds for its request."""

    def __init__(self, engine) -> None:
        self.engine, self.rows = engine, 0

    def before_forward(self, view) -> None:
        engine = self.engine
        for row, future in enumerate(engine.batch_requests()):
            lane, length = int(view.rows[row]), future.state.position_offset
            for group in engine.groups:
                held = engine.layout.block_ids(group, future.state.request_id)
                derived = engine._forward.tables[group.kind][lane].tolist()
                if group.ring:  # the ring pages its request has written so far
                    pages = -(-min(length, group.ring) // group.page_size)
                    assert derived[:pages] == held[:pages], (engine._forward.steps, group.kind, derived, held)
                else:  # the blocks of every position it reads, then zeros
                    blocks = -(-length // group.page_size)
                    assert derived == held[:blocks] + [0] * (len(derived) - blocks), (engine._forward.steps, derived, held)
            self.rows += 1


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_the_block_tables_are_those_the_forward_reads_through(attention):
    engine = make_engine(attention, max_batch_tokens=32, max_requests_per_batch=2, num_blocks=96)
    checker = TableChecker(engine)
    engine.set_forward_hooks(checker)
    rng = random.Random(2)  # shared prefixes: blocks shared and de-duplicated (mha), prefills split
    engine.generate(prompts_with_shared_prefixes(rng, 5, stems(rng)), max_new_tokens=20)
    assert checker.rows > 40


class LaneRecorder(Passive):
    """Records, per forward, each request's batch row and lane, every token-table entry sent and
    every lane cleared."""

    def __init__(self, engine) -> None:
        self.rows, self.lanes, self.sent, self.cleared = {}, {}, [], []
        buffers = engine._staging.buffers
        set_entries, clear_lanes = buffers.set_entries, buffers.clear_lanes

        def recording(lanes, starts, counts, tokens) -> None:
            runs = [(lane, start + i) for lane, start, count in zip(lanes, starts, counts) for i in range(count)]
            assert len(runs) == len(tokens)
            self.sent += [(lane, position, token) for (lane, position), token in zip(runs, tokens)]
            set_entries(lanes, starts, counts, tokens)

        def clearing(lanes) -> None:
            self.cleared += lanes
            clear_lanes(lanes)

        buffers.set_entries, buffers.clear_lanes = recording, clearing
        self.engine = engine

    def before_forward(self, view) -> None:
        for row, future in enumerate(self.engine.batch_requests()):
            request = future.state.request_id
            self.rows.setdefault(request, set()).add(row)
            self.lanes.setdefault(request, set()).add(int(view.rows[row]))


def test_a_request_keeps_its_lane_as_it_moves_between_batch_rows_and_sends_each_token_once():
    # 32-token forwards: the prompts' prefills are split and the batches reorder as requests join.
    engine = make_engine("mha", max_batch_tokens=32, max_requests_per_batch=4)
    recorder = LaneRecorder(engine)
    engine.set_forward_hooks(recorder)
    prompts = [[t] * n for t, n in ((3, 40), (4, 9), (5, 27), (6, 13))]
    engine.generate(prompts, max_new_tokens=6)
    assert any(len(rows) > 1 for rows in recorder.rows.values()), "no request moved between batch rows"
    assert all(len(lanes) == 1 for lanes in recorder.lanes.values())
    assert len({lane for lanes in recorder.lanes.values() for lane in lanes}) == 4
    tokens = [(lane, position) for lane, position, token in recorder.sent if token != UNKNOWN]
    assert len(tokens) == len(set(tokens))
    # Every prompt token, in the lane of its request; a decode step of the same batch sends none
    # (the tokens it consumes are the ones the device sampled).
    for request, prompt in zip(sorted(recorder.lanes, key=lambda r: int(r.rsplit("-", 1)[1])), prompts):
        [lane] = recorder.lanes[request]
        assert {(lane, position) for position in range(len(prompt))} <= set(tokens)
    assert len(tokens) < sum(len(p) + 6 - 1 for p in prompts)
    # A lane is cleared once, in its request's first forward (UNKNOWN past the request's tokens).
    assert sorted(recorder.cleared) == sorted(lane for lanes in recorder.lanes.values() for lane in lanes)


def test_lanes_handed_to_later_requests_map_what_transformers_computed():
    # 2 requests per batch: 4 lanes for 7 requests, so later requests take the lanes used longest ago.
    engine = make_engine("mha", max_batch_tokens=32, max_requests_per_batch=2, num_blocks=96)
    checker = MappingChecker(engine, load(random_checkpoint("mha", 0), engine.device.type)[0])
    engine.set_forward_hooks(checker)
    rng = random.Random(1)
    engine.generate(prompts_with_shared_prefixes(rng, 7, stems(rng)), max_new_tokens=5)
    owners = [{engine.request_at(lane, step) for step in range(engine._forward.steps)} - {None} for lane in range(4)]
    assert sum(len(o) for o in owners) == 7 and max(len(o) for o in owners) > 1
    assert engine.request_at(4, engine._forward.steps - 1) is None  # 4 lanes: twice the batch
    assert checker.rows_checked > 20
