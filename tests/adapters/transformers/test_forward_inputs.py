"""The canary's view of a transformers forward is what that forward consumed: its lengths come from
the cumulative sequence lengths, its positions and input ids from the very buffers the model read.
A forward fed a wrong position for one decode token (its rotary embedding at p + 1 while its KV is
stored in p's slot, the SGLang #25015 class) is reported by TAIL's write_position in that forward
at that slot; one fed a wrong token (the input id of one decode row raised by one, as a host
hand-over gone wrong would) is reported by TAIL's write_token in that forward at that slot, against
the token the forward before sampled for it; nothing is reported without the fault."""

from __future__ import annotations

import pytest
import torch

from .support import GRAPH_MODES, INSTALL, make_handle, reference_kv

pytest.importorskip("transformers", reason=INSTALL)

PROMPT = [30 + i for i in range(21)]
FAULTY_STEP = 3  # forward 0 is the prefill; 1, 2, 3, ... decode one token each
# (use_cuda_graph, canary_graphs): eager; the canary inside transformers' graphs; around them.
PLACEMENTS = {name: modes for name, modes in (("eager", (False, False)), ("graphs", (True, True)),
                                              ("around-graphs", (True, False))) if modes[0] in GRAPH_MODES}
# (placement, the input raised by one, the reason TAIL reports).
WRONG_INPUTS = [(placement, wrong, reason) for placement in PLACEMENTS
                for wrong, reason in (("position_ids", "write_position"), ("input_ids", "write_token"))]


def stored_k(engine, request_id: str, position: int) -> tuple[int, torch.Tensor]:
    """(canary slot, a view of layer 0's K there) of a request's position."""
    full = engine.groups[0]
    block = engine.layout.block_ids(full, request_id)[position // full.page_size]
    offset = position % full.page_size
    return block * full.page_size + offset, full.k_layers[0][block, offset]


def feed_a_wrong_input(engine, name: str) -> list[tuple[int, int, torch.Tensor]]:
    """At forward FAULTY_STEP, raise the batch's first token's `name` ("position_ids" or
    "input_ids") by one in transformers' own input buffer, before the forward reads it. Returns
    where the fault lands: (the position the token really holds, its slot, a view of its K)."""
    faults: list[tuple[int, int, torch.Tensor]] = []
    runner = engine.processor.model_runner
    compute_batch = runner.compute_batch

    def feeding_a_wrong_input(model, batch_data):
        if engine._forward.steps != FAULTY_STEP:
            return compute_batch(model, batch_data)
        position = int(batch_data["position_ids"][0, 0])
        batch_data[name][0, 0] += 1  # a view of the forward's static input buffer
        compute_batch(model, batch_data)
        request_id = engine.processor.inputs_and_outputs.requests_in_batch[0].state.request_id
        faults.append((position, *stored_k(engine, request_id, position)))

    runner.compute_batch = feeding_a_wrong_input
    return faults


# A position raised by one: K computed at another position than the slot's own (write_position).
# A token raised by one: K of another token than the one the forward before sampled (write_token).
@pytest.mark.parametrize("placement, wrong, reason", WRONG_INPUTS)
def test_a_forward_fed_a_wrong_input_is_reported_by_its_tail_at_that_slot(placement, wrong, reason):
    # With graphs, forward FAULTY_STEP replays transformers' graph (and the canary's, view included).
    graphs, inside = PLACEMENTS[placement]
    handle = make_handle("mha", use_cuda_graph=graphs, canary_graphs=inside)
    engine = handle.engine
    faults = feed_a_wrong_input(engine, wrong)
    output = handle.generate([PROMPT], max_new_tokens=6)[0]
    [(position, slot, k)] = faults
    assert position == len(PROMPT) + FAULTY_STEP - 1
    # The damage itself, by recomputation: the slot does not hold the K of the request's own token there.
    reference = reference_kv(engine.model, (PROMPT + output)[:position + 1])[0][0][position]
    assert not torch.allclose(k, reference, atol=1e-3)
    handle.side.runtime.drain()
    violations = handle.violations()
    found = [v for v in violations if v.phase == "TAIL" and reason in v.reasons]
    assert sorted((v.half, v.step, v.slot, v.position) for v in found) == [
        (half, FAULTY_STEP, slot, position) for half in ("K", "V")], violations[:3]
    assert {v.slot for v in violations} == {slot}  # later HEADs see the same slot's record, nothing else


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_without_the_fault_nothing_is_reported(placement):
    graphs, inside = PLACEMENTS[placement]
    handle = make_handle("mha", use_cuda_graph=graphs, canary_graphs=inside)
    handle.generate([PROMPT], max_new_tokens=6)
    handle.side.runtime.drain()
    assert handle.violations() == []


def test_the_canary_is_handed_a_view_spanning_the_forwards_tokens():
    """Each forward's view holds the forward's tokens in the shortest span of 64 * 4^k that fits them
    (capped at max_tokens), the same view for the same span: a decode step's launches span its
    padded tokens, not the input buffers' capacity. A prompt of 100 tokens prefills in one forward.
    Eager: a replayed forward calls no hook (the span is chosen when its graph is captured)."""
    handle = make_handle("mha", max_batch_tokens=512)
    engine, hooks = handle.engine, handle.side.runtime
    spans: list[tuple[int, int]] = []  # per forward: the view's span and the view's id
    consumed: list[int] = []  # per forward: the tokens its model embedded
    before_forward = hooks.before_forward

    def recording(view):
        spans.append((view.input_ids.shape[0], id(view)))
        before_forward(view)

    hooks.before_forward = recording
    counting = engine.model.register_forward_pre_hook(
        lambda _, args, kwargs: consumed.append(kwargs["input_ids"].shape[-1]), with_kwargs=True)
    try:
        handle.generate([[40 + i % 150 for i in range(100)]], max_new_tokens=4)
    finally:
        counting.remove()
    assert [span for span, _ in spans] == [256, 64, 64, 64]
    assert len(consumed) == 4 and consumed[0] >= 100 and all(n <= span for n, (span, _) in zip(consumed, spans))
    assert len({view for span, view in spans if span == 64}) == 1
    handle.side.runtime.drain()
    assert handle.violations() == []
