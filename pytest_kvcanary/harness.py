"""Engine handles the kv fixtures drive: start an engine with the canary on, send work, read results.

A handle owns one engine (EngineHandle) or a prefill/decode pair (PDHandle), each side with its
CanaryRuntime and FaultInjector, and one fault ledger.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any, Sequence

from .adapters.protocol import EngineUnderTest
from .canary.runtime import CanaryRuntime
from .canary.violation import Violation
from .config import CanaryConfig, PerturbSpec
from .perturb.injector import FaultInjector
from .perturb.ledger import Injection, Ledger

BASE_PROMPT = "Once upon a time, in a cache far away, "


def make_engine(name: str, attention: str, device: str, seed: int, pluginmanager: Any | None) -> EngineUnderTest:
    """The engine a conftest's pytest_kvcanary_make_engine returns, else the reference engine."""
    engine = None
    if pluginmanager is not None:
        engine = pluginmanager.hook.pytest_kvcanary_make_engine(name=name, attention=attention, device=device,
                                                                seed=seed)
    if engine is None and name == "reference":
        from .adapters.reference import make_reference_engine

        engine = make_reference_engine(attention, device, seed)
    if engine is None:
        raise ValueError(f"no engine named {name!r}: --kv-canary-engine names 'reference' or an engine a "
                         "pytest_kvcanary_make_engine hook implementation returns")
    if not isinstance(engine, EngineUnderTest):
        raise TypeError(f"engine {name!r} ({type(engine).__name__}) does not implement EngineUnderTest "
                        "(canary_groups, req_to_token, radix_walk, set_forward_hooks, generate, reset)")
    return engine


class Side:
    """One engine with the canary attached and the fault injector observing it."""

    def __init__(self, name: str, engine: EngineUnderTest, canary: CanaryConfig, ledger: Ledger,
                 kernels: str = "triton") -> None:
        self.name = name
        self.engine = engine
        self.runtime = CanaryRuntime(canary, engine, side=name, kernels=kernels)
        self.injector = FaultInjector(engine, self.runtime, name, ledger)
        self.runtime.observers.append(self.injector)
        engine.set_forward_hooks(self.runtime)

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        self.engine.reset()
        self.runtime.reset()
        self.injector.arm(perturbs, seed)

    def close(self) -> None:
        self.engine.set_forward_hooks(None)


class _Handle:
    """What single and PD handles share: the workload record, the ledger, results."""

    sides: list[Side]

    def __init__(self) -> None:
        self.ledger = Ledger()
        self._prompts: list[str] = []
        self._rng = random.Random(0)

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        """Flush caches, clear log and ledger, restart step numbering, arm this test's faults."""
        self.ledger.clear()
        self._prompts.clear()
        self._rng = random.Random(seed)
        for side in self.sides:
            side.reset(seed, perturbs)

    def send_parallel_requests(self, n: int, *, distinct_prompts: bool = False, max_new_tokens: int = 8
                               ) -> list[list[int]]:
        """n requests submitted together (one batch). distinct_prompts: each begins "{i} {nonce} "
        so the radix cache cannot dedup them; otherwise all n are the same prompt."""
        if n < 1:
            raise ValueError(f"n must be >= 1; got {n}")
        nonce = self._rng.randrange(1 << 30)
        prompts = [f"{i} {nonce} {BASE_PROMPT}" if distinct_prompts else BASE_PROMPT for i in range(n)]
        return self.generate(prompts, max_new_tokens)

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 8) -> list[list[int]]:
        self._prompts.extend(p if isinstance(p, str) else repr(list(p)) for p in prompts)
        return self._generate(prompts, max_new_tokens)

    def _generate(self, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
        raise NotImplementedError

    def prompts_since_reset(self) -> list[str]:
        return list(self._prompts)

    def violations(self) -> list[Violation]:
        return [v for side in self.sides for v in side.runtime.log.violations]

    def injections(self) -> list[Injection]:
        self.ledger.match(self.violations())
        return list(self.ledger.injections)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {side.name: {**asdict(side.runtime.stats()), "device": str(side.runtime.device)}
                for side in self.sides}

    def healthy(self) -> bool:
        return all(not side.runtime.health_problems() for side in self.sides)

    def close(self) -> None:
        for side in self.sides:
            side.close()


class EngineHandle(_Handle):
    """kernels: "triton" or "torch" (the reference implementations; see CanaryRuntime)."""

    def __init__(self, engine: EngineUnderTest, canary: CanaryConfig, kernels: str = "triton") -> None:
        super().__init__()
        self.side = Side("single", engine, canary, self.ledger, kernels)
        self.sides = [self.side]

    @property
    def engine(self) -> EngineUnderTest:
        return self.side.engine

    def _generate(self, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens)


def start_engine(kind: str, *, canary: CanaryConfig, attention: str, device: str, seed: int,
                 engine_name: str = "reference", pluginmanager: Any | None = None) -> _Handle:
    """A handle of this kind ("single" or "pd"). For pd, device may name two devices
    ("cuda:0,cuda:1"): prefill on the first, decode on the second."""
    if kind == "single":
        return EngineHandle(make_engine(engine_name, attention, device, seed, pluginmanager), canary)
    if kind == "pd":
        from .pd_handle import PDHandle

        devices = device.split(",")
        prefill_device, decode_device = devices[0], devices[-1]
        return PDHandle(make_engine(engine_name, attention, prefill_device, seed, pluginmanager),
                        make_engine(engine_name, attention, decode_device, seed, pluginmanager), canary)
    raise ValueError(f"kind must be one of single, pd; got {kind!r}")
