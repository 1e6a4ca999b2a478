"""The soak's oracle on vLLM's hybrid model (a bfloat16 Qwen3-Next, whose MLPs route each token to
2 of 4 experts). Decoding steps the gated delta net token by token; the oracle's prompt
log-probabilities run it chunked. Where two experts' router logits tie within that rounding noise,
decode can route a token to the other one, and its output token then trails the oracle's best by
more than bfloat16's rounding margin. This replay (one request on a reset engine: no prefix reuse,
no restore, no eviction) is such a token, which the soak called damage missed before the routed
experts' near-tie margin (runner.py; the adapter declares `routed_experts`)."""

from __future__ import annotations

import pytest

from .support import INSTALL, make_engine, make_handle

pytest.importorskip("vllm", reason=INSTALL)

from pytest_kvcanary.soak.runner import ROUTED_TIE_TOLERANCE, TIE_TOLERANCES  # noqa: E402
from pytest_kvcanary.soak.verdicts import CLEAN  # noqa: E402
from pytest_kvcanary.soak.workload import Workload  # noqa: E402

REPLAY = "7007/1:-1.0+225054.204*10@0"  # token 9 decoded 93 where the oracle's best is 210


def test_a_token_decode_routed_to_the_other_expert_of_a_tie_is_a_near_tie():
    engine = make_engine("hybrid")
    assert engine.routed_experts
    handle = make_handle(engine, real_data="partial", sweep_interval=4)
    [rnd] = handle.run_workload(replay=REPLAY, shrink_trials=0).rounds
    assert (rnd.verdict, rnd.near_ties) == (CLEAN, 2)  # token 9 and an earlier tie within bfloat16's margin

    workload = Workload.from_text(REPLAY)
    [request] = workload.rounds[0].requests
    prompt = workload.prompt(request)
    engine.reset()
    output = engine.generate([prompt], request.max_new_tokens)[0]
    [scores] = engine.score_uncached([(prompt, output)])
    assert (output[9], scores.best[9], scores.runner_up[9]) == (93, 210, 93)
    assert TIE_TOLERANCES["torch.bfloat16"] < scores.margin[9] <= ROUTED_TIE_TOLERANCE
