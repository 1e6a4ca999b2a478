"""start_engine: the function behind the kv_start_engine fixture. It builds an engine (or a
prefill/decode pair) by name and hands it back as a handle with the canary on. The plugin reaches
this module only through that fixture, so torch loads only when a test needs an engine.
"""

from __future__ import annotations

from typing import Any

from ..config import CanaryConfig
from ..engine.parallel.topology import Topology
from .factories import NoParallelEngine, make_engine, make_pd_pair, parallel_problem
from .pd import PDHandle
from .sided import RequestSender
from .single import EngineHandle


def _make_current(device: str) -> None:
    """Make a leased GPU this process's current CUDA device, so work launched on the current
    device (Triton kernels among it) runs where the engine's tensors live."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def start_engine(kind: str, *, canary: CanaryConfig, attention: str, device: str, seed: int,
                 engine_name: str = "reference", model: str | None = None,
                 pluginmanager: Any | None = None, parallel: tuple[int, int] | None = None) -> RequestSender:
    """A handle of this kind ("single" or "pd"), its (first) device made the current one. For pd,
    device may name two devices ("cuda:0,cuda:1"): prefill on the first, decode on the second.
    parallel=(tp, pp): the built-in engine over tp x pp rank processes (parallel.ParallelHandle),
    rank r on the r-th device of `device` (one device: all of them). Raises what
    factories.make_engine / make_pd_pair / parallel.start_parallel raise, and NoParallelEngine for
    a parallel engine of a shape the engine does not run (factories.parallel_problem)."""
    if parallel is not None:
        if problem := parallel_problem(engine_name, *parallel):
            field, why = problem
            raise NoParallelEngine(f"kv_parallel({field}=...) {why}")
        from .parallel import start_parallel

        return start_parallel(kind, Topology(*parallel), canary=canary, attention=attention,
                              devices=device.split(","), seed=seed, model=model, engine_name=engine_name)
    _make_current(device.split(",")[0])
    if kind == "single":
        return EngineHandle(make_engine(engine_name, attention, device, seed, model, pluginmanager), canary)
    if kind == "pd":
        devices = device.split(",")
        pair = make_pd_pair(engine_name, attention, (devices[0], devices[-1]), seed, model, pluginmanager)
        return PDHandle(pair, canary)
    raise ValueError(f"kind must be one of single, pd; got {kind!r}")
