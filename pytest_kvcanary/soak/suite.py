"""The stock workload soak, for any engine by name, with no test code of the user's:

    pytest --kv-canary --kv-canary-engine=NAME --pyargs pytest_kvcanary.soak.suite

One soak per attention kind the engine has, and one over its prefill/decode pair where it has one
(the others skip, naming the engine). `--kv-canary-soak-rounds` sets the rounds of each, and
`--kv-canary-soak-replay` runs the workload a failure printed instead. On a CPU the canary runs the
kernels' torch references, which compute bit-identical records (Triton's interpreter would take
hours over a soak's forwards).
"""

from __future__ import annotations

from typing import Mapping

import pytest

from pytest_kvcanary.canary.seam import capabilities_of, optional
from pytest_kvcanary.handles.protocol import ArgumentError
from pytest_kvcanary.settings import run_settings


@pytest.fixture(autouse=True)
def _kernels_for_the_device(request: pytest.FixtureRequest, kv_device: str) -> None:
    if kv_device == "cpu":
        request.applymarker(pytest.mark.kv_canary(kernels="torch"))


def _soak(handle: object, config: pytest.Config) -> None:
    __tracebackhide__ = True
    settings = run_settings(config)
    try:
        result = handle.run_workload(rounds=settings.soak_rounds, replay=settings.soak_replay)
    except ArgumentError as e:  # a replay this engine cannot run (its shape was checked at start-up)
        raise pytest.fail.Exception(f"--kv-canary-soak-replay: {e}", pytrace=False) from None
    if not result.trustworthy:  # each untrustworthy round has a failure with its replay
        replay = result.failures[0].replay
        raise AssertionError(f"{result.failure_message()}\nto rerun the smallest failing workload, add "
                             f"--kv-canary-soak-replay='{replay}' to the replay command below")


def _counts(handle: object) -> Mapping[str, int]:
    """The liveness counts of the engine that prefills (`liveness`, optional: {} without it); a pair
    across processes counts its own (both engines and the transfers)."""
    counts = getattr(handle, "liveness", None)
    return counts() if counts is not None else optional(handle.sides[0].engine, "liveness")()


def _reused_a_prefix(handle: object, before: Mapping[str, int]) -> None:
    """The liveness gate of an engine with a prefix cache that counts its hits: the soak's
    workloads must have reused a cached prefix (on the side that prefills) since `before`."""
    __tracebackhide__ = True
    after = _counts(handle)
    # a pair across processes (no sides here) is the reference engine's, which has a prefix cache
    cached = not hasattr(handle, "sides") or capabilities_of(handle.sides[0].engine).prefix_cache
    if cached and after.get("prefix hits") == before.get("prefix hits", 0):
        counts = ", ".join(f"{name} {n - before.get(name, 0)}" for name, n in sorted(after.items()))
        raise AssertionError(f"the soak reused no cached prefix ({counts}): its workloads never hit this engine's "
                             "prefix cache, so they proved nothing about it")


def _restored_a_checkpoint(handle: object) -> None:
    """The liveness gate of a hybrid model's soak: its workloads must have restored a checkpoint
    (on the side that prefills)."""
    __tracebackhide__ = True
    if hasattr(handle, "sides") and handle.sides[0].runtime.readout().state_restores() == 0:  # across processes: none
        raise AssertionError("the soak restored no recurrent-state checkpoint: its workloads never reused a cached "
                             "prefix of this hybrid engine, so they proved nothing about its checkpoints")


@pytest.mark.kv_attention("mha", "swa", "mla", "hybrid")
def test_workload_soak(kv_engine: object, pytestconfig: pytest.Config) -> None:
    before = _counts(kv_engine)
    _soak(kv_engine, pytestconfig)
    _restored_a_checkpoint(kv_engine)  # a hybrid model's, the more telling
    _reused_a_prefix(kv_engine, before)


@pytest.mark.kv_attention("mha", "swa", "hybrid")
def test_workload_soak_prefill_decode(kv_pd: object, pytestconfig: pytest.Config) -> None:
    before = _counts(kv_pd)
    _soak(kv_pd, pytestconfig)
    _restored_a_checkpoint(kv_pd)  # a hybrid model's, the more telling
    _reused_a_prefix(kv_pd, before)
