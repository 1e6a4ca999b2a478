"""ParallelHandle: a parallel engine (the reference engine's, or transformers' tensor parallel), one
process per rank (handles.rank), each with its own canary; what kv_engine and kv_pd hand a test
under kv_parallel.

RankProcesses starts the ranks (the spawn method: fresh interpreters, safe with CUDA), holds the
TCPStore they meet at (on a port the OS picks, held until close), talks to rank 0 over a pipe and
watches every rank: when one dies, the call fails at once with the tracebacks the ranks left in
the store, and the others are killed. Ranks also die with this process (handles.rank).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, NoReturn, Sequence

import torch.distributed as dist

from ..adapters.spec import EngineSpec
from ..canary.log import KvCanaryViolationError
from ..canary.violation import Violation
from ..config import CanaryConfig, PerturbSpec
from ..reference_engine.parallel.topology import Topology
from ..perturb.ledger import Injection
from . import rank
from .factories import NoParallelEngine, NoPrefillDecodePair, make_shards
from .rank import RankContext, RankReport, RankSpec
from .sided import RequestSender

CLOSE_TIMEOUT_S = 60.0


class RankFailure(RuntimeError):
    """A rank of a parallel engine died; the engine is gone (its other ranks are killed)."""


class RankProcesses:
    """The processes of one parallel engine. `call(*command)` runs a command on every rank (see
    handles.rank) and returns the results, one per rank; an error rank 0 answers with (a request
    the engine refuses) is raised as it is, a rank's death as RankFailure. main: what each process
    runs, main(spec, rank, port, conn, parent) (default: handles.rank's); world: how many (default:
    spec.topology's); grace_s: how long rank 0 may still answer once another rank died (the
    prefill/decode pair's decode side reports the requests it aborted)."""

    def __init__(self, spec: Any, main: Callable[..., None] = rank.main, world: int | None = None,
                 grace_s: float = 0.0) -> None:
        self.world = spec.topology.world if world is None else world
        self._grace_s = grace_s
        self._store: Any = dist.TCPStore(rank.LOCALHOST, 0, is_master=True, wait_for_workers=False,
                                         timeout=timedelta(seconds=spec.timeout_s))
        self.port: int = self._store.port  # the port the ranks meet at (free again once closed)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.processes = [context.Process(target=main, name=f"kv-canary rank {r}", daemon=True,
                                          args=(spec, r, self._store.port, child if r == 0 else None, os.getpid()))
                          for r in range(self.world)]
        try:
            for process in self.processes:
                process.start()
        finally:
            child.close()
        self.pool_groups: tuple[str, ...] = self._receive()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def call(self, *command: Any) -> list[Any]:
        if not self.alive():
            self._fail()
        self._conn.send(command)
        return self._receive()

    def _receive(self) -> Any:
        ready = wait([self._conn, *(p.sentinel for p in self.processes)])
        if self._conn not in ready and self._grace_s and self.processes[0].is_alive():
            ready = wait([self._conn], self._grace_s)
        if self._conn in ready:
            try:
                kind, value = self._conn.recv()
            except EOFError:
                self._fail()
            if kind == "error":
                raise value
            return value
        self._fail()

    def _fail(self) -> NoReturn:
        raise self.failure()

    def failure(self) -> RankFailure:
        """Kill what is left of the engine; the RankFailure naming how each rank ended, with what
        each left in the store."""
        self.kill()
        ends = ", ".join(f"rank {r} " + ("killed" if p.exitcode == -signal.SIGKILL else f"exited with {p.exitcode}")
                         for r, p in enumerate(self.processes))
        store = self._store
        errors = [] if store is None else [store.get(key).decode() for key in (f"error/{r}" for r in range(self.world))
                                           if store.check([key])]
        return RankFailure(f"a rank of the parallel engine died ({ends})" + "".join(f"\n{e}" for e in errors))

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        self._conn.close()

    def close(self) -> None:
        """Stop the ranks (asked to close; killed when they do not within CLOSE_TIMEOUT_S) and free
        the port. Closing again does nothing."""
        if self._store is None:
            return
        if self.alive() and not self._conn.closed:
            try:
                self.call("close")
            except (RankFailure, OSError):
                pass
        for process in self.processes:
            process.join(CLOSE_TIMEOUT_S)
        self.kill()
        self._store = None  # the last reference: its server stops listening


class ParallelHandle(RequestSender):
    """A parallel engine of one kind ("single", or "pd": both sides tensor/pipeline parallel, each
    rank holding its shard of both), with the canary on every rank (see protocol.Handle).
    Violations, injections and counters are gathered from every rank, each tagged with its rank
    and stage; stats are keyed "<side> rank <r>". ranks: how many. The ranks log; in raise mode
    this handle raises at the drain that ends a generate (the ranks stay in step). call(fn): fn
    (picklable) run in every rank with its RankContext; the results, by rank. processes: the ranks'
    processes when already started (a prefill/decode pair's: handles.pd_processes)."""

    def __init__(self, spec: RankSpec, processes: RankProcesses | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.side_names = ("single",) if spec.kind == "single" else ("prefill", "decode")
        self.ranks = spec.topology.world
        self._processes = RankProcesses(spec) if processes is None else processes
        self.soak_results: list[Any] = []  # what the plugin reports of a test's soaks: it runs none
        self._reports: list[RankReport] | None = None  # until the ranks run again
        self._raised: set[Violation] = set()

    @property
    def processes(self) -> RankProcesses:
        return self._processes

    def pool_groups(self) -> tuple[str, ...]:
        return self._processes.pool_groups

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        self._restart(seed)
        self._reports, self._raised = None, set()
        self._processes.call("reset", seed, perturbs)

    def call(self, fn: Callable[[RankContext], Any]) -> list[Any]:
        self._reports = None
        return self._processes.call("call", fn)

    def unsupported(self, perturbs: tuple[PerturbSpec, ...]) -> str | None:
        """Why rank 0's engine cannot run one of these faults at all (every rank runs the same one)."""
        return self.call(functools.partial(_unsupported, perturbs))[0]

    def _engine_generate(self) -> Callable[..., list[list[int]]]:
        return self._generate

    def _generate(self, prompts: Sequence[Any], max_new_tokens: int,
                  context_keys: Sequence[int] | None = None) -> list[list[int]]:
        """Rank 0 takes the requests and broadcasts them; every rank's outputs are the same."""
        self._reports = None
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        keys = None if context_keys is None else list(context_keys)
        return self._processes.call("generate", prompts, max_new_tokens, keys)[0]

    def _collect(self) -> list[RankReport]:
        if self._reports is None:
            self._reports = self._processes.call("collect")
        return self._reports

    def drain(self) -> None:
        """Gather every rank's log; raise mode raises for violations no drain raised for yet."""
        new = [v for v in self.violations() if v not in self._raised]
        self._raised.update(new)
        if new and self.spec.canary.mode == "raise":
            raise KvCanaryViolationError(new)

    def violations(self) -> list[Violation]:
        return [v for report in self._collect() for v in report.violations]

    def injections(self) -> list[Injection]:
        return [i for report in self._collect() for i in report.injections]

    def request_label(self, violation: Violation) -> str | None:
        for report in self._collect():
            for found, label in zip(report.violations, report.labels):
                if found == violation:
                    return label
        return None

    def stats(self) -> dict[str, dict[str, Any]]:
        return {key: values for report in self._collect() for key, values in report.stats.items()}

    def healthy(self) -> bool:
        return self._processes.alive() and all(report.healthy for report in self._collect())

    def close(self) -> None:
        self._processes.close()


def _unsupported(perturbs: tuple[PerturbSpec, ...], context: RankContext) -> str | None:
    return context.handle.unsupported(perturbs)


def start_parallel(kind: str, topology: Topology, spec: EngineSpec, canary: CanaryConfig,
                   devices: Sequence[str]) -> ParallelHandle:
    """The built-in engine spec names split over topology's ranks (factories.make_shards), rank r
    on devices[r] (one device: every rank on it, as on a CPU). Raises what make_shards raises,
    NoParallelEngine when the model does not split over topology (the shard factory's check), and
    NoPrefillDecodePair for kind "pd" of an engine without pairs."""
    shards = make_shards(spec)
    try:
        shards.check(topology)
    except ValueError as e:  # the model does not split so: the test skips (plugin), saying why
        raise NoParallelEngine(f"kv_parallel(tp={topology.tp}, pp={topology.pp}): engine {spec.name!r} on "
                               f"{spec.attention} cannot split its model so: {e}") from None
    if kind == "pd" and not shards.pairs:
        raise NoPrefillDecodePair(f"kv_pd under kv_parallel needs prefill/decode pairs of engine {spec.name!r}, "
                                  "and it has none (the reference engine has)")
    devices = tuple(devices) * topology.world if len(devices) == 1 else tuple(devices)
    return ParallelHandle(RankSpec(kind, shards, canary, topology, devices))
