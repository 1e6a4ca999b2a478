"""What every engine handle is built from: sides (one engine each, its canary and fault injector)
and the state a handle keeps across them (the fault ledger, the prompts sent, results).

single.EngineHandle has one side, pd.PDHandle two; both derive from SidedHandle, so neither
module imports the other.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any, Callable, Sequence

from ..canary.runtime import CanaryRuntime
from ..canary.seam import EngineUnderTest, optional
from ..canary.violation import Violation
from ..config import CanaryConfig, PerturbSpec
from ..perturb.fit import lacking
from ..perturb.injector import FaultInjector
from ..perturb.ledger import Injection, Ledger
from .protocol import check_context_keys, check_prompts, check_request_count

BASE_PROMPT = "Once upon a time, in a cache far away, "
PROMPT_SHOWN = 30  # characters of a prompt a failure report shows beside its request id


class Side:
    """One engine with the canary attached and the fault injector observing it."""

    def __init__(self, name: str, engine: EngineUnderTest, canary: CanaryConfig, ledger: Ledger) -> None:
        self.name = name
        self.engine = engine
        self.runtime = CanaryRuntime(canary, engine, side=name)
        self.injector = FaultInjector(engine, self.runtime, name, ledger)
        self.runtime.observers.append(self.injector)
        engine.set_forward_hooks(self.runtime)

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        self.engine.reset()
        self.runtime.reset()
        self.injector.arm(perturbs, seed)

    def request_label(self, row: int, step: int) -> str | None:
        """The label "req <id> '<prompt start>'" of the request that held `row` at forward `step`,
        when the engine knows it (EngineUnderTest.request_at)."""
        found = optional(self.engine, "request_at")(row, step) if row >= 0 else None
        if found is None:
            return None
        rid, prompt = found
        return f"req {rid} '{repr(prompt[:PROMPT_SHOWN])[1:-1]}'"

    def close(self) -> None:
        self.engine.set_forward_hooks(None)


class SidedHandle:
    """What single and PD handles share (see protocol.Handle for the contract): the workload record,
    the ledger, results read from the sides."""

    sides: list[Side]

    def __init__(self) -> None:
        self.ledger = Ledger()
        self._prompts: list[str] = []
        self._rng = random.Random(0)

    @property
    def side_names(self) -> tuple[str, ...]:
        return tuple(side.name for side in self.sides)

    def pool_groups(self) -> tuple[str, ...]:
        return tuple(group.pool.kind.label for group in self.sides[0].runtime.groups)

    def unsupported(self, perturbs: tuple[PerturbSpec, ...]) -> str | None:
        """Why a side's engine cannot run one of these faults at all (perturb.fit.lacking), or None."""
        for spec in perturbs:
            for side in self.sides:
                why = lacking(spec, side.engine, f"the {side.name} engine") if spec.side in (None, side.name) else None
                if why:
                    return why
        return None

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        """Flush caches, clear log, ledger and counters, restart step numbering, arm this test's faults."""
        self.ledger.clear()
        self._prompts.clear()
        self._rng = random.Random(seed)
        for side in self.sides:
            side.reset(seed, perturbs)

    def send_parallel_requests(self, n: int, *, distinct_prompts: bool = False, max_new_tokens: int = 8
                               ) -> list[list[int]]:
        """n requests submitted together (one batch). distinct_prompts: each begins "{i} {nonce} "
        so the radix cache cannot dedup them; otherwise all n are the same prompt."""
        check_request_count(n)
        nonce = self._rng.randrange(1 << 30)
        prompts = [f"{i} {nonce} {BASE_PROMPT}" if distinct_prompts else BASE_PROMPT for i in range(n)]
        return self.generate(prompts, max_new_tokens)

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 8, *,
                 context_keys: Sequence[int] | None = None) -> list[list[int]]:
        """Greedy output ids per prompt (a list of prompts: text or token ids). context_keys: one
        per prompt (a cache salt or adapter id, 0 = none), for engines that take them."""
        check_prompts(prompts)
        self._prompts.extend(p if isinstance(p, str) else repr(list(p)) for p in prompts)
        generate = self._engine_generate()
        contexts = {}
        if context_keys is not None:
            check_context_keys(context_keys, prompts, generate, type(getattr(generate, "__self__", generate)).__name__)
            contexts = {"context_keys": list(context_keys)}
        outputs = generate(prompts, max_new_tokens, **contexts)
        self.drain()  # raise mode: a violation of the last forwards raises here, in the test's call
        return outputs

    def _engine_generate(self) -> Callable[..., list[list[int]]]:
        """The engine's (or pair's) generate(prompts, max_new_tokens[, context_keys=])."""
        raise NotImplementedError

    def prompts_since_reset(self) -> list[str]:
        return list(self._prompts)

    def drain(self) -> None:
        """Move every violation the devices logged into the sides' logs (raise mode raises)."""
        for side in self.sides:
            side.runtime.drain()

    def violations(self) -> list[Violation]:
        self.drain()
        return [v for side in self.sides for v in side.runtime.log.violations]

    def injections(self) -> list[Injection]:
        self.ledger.match(self.violations())
        return list(self.ledger.injections)

    def request_label(self, violation: Violation) -> str | None:
        side = next((s for s in self.sides if s.name == violation.side), None)
        return None if side is None else side.request_label(violation.row, violation.step)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {side.name: {**asdict(side.runtime.stats()), "device": str(side.runtime.device)}
                for side in self.sides}

    def healthy(self) -> bool:
        return all(not side.runtime.health_problems() for side in self.sides)

    def close(self) -> None:
        for side in self.sides:
            side.close()
