"""EngineSpec: what every engine is built from, the one argument of the engine-building hooks
(`pytest_kvcanary_make_engine`, `pytest_kvcanary_make_pd_pair`) and of the built-in engines'
shard factories. It imports nothing: the hookspecs name it, the adapters receive it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineSpec:
    """One engine to build (or one prefill/decode pair).

    name: the engine's name, the --kv-canary-engine setting; an implementation returns None for
    a name it does not know.
    attention: the attention kind the test asks for, "mha", "swa", "mla", "hybrid" or "sparse"; an engine
    without it raises `UnsupportedAttention` (the test skips, naming the engine).
    device: a torch device string, "cpu" or "cuda:1"; for a pair, the prefill side's.
    seed: the run's --kv-canary-seed (a default model's random weights come from it).
    model: the checkpoint directory --kv-canary-model names, or None for the engine's default.
    decode_device: for a pair, the decode side's device (the prefill side's when one GPU is
    leased); None for one engine.
    config: the pytest run's configuration, where an engine's plugin reads the options it
    registered (None outside a pytest run: every such option at its default).
    """

    name: str
    attention: str
    device: str
    seed: int
    model: str | None = None
    decode_device: str | None = None
    config: Any = field(default=None, repr=False, compare=False)
