"""The ForwardView the engine hands the canary is the tensors its forward consumes: the target
model's input ids and positions (eager, padded and speculative forwards), the draft model's
positions in a speculative decode (the DRAFT group's inputs), so the write-input checks compare
what a forward used with the engine's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.seam import ForwardView
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine
from pytest_kvcanary.reference_engine.model import CausalLM
from pytest_kvcanary.reference_engine.scheduler import Scheduler

KERNELS = "triton" if torch.cuda.is_available() else "torch"


class Consumed:
    """Forward hooks that keep each forward's view, and a CausalLM.forward wrapper that keeps what
    each model call consumed: (model, forward index, input ids, positions, the positions' values
    then; a padded step's view is refilled in place by later steps)."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.views: list[ForwardView] = []
        self.calls: list[tuple[CausalLM, int, torch.Tensor, torch.Tensor, list[int]]] = []
        forward = CausalLM.forward

        def recording(model, input_ids, positions, kv, context_keys=None, states=None):
            self.calls.append((model, len(self.views) - 1, input_ids, positions, positions.tolist()))
            return forward(model, input_ids, positions, kv, context_keys, states)

        monkeypatch.setattr(CausalLM, "forward", recording)
        engine.set_forward_hooks(self)

    def before_forward(self, view: ForwardView) -> None:
        self.views.append(view)

    def kv_stored(self, kind, layer, k, v) -> None:
        pass

    def after_forward(self, view: ForwardView) -> None:
        assert view is self.views[-1]

    def end_forward(self) -> None:
        pass


@pytest.mark.parametrize("decode_mode", ["eager", "padded"])
def test_the_target_model_consumes_the_views_own_tensors(decode_mode, make_engine, monkeypatch):
    engine = make_engine("mha", decode_mode=decode_mode)
    consumed = Consumed(engine, monkeypatch)
    engine.generate([list(b"a view is what the forward used"), list(b"two")], 4)
    assert len(consumed.calls) == len(consumed.views) == engine.forward_count == 4
    for model, forward, input_ids, positions, _ in consumed.calls:
        view = consumed.views[forward]
        assert model is engine.model and input_ids is view.input_ids and positions is view.positions
    # Each decode ran at its requests' next positions: 31 and 3 first, then one further each step.
    assert [c[4][:2] for c in consumed.calls[1:]] == [[31, 3], [32, 4], [33, 5]]


def test_the_draft_model_consumes_the_draft_groups_positions(make_engine, monkeypatch):
    engine = make_engine("mha", speculative_k=3)
    consumed = Consumed(engine, monkeypatch)
    engine.generate([list(b"drafted"), list(b"drafted ahead, then verified")], 9)
    assert engine.drafter.proposed > 0
    for forward, view in enumerate(consumed.views):
        calls = [(m, ids, pos) for m, f, ids, pos, _ in consumed.calls if f == forward]
        drafts, target = calls[:-1], calls[-1]
        assert target[0] is engine.model and target[1] is view.input_ids and torch.equal(target[2], view.positions)
        assert drafts and all(m is engine.drafter.model for m, _, _ in drafts)
        if view.group_inputs is None:  # a prefill: the draft reads the view's own tensors
            ((_, ids, pos),) = drafts
            assert ids is view.input_ids and torch.equal(pos, view.positions)
            continue
        draft = view.group_inputs[GroupKind.DRAFT]
        assert draft.input_ids is view.input_ids
        # One draft forward per position: each ran at the entries it filled in the DRAFT group's
        # positions, which equal the target's in a correct engine.
        ran = torch.cat([pos for _, _, pos in drafts])
        assert sorted(ran.tolist()) == sorted(draft.positions.tolist())
        assert torch.equal(draft.positions, view.positions)


def decode_positions_one_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler computes a decode's positions one past the position whose slot it maps."""
    make_batch = Scheduler._batch

    def batch(self, reqs, locs, is_prefill):
        made = make_batch(self, reqs, locs, is_prefill)
        return made if is_prefill else made._replace(positions=made.positions + 1)

    monkeypatch.setattr(Scheduler, "_batch", batch)


@pytest.mark.parametrize("decode_mode", ["eager", "padded"])
def test_positions_the_forward_used_against_its_mapping_are_a_write_position(decode_mode, make_engine,
                                                                             monkeypatch):
    """The padded step (what a CUDA graph replays) is fed the scheduler's positions like an eager
    forward, not positions rebuilt from the prefix lengths, so the canary sees the ones it used."""
    decode_positions_one_ahead(monkeypatch)
    engine = make_engine("mha", decode_mode=decode_mode)
    runtime = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=0, kernels=KERNELS), engine)
    engine.set_forward_hooks(runtime)
    req = engine.submit(list(b"eight to"), 3)
    engine.step()
    runtime.drain()
    assert runtime.log.violations == []
    engine.step()
    slot = int(engine.req_to_token_pool.table[req.row, 8])
    assert {(v.phase, v.group, v.reasons, v.slot, v.position, v.stored, v.expected) for v in runtime.drain()} == {
        ("TAIL", "FULL", ("write_position",), slot, 8, 9, 8)}
