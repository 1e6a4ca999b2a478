"""vLLM as a pytest plugin: `--kv-canary-engine vllm`, and the options it registers for itself,
--kv-canary-vllm-attention-isa (ini key kv_canary_vllm_attention_isa) and
--kv-canary-vllm-kv-cache-dtype (ini key kv_canary_vllm_kv_cache_dtype), resolved and checked here
at start-up and handed to `VllmSettings` when an engine is built. The adapter (with torch and
vLLM) loads only when a test asks for an engine."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

from .spec import EngineSpec
from .vllm import fp8, isa

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
KV_CACHE_DTYPE = "kv_canary_vllm_kv_cache_dtype"
KV_CACHE_DTYPE_FLAG = "--kv-canary-vllm-kv-cache-dtype"
KV_CACHE_DTYPE_HELP = (
    "vllm engine: what vLLM's KV cache stores: auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2 (FP8, its scales "
    f"guarded; vLLM's CPU build needs AVX-512 or AMX) (default: the environment variable {fp8.ENV}, else auto)")
# The options this plugin registers, by ini key: what the run's header, replay command and report show.
OPTIONS = {ATTENTION_ISA: ATTENTION_ISA_FLAG, KV_CACHE_DTYPE: KV_CACHE_DTYPE_FLAG}

_SETTINGS = pytest.StashKey[dict[str, Any]]()  # the VllmSettings fields the run's options set


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-canary", "KV-cache canary (pytest-kvcanary)")
    group.addoption(ATTENTION_ISA_FLAG, dest=ATTENTION_ISA, default=None, metavar="ISA", help=ATTENTION_ISA_HELP)
    parser.addini(ATTENTION_ISA, f"{ATTENTION_ISA_HELP} (the {ATTENTION_ISA_FLAG} option wins)", default="")
    group.addoption(KV_CACHE_DTYPE_FLAG, dest=KV_CACHE_DTYPE, default=None, metavar="DTYPE", help=KV_CACHE_DTYPE_HELP)
    parser.addini(KV_CACHE_DTYPE, f"{KV_CACHE_DTYPE_HELP} (the {KV_CACHE_DTYPE_FLAG} option wins)", default="")


def _resolve(config: pytest.Config, key: str, flag: str, env: str, choices: tuple[str, ...], default: str) -> str:
    """What the run asks for under option `flag` (ini key `key`): the command line, else the ini
    file, else the environment variable `env`, else `default`. Raises pytest.UsageError naming the
    source of a bad value, the value and the allowed ones."""
    given = config.getoption(key)
    if given is not None:
        if not given.strip():
            raise pytest.UsageError(f"{flag} must not be empty (leave the option out to keep its default); "
                                    f"got {given!r}")
        source = flag
    elif given := config.getini(key):
        source = f"ini option {key}"
    elif (given := os.environ.get(env)) is not None:
        source = f"the environment variable {env} (the default of {flag})"
    else:
        return default
    if given not in choices:
        raise pytest.UsageError(f"{source} must be one of {', '.join(choices)}; got {given!r}")
    return given


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Resolve and check the option (before the kv-canary plugin resolves its settings, so a bad
    value is the run's first error)."""
    config.stash[_SETTINGS] = {
        "attention_isa": _resolve(config, ATTENTION_ISA, ATTENTION_ISA_FLAG, isa.ENV, isa.CHOICES, isa.DEFAULT),
        "kv_cache_dtype": _resolve(config, KV_CACHE_DTYPE, KV_CACHE_DTYPE_FLAG, fp8.ENV, fp8.CHOICES, fp8.DEFAULT)}


def vllm_settings(config: pytest.Config | None) -> dict[str, Any]:
    """The `VllmSettings` fields the run's options set ({} outside a pytest run: the defaults)."""
    return dict(config.stash.get(_SETTINGS, {})) if config is not None else {}


@pytest.hookimpl
def pytest_kvcanary_make_engine(spec: EngineSpec) -> VllmEngine | None:
    if spec.name != NAME:
        return None
    from .vllm import make_vllm_engine

    return make_vllm_engine(spec.attention, spec.device, spec.seed, spec.model, **vllm_settings(spec.config))
