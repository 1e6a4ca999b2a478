"""The reference engine as a pytest plugin: `--kv-canary-engine reference` (the default), its
prefill/decode pair and its tensor/pipeline-parallel shards, and the options it registers for its
timing: --kv-canary-reference-scheduling (ini key kv_canary_reference_scheduling: sync, or async
scheduling) and --kv-canary-reference-jitter-seed (ini key kv_canary_reference_jitter_seed: seeded
timing jitter), checked at start-up. They apply to single engines and pairs (a pair's decode side
schedules asynchronously; its prefill side only prefills), not to parallel shards. The engine loads
(with torch) only when a test asks for one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .spec import EngineSpec

if TYPE_CHECKING:
    from ..reference_engine.engine import Engine
    from ..reference_engine.parallel.shard import ReferenceShards
    from ..reference_engine.pd import PDPair

NAME = "reference"
PACKAGE = None  # the optional package it drives: none, it is the project's own
SPLITS = ("tp", "pp")  # what a parallel engine of it splits over

SCHEDULING = "kv_canary_reference_scheduling"  # the ini key, and the dest of the flag
SCHEDULING_FLAG = "--kv-canary-reference-scheduling"
SCHEDULINGS = ("sync", "async")
SCHEDULING_HELP = ("reference engine: sync (each step processed before the next is scheduled) or async (each step "
                   "scheduled and launched before the one before it is processed) (default: sync)")
JITTER = "kv_canary_reference_jitter_seed"
JITTER_FLAG = "--kv-canary-reference-jitter-seed"
JITTER_HELP = ("reference engine: seeded timing jitter (where each async step runs, late load-back "
               "acknowledgements, transfers held back and reordered), an integer >= 0 (default: none)")
# The options this plugin registers, by ini key: what the run's header, replay command and report show.
OPTIONS = {SCHEDULING: SCHEDULING_FLAG, JITTER: JITTER_FLAG}

_SETTINGS = pytest.StashKey[dict[str, Any]]()  # the reference_config fields the run's options set


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-canary", "KV-cache canary (pytest-kvcanary)")
    for key, flag, metavar, text in ((SCHEDULING, SCHEDULING_FLAG, "MODE", SCHEDULING_HELP),
                                     (JITTER, JITTER_FLAG, "SEED", JITTER_HELP)):
        group.addoption(flag, dest=key, default=None, metavar=metavar, help=text)
        parser.addini(key, f"{text} (the {flag} option wins)", default="")


def _given(config: pytest.Config, key: str, flag: str) -> tuple[str, str] | None:
    """(the value the run gives option `flag`, where it came from): the command line, else the ini
    file; None when neither does."""
    if (value := config.getoption(key)) is not None:
        return value, flag
    if value := config.getini(key):
        return value, f"ini option {key}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Resolve and check the options (before the kv-canary plugin resolves its settings, so a bad
    value is the run's first error); pytest.UsageError names the source, the value and what it
    must be."""
    fields: dict[str, Any] = {}
    if given := _given(config, SCHEDULING, SCHEDULING_FLAG):
        value, source = given
        if value not in SCHEDULINGS:
            raise pytest.UsageError(f"{source} must be one of {', '.join(SCHEDULINGS)}; got {value!r}")
        fields["async_scheduling"] = value == "async"
    if given := _given(config, JITTER, JITTER_FLAG):
        value, source = given
        if not value.isdigit():
            raise pytest.UsageError(f"{source} must be an integer >= 0; got {value!r}")
        fields["jitter_seed"] = int(value)
    config.stash[_SETTINGS] = fields


def reference_options(config: pytest.Config | None, side: str = "single") -> dict[str, Any]:
    """The `reference_config` fields the run's options set for an engine on this side ("single",
    "prefill" or "decode": a pair's prefill side keeps synchronous scheduling); {} outside a pytest
    run."""
    fields = dict(config.stash.get(_SETTINGS, {})) if config is not None else {}
    if side == "prefill":
        fields.pop("async_scheduling", None)
    return fields


@pytest.hookimpl
def pytest_kvcanary_make_engine(spec: EngineSpec) -> Engine | None:
    if spec.name != NAME:
        return None
    from .reference import make_reference_engine

    return make_reference_engine(spec.attention, spec.device, spec.seed, spec.model, **reference_options(spec.config))


@pytest.hookimpl
def pytest_kvcanary_make_pd_pair(spec: EngineSpec) -> PDPair | None:
    if spec.name != NAME:
        return None
    from ..reference_engine.pd import PDPair
    from .reference import make_reference_engine

    devices = {"prefill": spec.device, "decode": spec.decode_device or spec.device}
    return PDPair(*(make_reference_engine(spec.attention, device, spec.seed, spec.model,
                                          **reference_options(spec.config, side)) for side, device in devices.items()))


def make_shards(spec: EngineSpec) -> ReferenceShards:
    """The ShardFactory (handles.rank) of a parallel reference engine (spec.device is unused: each
    rank runs on its own)."""
    from .reference import reference_shards

    return reference_shards(spec.attention, spec.seed, spec.model)
