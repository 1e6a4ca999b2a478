"""The oracle's default near-tie margin: by the KV's dtype, wider for a model that routes tokens to
experts below float32, whose decode can send a token to another expert than its recomputation does
where two tie within rounding. The margins below are the oracle's (vLLM 0.32's prompt
log-probabilities) at the tokens where vLLM's bfloat16 Qwen3-Next decoded the runner-up of such a
tie: each a one-request replay on a reset engine that the soak had called damage missed."""

from __future__ import annotations

import pytest

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.handles.single import EngineHandle
from pytest_kvcanary.soak.runner import ROUTED_TIE_TOLERANCE, TIE_TOLERANCES, Soak, default_tie_tolerance
from pytest_kvcanary.soak.verdicts import scored_damage

# (replay, decoded token, oracle's best, oracle's margin of the best over the decoded token)
ROUTING_FLIPS = [
    ("7006/:4.33+257707.204*88@0", 5, 40, 0.0821),
    ("7007/:3.127+784874.238*91@0", 16, 59, 0.0644),
    ("7007/1:-1.0+225054.204*10@0", 93, 210, 0.0899),
]


@pytest.mark.parametrize("replay, token, best, margin", ROUTING_FLIPS)
def test_a_routing_flip_of_a_bfloat16_mixture_of_experts_is_a_near_tie(replay, token, best, margin):
    routed = default_tie_tolerance("torch.bfloat16", routed_experts=True)
    assert scored_damage([token], [best], [token], [margin], routed) == (None, 1)
    dense = default_tie_tolerance("torch.bfloat16", routed_experts=False)
    assert scored_damage([token], [best], [token], [margin], dense) == (0, 0), "damage without the rule"


def test_the_routed_margin_is_for_dtypes_below_float32_only():
    for dtype in ("torch.float16", "torch.bfloat16", "torch.float8_e4m3fn"):
        assert default_tie_tolerance(dtype, routed_experts=True) == ROUTED_TIE_TOLERANCE
    assert default_tie_tolerance("torch.float32", routed_experts=True) == TIE_TOLERANCES["torch.float32"]
    for dtype, tolerance in TIE_TOLERANCES.items():
        assert default_tie_tolerance(dtype, routed_experts=False) == tolerance


@pytest.mark.parametrize("attention", ["mha", "hybrid"])
def test_a_soak_takes_the_margin_from_the_engine_s_routed_experts(attention):
    """A dense model keeps its KV dtype's margin, recurrent or not; one that declares routed experts
    gets the wider one below float32."""
    engine = make_reference_engine(attention, "cpu", 0, kv_dtype="bfloat16")
    handle = EngineHandle(engine, CanaryConfig(kernels="torch"))
    handle.reset(0, ())
    assert Soak(handle).tie_tolerance == TIE_TOLERANCES["torch.bfloat16"]
    engine.routed_experts = True
    assert Soak(handle).tie_tolerance == ROUTED_TIE_TOLERANCE
