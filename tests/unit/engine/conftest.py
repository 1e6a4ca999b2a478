"""Shared fixtures for the reference-engine tests: engine factory, no-cache reference check,
ownership invariants, and a pure-Python shadow canary that checks every slot a forward reads."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from pytest_kvcanary.canary.seam import ForwardHooks, ForwardView
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.kv_pool import slot_pages

WINDOW = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def make_engine() -> Callable[..., Engine]:
    def make(attention: str = "mha", *, seed: int = 0, **engine_kw) -> Engine:
        model = ModelConfig(attention=attention, window=WINDOW, max_context=64, seed=seed)
        engine_kw.setdefault("max_batch_tokens", 64)
        engine_kw.setdefault("device", DEVICE)
        return Engine(EngineConfig(model=model, **engine_kw))

    return make


def random_prompts(seed: int, n: int, shared: int = 10) -> list[list[int]]:
    """n prompts over two shared stems, with exact duplicates and one prompt a prefix of another."""
    gen = torch.Generator().manual_seed(seed)
    stems = [torch.randint(0, 256, (shared,), generator=gen).tolist() for _ in range(2)]
    prompts = []
    for i in range(n):
        tail = torch.randint(0, 256, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append(stems[i % 2] + tail)
    return prompts + [prompts[0], prompts[1][:-1]]


@pytest.fixture
def assert_reference() -> Callable[[Engine, list[list[int]], list[list[int]]], None]:
    """Each output token must be the argmax of a full no-cache forward over prompt + the outputs
    before it (one teacher-forced forward per prompt)."""

    def check(engine: Engine, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor(prompt + out[:-1], device=engine.device)
            expected = engine.model.logits_without_cache(ids).argmax(-1)[len(prompt) - 1:].tolist()
            assert out == expected, f"prompt {prompt}: engine {out} != reference {expected}"

    return check


def check_invariants(engine: Engine, writing: torch.Tensor | None = None) -> None:
    """Every FULL page is free, cached by exactly one tree node or owned by exactly one running
    request (writing: the slots a forward about to run was given, whose new pages are not yet
    counted); lock counts match the running requests; every host page is free or held by exactly one
    node, and a node off the device has a host copy and nothing on the device below it; SWA
    residency matches the tombstones, and everything the next forward's windowed layers read is
    resident."""
    full, swa, table = engine.pools.full, engine.pools.swa, engine.req_to_token_pool
    ps = full.page_size
    walk = engine.cache_walk()
    owned = torch.cat([table.pages(r.row, r.prefix_len, r.kv_len) for r in engine.running] +
                      [torch.empty(0, dtype=torch.int64)])
    new = [] if writing is None else [torch.tensor(sorted(set((writing // ps).tolist()) - set(owned.tolist())),
                                                   dtype=torch.int64)]
    used = torch.cat([slot_pages(walk.slots, ps), owned, *new])
    assert used.unique().numel() == used.numel(), "a page is held twice"
    assert not set(used.tolist()) & set(full.free_pages.tolist()), "a held page is also free"
    assert used.numel() + full.free_pages.numel() == full.num_pages - 1, "a page leaked"

    nodes, locks = [], {}
    stack = [c for root in engine.radix_cache.roots.values() for c in root.children.values()]
    while stack:
        nodes.append(stack.pop())
        stack.extend(nodes[-1].children.values())
    for req in engine.running:
        node = req.last_node
        while node.parent is not None:
            locks[node] = locks.get(node, 0) + 1
            node = node.parent
    assert all(n.lock_ref == locks.get(n, 0) for n in nodes), "lock counts disagree with running requests"
    tier = engine.host_tier
    if tier is not None:
        held = torch.cat([slot_pages(n.host_value, ps) for n in nodes if n.host_value is not None] +
                         [torch.empty(0, dtype=torch.int64)])
        assert held.unique().numel() == held.numel(), "a host page is held twice"
        assert not set(held.tolist()) & set(tier.free_pages.tolist()), "a held host page is also free"
        assert held.numel() + tier.free_pages.numel() == tier.num_pages, "a host page leaked"
        for n in nodes:
            if n.value is None:
                assert n.host_value is not None, "a node left the device without a host copy"
                assert all(c.value is None for c in n.children.values()), "a device-resident node below an evicted one"
    if swa is None:
        return
    mapped = swa.full_to_swa.cpu()
    values = mapped[mapped != 0]
    assert values.unique().numel() == values.numel(), "an SWA slot is mapped twice"
    assert values.numel() + swa.num_free == swa.num_slots - ps, "an SWA slot leaked"
    assert not mapped[full.free_slots].any(), "a free FULL slot keeps an SWA slot"
    for n in nodes:
        resident = mapped[n.value] != 0
        assert (resident == (not n.tombstone)).all(), "tombstone flag disagrees with the SWA map"
    window = engine.config.model.window
    for r in engine.running:
        read = table.read(r.row, max(0, r.kv_len - window), r.kv_len)
        assert (mapped[read] != 0).all(), "a windowed layer would read a slid-out slot"


@pytest.fixture(name="check_invariants")
def _check_invariants() -> Callable[[Engine], None]:
    return check_invariants


def written_slots(engine: Engine, view: ForwardView) -> torch.Tensor:
    """The FULL slots a forward writes, in token order: mapping(row, prefix + j)."""
    table = engine.req_to_token_pool
    parts = [table.read(r, p, p + e) for r, p, e in zip(view.rows.tolist(), view.prefix_lens.tolist(),
                                                         view.extend_lens.tolist())]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class ShadowCanary(ForwardHooks):
    """Forward hooks that keep a (token, position) record per FULL and SWA slot, stamped after
    each forward, and before each forward check every slot it will read, the view's own
    consistency and the engine invariants. Records are content, so dedup / reuse are fine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.full: dict[int, tuple[int, int]] = {}
        self.swa: dict[int, tuple[int, int]] = {}
        self.views: list[ForwardView] = []
        self.written: list[torch.Tensor] = []  # per forward, the FULL slots it was given to write
        engine.set_forward_hooks(self)

    def _segments(self, view: ForwardView):
        t = 0
        for b, (row, p, e) in enumerate(zip(view.rows.tolist(), view.prefix_lens.tolist(), view.extend_lens.tolist())):
            yield b, row, p, e, slice(t, t + e)
            t += e

    def before_forward(self, view: ForwardView) -> None:
        engine = self.engine
        out = written_slots(engine, view)
        check_invariants(engine, out)
        self.views.append(view)
        self.written.append(out)
        table = engine.req_to_token_pool
        tokens = view.token_table.cpu()
        free = set(engine.pools.full.free_slots.tolist())
        assert out.unique().numel() == out.numel() and not free & set(out.tolist()) and 0 not in out.tolist()
        assert not set(out.tolist()) & set(engine.cache_walk().slots.tolist()), "writing a cached slot"
        rows = {r.row: r for r in engine.running}
        window = engine.config.model.window
        mapped = engine.pools.swa.full_to_swa.cpu() if engine.pools.swa is not None else None
        for b, row, p, e, seg in self._segments(view):
            req = rows[row]
            assert req.kv_len == p
            assert view.positions[seg].tolist() == list(range(p, p + e))
            assert view.input_ids[seg].tolist() == req.token_ids[p:p + e]
            assert tokens[row, :p + e].tolist() == req.token_ids[:p + e] and (tokens[row, p + e:] == -1).all()
            prefix = table.read(row, 0, p).tolist()
            assert not free & set(prefix) and not set(prefix) & set(out.tolist())
            for q, slot in enumerate(prefix):
                assert self.full[slot] == (req.token_ids[q], q), f"row {row} pos {q}: slot {slot} holds {self.full[slot]}"
            if mapped is not None:
                assert (mapped[out[seg]] != 0).all()
                for q in range(max(0, p - window), p):
                    assert self.swa[int(mapped[prefix[q]])] == (req.token_ids[q], q)

    def after_forward(self, view: ForwardView) -> None:
        k0 = self.engine.pools.full.k_layers[0].cpu()
        mapped = self.engine.pools.swa.full_to_swa.cpu() if self.engine.pools.swa is not None else None
        for slot, token, pos in zip(written_slots(self.engine, view).tolist(), view.input_ids.tolist(),
                                    view.positions.tolist()):
            assert k0[slot].abs().sum() > 0, "forward did not write its slot"
            self.full[slot] = (token, pos)
            if mapped is not None:
                self.swa[int(mapped[slot])] = (token, pos)


@pytest.fixture(name="shadow_canary")
def _shadow_canary() -> type[ShadowCanary]:
    return ShadowCanary


@pytest.fixture(name="random_prompts")
def _random_prompts() -> Callable[..., list[list[int]]]:
    return random_prompts
