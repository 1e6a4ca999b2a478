"""This process's engine handles: one per configuration, reused by the tests that share it, reset
before each, replaced when broken (no torch: handles come from the kv_start_engine function)."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Callable, NamedTuple

from ..config import CanaryConfig, PerturbSpec
from ..report import EngineRef
from .protocol import ArgumentError


class WatchedHandle:
    """An engine handle watched for calls that raise: it notes when one does (the pool then
    replaces it), but for an ArgumentError (the call refused its arguments; the engine did not run)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.raised = False

    def __repr__(self) -> str:
        return repr(self.target)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except ArgumentError:  # refused before the engine ran: it is as it was
                raise
            except BaseException:
                self.raised = True
                raise

        return call


@dataclass(frozen=True)
class EngineKey:
    """One engine handle's configuration, what the kv_start_engine function gets (whole: it is its
    one argument). Tests with equal keys share a handle.

    kind: "single" (kv_engine) or "pd" (kv_pd, a prefill/decode pair).
    canary: the canary's configuration for the test (its markers applied).
    engine: the engine's name, the --kv-canary-engine setting.
    attention: "mha", "swa", "mla", "hybrid" or "sparse".
    device: the handle's devices, "cpu" or "cuda:0"; for a pair on two GPUs, or a parallel
    engine's ranks, comma-separated ("cuda:0,cuda:1").
    seed: the run's --kv-canary-seed.
    model: the --kv-canary-model directory, or None for the engine's default.
    tp, pp: tensor-parallel ranks and pipeline stages (1 and 1: one process).
    transport: how a pair moves KV, "local" (one process) or "processes" (pd_processes).
    """

    kind: str
    canary: CanaryConfig
    engine: str
    attention: str
    device: str
    seed: int
    model: str | None = None
    tp: int = 1
    pp: int = 1
    transport: str = "local"


class Checkout(NamedTuple):
    serial: int  # the handle's number in this process, naming it in the results
    handle: WatchedHandle


class EnginePool:
    """start: kv_start_engine's function, from an EngineKey to a handle. worker: this process's
    name in the results ("main" or the xdist worker id). A handle that raised or reports itself
    unhealthy is closed after its test and replaced on next use; `take_retired()` hands out the
    record of each such replacement once, for the plugin to put on a test report."""

    def __init__(self, start: Callable[[EngineKey], Any], worker: str) -> None:
        self._start = start
        self._worker = worker
        self._handles: dict[EngineKey, Checkout] = {}
        self._serials = 0
        self._retired: list[dict[str, Any]] = []

    def describe(self, key: EngineKey, serial: int) -> EngineRef:
        """The handle for key, numbered `serial`, as the results name it."""
        return EngineRef(worker=self._worker, handle=serial, engine=key.engine, kind=key.kind,
                         attention=key.attention, device=key.device, canary=asdict(key.canary), tp=key.tp, pp=key.pp,
                         transport=key.transport)

    def checkout(self, key: EngineKey) -> Checkout:
        """The handle for key, started on first use (whatever starting raises propagates)."""
        if key not in self._handles:
            self._handles[key] = Checkout(self._serials, WatchedHandle(self._start(key)))
            self._serials += 1
        return self._handles[key]

    def reset(self, key: EngineKey, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        try:
            self._handles[key].handle.reset(seed, perturbs)
        except Exception as e:
            self._retire(key, f"reset raised {e!r}")
            raise

    def checkin(self, key: EngineKey) -> None:
        watched = self._handles[key].handle
        try:
            healthy = not watched.raised and watched.healthy()
        except Exception:
            healthy = False
        if not healthy:
            self._retire(key, "raised" if watched.raised else "unhealthy")

    def take_retired(self) -> list[dict[str, Any]]:
        retired, self._retired = self._retired, []
        return retired

    def close(self) -> None:
        for key in list(self._handles):
            self._handles.pop(key).handle.target.close()

    def _retire(self, key: EngineKey, why: str) -> None:
        serial, watched = self._handles.pop(key)
        self._retired.append({"engine": asdict(self.describe(key, serial)), "retired": why})
        watched.target.close()
