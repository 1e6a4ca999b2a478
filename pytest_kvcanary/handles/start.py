"""start_engine: the function behind the kv_start_engine fixture. It builds an engine (or a
prefill/decode pair) through the engine-building hooks and hands it back as a handle with the
canary on. The plugin reaches this module only through that fixture, so torch loads only when a
test needs an engine.
"""

from __future__ import annotations

from typing import Any

from ..adapters.spec import EngineSpec
from ..reference_engine.parallel.topology import Topology
from .factories import NoParallelEngine, NoPrefillDecodePair, make_engine, make_pd_pair, parallel_problem
from .pd import PDHandle
from .pool import EngineKey
from .sided import RequestSender
from .single import EngineHandle


def _make_current(device: str) -> None:
    """Make a leased GPU this process's current CUDA device, so work launched on the current
    device (Triton kernels among it) runs where the engine's tensors live."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def _start_processes(key: EngineKey, devices: list[str]) -> RequestSender:
    """kv_pd's pair with each engine in a process of its own (pd_processes); the reference engine's
    only, one process a side."""
    if key.tp * key.pp > 1:
        raise NoParallelEngine(f"kv_pd(transport='processes') runs each side in one process; the test asks for "
                               f"tp={key.tp}, pp={key.pp} (kv_parallel)")
    if key.engine != "reference":
        raise NoPrefillDecodePair(f"kv_pd(transport='processes') runs the reference engine's pair; engine "
                                  f"{key.engine!r} has none across processes")
    if devices[0].startswith("cuda") and devices[-1] == devices[0]:
        raise NoParallelEngine(f"kv_pd(transport='processes') on GPUs needs two, one a side (NCCL refuses two "
                               f"ranks on one GPU); this run leases {devices[0]} only")
    from .pd_processes import start_pd_processes

    return start_pd_processes(key.attention, key.seed, key.canary, devices, key.model)


def start_engine(key: EngineKey, config: Any | None = None) -> RequestSender:
    """A handle of key.kind ("single" or "pd"), its (first) device made the current one. For pd,
    key.device may name two devices ("cuda:0,cuda:1"): prefill on the first, decode on the second;
    key.transport "processes": each in a process of its own (pd_processes.ProcessPairHandle).
    tp x pp > 1: the built-in engine over that many rank processes (parallel.ParallelHandle), rank
    r on the r-th device of key.device (one device: all of them). config: the pytest run's, whose
    hook implementations build the engine (the kv_start_engine fixture passes it); None: the
    built-in engines only, each option at its default. Raises what factories.make_engine /
    make_pd_pair / parallel.start_parallel raise, and NoParallelEngine for a parallel engine of a
    shape the engine does not run (factories.parallel_problem)."""
    devices = key.device.split(",")
    if key.kind == "pd" and key.transport == "processes":
        return _start_processes(key, devices)
    spec = EngineSpec(key.engine, key.attention, devices[0], key.seed, key.model, config=config)
    if key.tp * key.pp > 1:
        if problem := parallel_problem(key.engine, key.tp, key.pp):
            field, why = problem
            raise NoParallelEngine(f"kv_parallel({field}=...) {why}")
        from .parallel import start_parallel

        return start_parallel(key.kind, Topology(key.tp, key.pp), spec, key.canary, devices)
    _make_current(devices[0])
    if key.kind == "single":
        return EngineHandle(make_engine(spec), key.canary)
    if key.kind == "pd":
        pair = make_pd_pair(EngineSpec(key.engine, key.attention, devices[0], key.seed, key.model,
                                       decode_device=devices[-1], config=config))
        return PDHandle(pair, key.canary)
    raise ValueError(f"kind must be one of single, pd; got {key.kind!r}")
