"""A scripted stand-in for `pytest_kvcanary.handles.start`, to test the plugin's own logic fast.

`FakeHarness.start_engine` has the harness's signature (one EngineKey) and returns `FakeHandle`s, which satisfy
the `Handle` protocol. A handle turns each kv_perturb spec into one injection per generate() call:
detected (with a violation) when the batch's prompts are distinct, escaped (freed by dedup) when
a prompt repeats. In raise mode a violation makes generate() raise. `stray()` logs a violation no
fault caused. Nothing is module-global: every run builds its own harness.

What the real engine and harness print (tables, request labels, counters) is tested against them
in test_real_engine.py, not here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pytest_kvcanary.adapters import EngineSpec
from pytest_kvcanary.canary.violation import Violation
from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.handles.pool import EngineKey

REASON = {
    "req_to_token": "verify_chain_hash",
    "real_kv_used": "verify_real_kv_hash",
    "real_kv_unused_cache": "verify_real_kv_hash",
    "real_kv_post_forward": "verify_real_kv_hash",
    "next_token_swap": "write_token",
    "real_kv_host": "verify_real_kv_hash",
}
DEDUP_CAUSE = "slot freed by radix dedup before any read"


@dataclass
class FakeInjection:
    mode: str
    side: str
    group: str
    slot: int
    position: int
    row: int
    half: str | None
    layer: int
    byte: int
    step: int
    status: str
    cause: str = ""


class FakeHandle:
    def __init__(self, harness: FakeHarness, serial: int, kind: str, canary: CanaryConfig, attention: str,
                 device: str, seed: int, engine_name: str, engine: Any, parallel: tuple[int, int]) -> None:
        self.harness, self.serial, self.kind, self.canary = harness, serial, kind, canary
        self.parallel = parallel
        self.attention, self.device, self.seed, self.engine_name, self.engine = attention, device, seed, engine_name, engine
        self.config_key = (kind, canary, attention, device, engine_name)
        self.side_names = ("single",) if kind == "single" else ("prefill", "decode")
        self.forwards: Counter[str] = Counter()
        self.is_healthy = True
        self.resets: list[tuple[int, tuple[PerturbSpec, ...]]] = []
        self.perturbs: tuple[PerturbSpec, ...] = ()
        self._violations: list[Violation] = []
        self._injections: list[FakeInjection] = []
        self._prompts: list[str] = []

    def pool_groups(self) -> tuple[str, ...]:
        return ("full",) if self.attention == "mha" else ("full", "swa")

    def unsupported(self, perturbs: tuple[PerturbSpec, ...]) -> str | None:
        return None

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        self.resets.append((seed, perturbs))
        self.perturbs = perturbs
        self._violations, self._injections, self._prompts = [], [], []
        self.forwards.clear()

    def send_parallel_requests(self, n: int, *, distinct_prompts: bool = False, max_new_tokens: int = 8) -> list[str]:
        prompts = [f"{i} nonce the prompt" for i in range(n)] if distinct_prompts else ["the prompt"] * n
        return self.generate(prompts, max_new_tokens)

    def generate(self, prompts: list[str], max_new_tokens: int = 8, *, context_keys: Any = None) -> list[str]:
        self._prompts += prompts
        dedup = len(set(prompts)) < len(prompts)
        for spec in self.perturbs:
            side = spec.side or self.side_names[0]
            group = spec.target_group or "full"
            self._injections.append(FakeInjection(spec.mode, side, group, 5, 1, 0, "K", 0, 0, spec.warmup_steps,
                                                  "escaped" if dedup else "detected", DEDUP_CAUSE if dedup else ""))
            if not dedup:
                seen_on = "decode" if side == "prefill" else side
                self._violations.append(Violation(seen_on, spec.warmup_steps + 1, "HEAD", "K", group.upper(),
                                                  (REASON[spec.mode],), 5, 1, 0, 0xDEAD, 0xBEEF))
        for side in self.side_names:
            self.forwards[side] += 1 + max_new_tokens
        if self.canary.mode == "raise" and self._violations:
            raise RuntimeError(f"kv-canary violation: {self._violations[0].describe()}")
        return [p + " ..." for p in prompts]

    def stray(self) -> None:
        """A violation nothing in the test caused (as a bug in the engine would log)."""
        side = self.side_names[-1]
        self._violations.append(Violation(side, 2, "HEAD", "V", "FULL", ("verify_chain_hash",), 9, 4, 1, 0x1, 0x2))

    def violations(self) -> list[Violation]:
        return list(self._violations)

    def request_label(self, violation: Violation) -> str | None:
        return None

    def injections(self) -> list[FakeInjection]:
        return list(self._injections)

    def prompts_since_reset(self) -> list[str]:
        return list(self._prompts)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {
            side: {"forwards": self.forwards[side], "protected_tokens": 4 * self.forwards[side], "sweeps": 0,
                   "violations": sum(v.side == side for v in self._violations), "rows": 0, "dropped": 0,
                   "health": "ok" if self.is_healthy else "crashed"}
            for side in self.side_names
        }

    def healthy(self) -> bool:
        return self.is_healthy

    def fail(self) -> None:
        raise RuntimeError("engine worker died")

    def crash(self) -> None:
        self.is_healthy = False

    def close(self) -> None:
        self.harness.closed.append(self.serial)


class FakeHarness:
    """config: the run's pytest config, whose pytest_kvcanary_make_engine hooks build each engine."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.started: list[FakeHandle] = []
        self.closed: list[int] = []

    def start_engine(self, key: EngineKey) -> FakeHandle:
        spec = EngineSpec(key.engine, key.attention, key.device, key.seed, key.model, config=self.config)
        engine = self.config.pluginmanager.hook.pytest_kvcanary_make_engine(
            spec=spec, name=spec.name, attention=spec.attention, device=spec.device, seed=spec.seed, model=spec.model)
        handle = FakeHandle(self, len(self.started), key.kind, key.canary, key.attention, key.device, key.seed,
                            key.engine, engine, (key.tp, key.pp))
        self.started.append(handle)
        return handle
