"""One rank of a parallel engine, in a process of its own (`parallel.RankProcesses` starts them).

    main(spec, rank, port, conn, parent)
        joins the process groups through the TCPStore the launcher holds on `port`, builds this
        rank's engine with spec.engine, a ShardFactory (both engines of a prefill/decode pair for
        kind "pd"), and a handle over it
        (handles.single / handles.pd: the canary, the fault injector, the ledger), each side's
        canary wrapped in a RankCheck, runs spec.setup, then serves commands:
            rank 0 receives each from the launcher's pipe (a generate's requests checked first,
            so a bad request is an error of that call alone) and broadcasts it; every rank runs
            it on its own handle, the engines' forwards in step; rank 0 gathers the results and
            replies.

An error inside a command is fatal: the ranks may be out of step, waiting for one another in a
collective. The rank writes its traceback to the store (key `error/<rank>`) and exits; the
launcher, which watches every rank, reads it there. A rank also dies with the launcher's process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..canary.ranks import RankCheck
from ..canary.seam import EngineUnderTest
from ..canary.violation import Violation
from ..config import CanaryConfig
from ..reference_engine.parallel.groups import RankGroups
from ..reference_engine.parallel.topology import Topology
from ..reference_engine.pd import PDPair
from ..perturb.ledger import Injection
from .pd import PDHandle
from .sided import SidedHandle
from .single import EngineHandle

LOCALHOST = "127.0.0.1"
CONTROL_TIMEOUT = timedelta(days=1)  # a rank waits for the next command on the control group
KINDS = ("single", "pd")


@dataclass(frozen=True)
class RankContext:
    """What spec.setup gets in each rank: the rank, its stage, its handle and its engines by side."""

    rank: int
    stage: int
    handle: SidedHandle
    engines: dict[str, EngineUnderTest]


class ShardFactory(Protocol):
    """What builds each rank's engine of a parallel engine. Picklable: it crosses into every rank's
    process. pairs: whether it builds prefill/decode pairs (kind "pd")."""

    pairs: bool

    def check(self, topology: Topology) -> None:
        """ValueError, naming what does not split, unless the engine runs on this topology (called
        in the launcher, before any rank starts)."""

    def build(self, groups: RankGroups, device: str) -> EngineUnderTest:
        """This rank's engine on `device`, holding its shard (in the rank's process, once the
        process groups exist; every rank calls it in the same order)."""


@dataclass(frozen=True)
class RankSpec:
    """kind: "single" or "pd" (both sides on every rank); engine: what builds each rank's engine
    (the reference engine's: ReferenceShards(config), each rank its shard of that model); canary:
    as the test asked (ranks log; raise mode is the launcher's handle's business); devices: one
    per rank; setup: called in every rank once its handle is built (a picklable function; tests
    patch one rank's engine there); timeout_s: how long a rank waits for its peers inside a
    forward."""

    kind: str
    engine: ShardFactory
    canary: CanaryConfig
    topology: Topology
    devices: tuple[str, ...]
    setup: Callable[[RankContext], None] | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if len(self.devices) != self.topology.world:
            raise ValueError(f"devices must name one device per rank ({self.topology.world}); got {self.devices!r}")
        if self.kind == "pd" and not self.engine.pairs:
            raise ValueError(f"kind 'pd' needs prefill/decode pairs; {type(self.engine).__name__} builds none")
        self.engine.check(self.topology)


class RankReport(NamedTuple):
    """What one rank logged since the reset, tagged with its rank and stage: violations and the
    request each one's row held, the ledger, the canary's counters per side (keyed "<side> rank
    <r>") and whether every side's canary is healthy."""

    violations: list[Violation]
    labels: list[str | None]
    injections: list[Injection]
    stats: dict[str, dict[str, Any]]
    healthy: bool


def _die_with_parent(parent: int) -> None:
    """Exit when the launcher's process dies, however it dies (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:
        def watch() -> None:
            while os.getppid() == parent:
                threading.Event().wait(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _backend(device: torch.device, world: int, one_host: bool = True) -> str:
    """Make `device` this process's, and name the backend that reaches the other ranks from it
    (one_host: every rank is on this host, so gloo binds to the loopback interface unless
    GLOO_SOCKET_IFNAME says otherwise)."""
    if one_host and "GLOO_SOCKET_IFNAME" not in os.environ:
        names = {name for _, name in socket.if_nameindex()}
        loopback = next((n for n in ("lo", "lo0") if n in names), None)
        if loopback is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        return "nccl"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the CPU
    return "gloo"


class RankServer:
    """This rank's engines and handle, and the commands it runs."""

    def __init__(self, spec: RankSpec, groups: RankGroups, device: str) -> None:
        self.spec, self.groups, self.rank = spec, groups, groups.rank
        canary = replace(spec.canary, mode="log")
        if spec.kind == "single":
            engines = {"single": spec.engine.build(groups, device)}
            self.handle: SidedHandle = EngineHandle(engines["single"], canary)
        else:
            engines = {side: spec.engine.build(groups, device) for side in ("prefill", "decode")}
            self.handle = PDHandle(PDPair(engines["prefill"], engines["decode"]), canary)
        world = spec.topology.world
        for side in self.handle.sides:
            side.engine.set_forward_hooks(RankCheck(side.runtime, self.rank, world, groups.control))
        self.context = RankContext(self.rank, groups.stage, self.handle, engines)
        if spec.setup is not None:
            spec.setup(self.context)

    def serve(self, conn: Connection | None) -> None:
        """Run commands until "close" (rank 0: also when the launcher's pipe closes)."""
        if conn is not None:
            conn.send(("ready", self.handle.pool_groups()))
        while True:
            holder = [self._next_command(conn) if conn is not None else None]
            dist.broadcast_object_list(holder, src=0, group=self.groups.control)
            command = holder[0]
            result = self.run(command)
            results = [None] * self.spec.topology.world if self.rank == 0 else None
            dist.gather_object(result, results, dst=0, group=self.groups.control)
            if conn is not None:
                conn.send(("ok", results))
            if command[0] == "close":
                return

    def _next_command(self, conn: Connection) -> tuple:
        """The launcher's next command; requests it would fail on are answered here."""
        while True:
            try:
                command = conn.recv()
            except EOFError:  # the launcher is gone
                return ("close",)
            if command[0] != "generate":
                return command
            try:
                self._check_requests(*command[1:])
            except Exception as e:
                conn.send(("error", e))
                continue
            return command

    def _check_requests(self, prompts: list[Any], max_new_tokens: int, context_keys: list[int] | None) -> None:
        engine = self.context.engines["single" if self.spec.kind == "single" else "prefill"]
        for i, prompt in enumerate(prompts):
            engine.encode_request(prompt, max_new_tokens, 0 if context_keys is None else context_keys[i])

    def run(self, command: tuple) -> Any:
        name, *args = command
        handle = self.handle
        if name == "generate":
            prompts, max_new_tokens, context_keys = args
            keys = {} if context_keys is None else {"context_keys": context_keys}
            return handle.generate(prompts, max_new_tokens, **keys)
        if name == "reset":
            seed, perturbs = args
            return handle.reset(seed, tuple(p for p in perturbs if p.rank in (None, self.rank)))
        if name == "collect":
            return self.collect()
        if name == "call":
            return args[0](self.context)
        if name == "close":
            return handle.close()
        raise ValueError(f"unknown command {name!r}")

    def collect(self) -> RankReport:
        handle, tag = self.handle, dict(rank=self.rank, stage=self.groups.stage)
        found = handle.violations()
        labels = [handle.request_label(v) for v in found]
        injections = [replace(i, **tag, detected_by=None if i.detected_by is None else replace(i.detected_by, **tag))
                      for i in handle.injections()]
        stats = {f"{side} rank {self.rank}": {**values, "side": side, **tag} for side, values in handle.stats().items()}
        return RankReport([replace(v, **tag) for v in found], labels, injections, stats, handle.healthy())


def main(spec: RankSpec, rank: int, port: int, conn: Connection | None, parent: int) -> None:
    """The rank process: see the module docstring."""
    _die_with_parent(parent)
    store = None
    try:
        device = torch.device(spec.devices[rank])
        world = spec.topology.world
        backend = _backend(device, world)
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(LOCALHOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        groups = RankGroups.create(spec.topology, rank, CONTROL_TIMEOUT)
        RankServer(spec, groups, str(device)).serve(conn)
        dist.destroy_process_group()
    except BaseException:
        message = f"rank {rank}: {traceback.format_exc()}"
        if store is not None:
            store.set(f"error/{rank}", message)
        print(message, file=sys.stderr, flush=True)
        os._exit(1)
