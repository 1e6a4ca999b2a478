"""Fixtures of the kernel tests: the seeded KV world of ``kv_world``."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kv_world import DEVICE, World, make_world


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def world_factory() -> Callable[..., World]:
    return make_world


@pytest.fixture
def world() -> World:
    return make_world(seed=1234)
