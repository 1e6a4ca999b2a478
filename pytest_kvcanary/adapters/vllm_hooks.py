"""vLLM as a pytest plugin: `--kv-canary-engine vllm`, and the option it registers for itself,
--kv-canary-vllm-attention-isa (ini key kv_canary_vllm_attention_isa), resolved and checked here
at start-up and handed to `VllmSettings` when an engine is built. The adapter (with torch and
vLLM) loads only when a test asks for an engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .spec import EngineSpec
from .vllm import isa

if TYPE_CHECKING:
    from .vllm.engine import VllmEngine

NAME = "vllm"
PACKAGE = "vllm"  # the optional package it drives, installed with the extra of that name
SPLITS: tuple[str, ...] = ()  # it runs in one process only

ATTENTION_ISA = "kv_canary_vllm_attention_isa"  # the ini key, and the dest of the flag
ATTENTION_ISA_FLAG = "--kv-canary-vllm-attention-isa"
ATTENTION_ISA_HELP = (
    "vllm engine: the instruction-set path of vLLM's CPU attention, which decides its KV layout: readable "
    f"(vLLM's choice, amx run as vec), vllm, amx, vec, vec16 (default: the environment variable {isa.ENV}, else "
    "readable)")
# The options this plugin registers, by ini key: what the run's header, replay command and report show.
OPTIONS = {ATTENTION_ISA: ATTENTION_ISA_FLAG}

_SETTINGS = pytest.StashKey[dict[str, Any]]()  # the VllmSettings fields the run's options set


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-canary", "KV-cache canary (pytest-kvcanary)")
    group.addoption(ATTENTION_ISA_FLAG, dest=ATTENTION_ISA, default=None, metavar="ISA", help=ATTENTION_ISA_HELP)
    parser.addini(ATTENTION_ISA, f"{ATTENTION_ISA_HELP} (the {ATTENTION_ISA_FLAG} option wins)", default="")


def _attention_isa(config: pytest.Config) -> str:
    """The attention path the run asks for: the command line, else the ini file, else the
    environment variable, else readable. Raises pytest.UsageError naming the source of a bad
    value, the value and the allowed ones."""
    allowed = ", ".join(isa.CHOICES)
    given = config.getoption(ATTENTION_ISA)
    if given is not None:
        if not given.strip():
            raise pytest.UsageError(f"{ATTENTION_ISA_FLAG} must not be empty (leave the option out to keep its "
                                    f"default); got {given!r}")
        source = ATTENTION_ISA_FLAG
    elif given := config.getini(ATTENTION_ISA):
        source = f"ini option {ATTENTION_ISA}"
    elif (given := isa.environment_attention_isa()) is not None:
        source = f"the environment variable {isa.ENV} (the default of {ATTENTION_ISA_FLAG})"
    else:
        return isa.DEFAULT
    if given not in isa.CHOICES:
        raise pytest.UsageError(f"{source} must be one of {allowed}; got {given!r}")
    return given


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Resolve and check the option (before the kv-canary plugin resolves its settings, so a bad
    value is the run's first error)."""
    config.stash[_SETTINGS] = {"attention_isa": _attention_isa(config)}


def vllm_settings(config: pytest.Config | None) -> dict[str, Any]:
    """The `VllmSettings` fields the run's options set ({} outside a pytest run: the defaults)."""
    return dict(config.stash.get(_SETTINGS, {})) if config is not None else {}


@pytest.hookimpl
def pytest_kvcanary_make_engine(spec: EngineSpec) -> VllmEngine | None:
    if spec.name != NAME:
        return None
    from .vllm import make_vllm_engine

    return make_vllm_engine(spec.attention, spec.device, spec.seed, spec.model, **vllm_settings(spec.config))
