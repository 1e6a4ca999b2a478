"""A KV transfer that reads a page with its heads and tokens transposed (the LMCache #4463 / Dynamo
#14416 class: same shape, so no shape check fails) damages one KV head of every slot of the page:
head 0 of the page's first token stays where it was. With ``real_data="partial"`` sampling every
KV head, the decode side reports every damaged slot at HEAD of its first forward, on both halves.

The damage is measured independently of the canary: each transferred slot's bytes on the decode
side against the prefill slot they came from.
"""

from __future__ import annotations

import pytest
import torch

import pytest_kvcanary.reference_engine.pd as pd
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig, PDPair
from pytest_kvcanary.reference_engine.kv_pool import KVPool
from pytest_kvcanary.handles.pd import PDHandle

from scenario_support import DEVICE, KERNELS, tokens

PAGE = 2  # tokens per page of the transfer; the model has 2 KV heads
PROMPTS = [tokens(1, 9), tokens(2, 12), tokens(3, 7)]


def _transposing_copy(transfers: list[tuple[torch.Tensor, torch.Tensor]]):
    """_copy_kv reading each page of PAGE tokens as [heads, tokens] where it is [tokens, heads]
    (an odd last token is copied whole); records every (src, dst) slot pair."""

    def copy(src: KVPool, dst: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        transfers.append((src_slots.clone(), dst_slots.clone()))
        whole = src_slots.numel() // PAGE * PAGE
        for s, d in zip(src.k_layers + src.v_layers, dst.k_layers + dst.v_layers, strict=True):
            rows = s[src_slots.to(s.device)].to(d.device)  # [T, heads, head_dim]
            assert rows.shape[1] == PAGE, "the scenario's model has as many KV heads as a page has tokens"
            pages = rows[:whole].view(-1, PAGE, PAGE, rows.shape[-1])
            rows[:whole] = pages.transpose(1, 2).reshape(whole, PAGE, rows.shape[-1])
            d[dst_slots.to(d.device)] = rows

    return copy


def _damaged(pair: PDPair, transfers: list[tuple[torch.Tensor, torch.Tensor]]) -> set[tuple[str, int]]:
    """(half, decode slot) whose bytes differ from the prefill slot they were sent from, in any layer."""
    out = set()
    for src_slots, dst_slots in transfers:
        for half, s_layers, d_layers in (("K", pair.prefill.pools.full.k_layers, pair.decode.pools.full.k_layers),
                                         ("V", pair.prefill.pools.full.v_layers, pair.decode.pools.full.v_layers)):
            for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
                if any(not torch.equal(sl[s].cpu(), dl[d].cpu()) for sl, dl in zip(s_layers, d_layers)):
                    out.add((half, d))
    return out


def _run(monkeypatch, real_data: str, transposed: bool) -> tuple[set[tuple[str, int]], list, set, int]:
    model = ModelConfig(attention="mha", num_kv_heads=PAGE, max_context=64, seed=0)
    pair = PDPair(*(Engine(EngineConfig(model=model, device=DEVICE, max_batch_tokens=64)) for _ in range(2)))
    handle = PDHandle(pair, CanaryConfig(real_data=real_data, sweep_interval=0, kernels=KERNELS))
    transfers: list[tuple[torch.Tensor, torch.Tensor]] = []
    if transposed:
        monkeypatch.setattr(pd, "_copy_kv", _transposing_copy(transfers))
    handle.generate(PROMPTS, max_new_tokens=3)
    violations = handle.violations()
    reported = {(v.half, v.slot) for v in violations}
    sent = sum(dst.numel() for _, dst in transfers)
    return _damaged(pair, transfers), violations, reported, sent


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_a_head_token_transposed_page_transfer_is_reported_on_every_damaged_slot(monkeypatch, real_data):
    damaged, violations, reported, sent = _run(monkeypatch, real_data, transposed=True)
    # Every slot of a whole page is damaged (one head of each token), on both halves; an odd last
    # token is copied whole.
    assert len(damaged) == 2 * sum(len(p) // PAGE * PAGE for p in PROMPTS) and sent == sum(map(len, PROMPTS))
    assert reported == damaged
    assert {(v.side, v.step, v.phase, v.reasons) for v in violations} == {
        ("decode", 0, "HEAD", ("verify_real_kv_hash",))}


def test_the_same_transfer_copied_plainly_is_clean(monkeypatch):
    damaged, violations, _, _ = _run(monkeypatch, "partial", transposed=False)
    assert damaged == set() and violations == []
