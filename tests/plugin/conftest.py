from __future__ import annotations

from pathlib import Path

import pytest


# The conftest of every pytester run: the fake harness drives the kv fixtures, and a hook
# implementation names the engine it was asked for.
_RUN_CONFTEST = '''
import pytest
from fake_harness import FakeHarness

@pytest.fixture(scope="session")
def fake_harness(pytestconfig):
    return FakeHarness(pytestconfig)

@pytest.fixture(scope="session")
def kv_start_engine(fake_harness):
    return fake_harness.start_engine

def pytest_kvcanary_make_engine(spec):
    return f"{spec.name}:{spec.attention}:{spec.device}:{spec.seed}:{spec.model}"

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # The fake harness stands in for GPUs (CUDA_VISIBLE_DEVICES) and never touches one: the
    # start-up check that torch can drive them does not apply.
    from pytest_kvcanary import gpu
    original = gpu.cuda_build_problem
    gpu.cuda_build_problem = lambda: None
    config.add_cleanup(lambda: setattr(gpu, "cuda_build_problem", original))
'''


@pytest.fixture
def kvtester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose runs use the fake harness, with no GPU visible. TRITON_INTERPRET, which
    such a run sets, is restored afterwards."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.makepyfile(fake_harness=(Path(__file__).parent / "fake_harness.py").read_text())
    pytester.makeconftest(_RUN_CONFTEST)
    return pytester


_TORCH_KERNELS = """
import dataclasses

import pytest

@pytest.fixture(scope="session")
def kv_start_engine(kv_start_engine):
    def start_with_torch_kernels(key):
        return kv_start_engine(dataclasses.replace(key, canary=dataclasses.replace(key.canary, kernels="torch")))
    return start_with_torch_kernels
"""


@pytest.fixture
def realtester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose runs drive the real harness on the CPU with the torch kernels (bit-identical
    to the Triton ones, which the kernel tests check)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.makeconftest(_TORCH_KERNELS)
    return pytester
