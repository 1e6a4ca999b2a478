"""One side of a prefill/decode pair whose engines run in processes of their own: the process's
engine, its canary, the records that travel with its transfers, and the commands it serves.

    main(spec, rank, port, conn, parent)     started by parallel.RankProcesses (spawn)
    python -m pytest_kvcanary.handles.pd_side --job JOB --out OUT     started by torchrun

Rank 0 runs the decode engine and takes the commands (from the launcher's pipe, or the job file
under torchrun); it broadcasts each to rank 1, the prefill engine, over the control group, both run
it, and rank 0 gathers the results. A "soak" command rank 0 runs itself (handles.pd_soak): the
workload soak drives the pair from there, each of its steps a command of its own. Rank 0 decodes
because it outlives a prefill process that dies: it then answers with the requests it aborted, and
the launcher reads them (RankProcesses' grace). A process also dies with the launcher's
(handles.rank), and leaves its traceback in the store when a command raises.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from kvcanary_kernels.records import RECORD_WIDTH, GroupKind

from ..adapters.reference import reference_config
from ..canary.seam import UnsupportedAttention
from ..config import CanaryConfig, PerturbSpec
from ..gpu import interpreter_on
from ..perturb.ledger import Ledger
from ..reference_engine.config import EngineConfig
from ..reference_engine.engine import Engine
from ..reference_engine.pd_remote import DECODE_RANK, DecodeProcess, DecodeResult, Link, PrefillProcess
from ..reference_engine.pd_transport import NoRecords, TransportFault
from ..reference_engine.parallel.topology import Topology
from . import rank as rank_process
from .pd import note_moves
from .pd_soak import PairSoakHandle
from .protocol import ArgumentError
from .rank import RankContext, RankReport
from .sided import Side, SidedHandle

ROLES = ("decode", "prefill")  # by rank
DEFAULT_TRANSFER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PairSpec:
    """A cross-process pair of the reference engine: attention kind, seed and model as for one
    engine (adapters/reference.py; `engine`: more of reference_config's options), the canary as the
    test asked (the sides log), devices by side ("prefill", "decode"), and timeout_s: how long a
    side waits for the other in one exchange (a side that waits longer gives up on the pair).
    config: both engines' EngineConfig instead of reference_config's (a benchmark's shapes; each
    side's device replaces its own; its model's attention is `attention`; model and engine unused)."""

    attention: str
    seed: int
    canary: CanaryConfig
    devices: tuple[str, str] = ("cpu", "cpu")
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0
    kind: str = "pd"
    topology: Topology = Topology()  # each side is one rank
    config: EngineConfig | None = None

    def __post_init__(self) -> None:
        if self.config is not None and self.config.model.attention != self.attention:
            raise ValueError(f"config's model has attention {self.config.model.attention!r}; the pair's is "
                             f"{self.attention!r}")
        stays = {"hybrid": "its recurrent state does", "sparse": "its indexer keys do"}.get(self.attention)
        if stays:
            raise UnsupportedAttention(f"kv_pd(transport='processes') does not run attention {self.attention!r}: "
                                       f"{stays} not travel between processes yet")

    def device(self, role: str) -> str:
        return self.devices[0 if role == "prefill" else 1]

    def engine_config(self, role: str) -> EngineConfig:
        """The engine of side `role`, on its device."""
        if self.config is not None:
            return replace(self.config, device=self.device(role))
        return reference_config(self.attention, self.device(role), self.seed, self.model, **self.engine)


class PeerGone(RuntimeError):
    """The other side of the pair died during `command`; `result`: what this side's run returned."""

    def __init__(self, command: tuple, result: Any) -> None:
        super().__init__(f"the other side died during {command[0]!r}")
        self.command, self.result = command, result


class RecordSidecar:
    """The transport's Sidecar over a side's canary: every group's records, both halves, as
    ``[n, groups x halves x RECORD_WIDTH]`` int64; on the prefill side, the ledger hears where
    the transferred slots went, and which of them the decode side freed (noted there while
    `follow_frees`: faults are armed on the prefill side)."""

    def __init__(self, side: Side, ledger: Ledger) -> None:
        self.runtime, self.ledger = side.runtime, ledger
        self.follow_frees = False
        self._frees: list[tuple[GroupKind, list[int], str, int]] = []  # (group, its slots, cause, forward)
        if side.name == "decode":
            side.engine.add_free_listener(self._on_free)

    def _on_free(self, kind: GroupKind, slots: torch.Tensor, cause: str) -> None:
        """Decode side (a FreeListener): note the freed slots in the group's own numbering, which
        the prefill ledger's places use (an SWA slot is still mapped from its FULL slot here)."""
        if self.follow_frees:
            freed = self.runtime.readout().group(kind).group_slots(slots.to(torch.int64))
            self._frees.append((kind, freed[freed != 0].tolist(), cause, self.runtime.forwards))

    def take_frees(self) -> list[tuple[GroupKind, list[int], str, int]]:
        frees, self._frees = self._frees, []
        return frees

    def note_frees(self, frees: list[tuple[GroupKind, list[int], str, int]]) -> None:
        for kind, slots, cause, step in frees:
            self.ledger.escape("decode", kind, set(slots), cause, step)

    def width(self) -> int:
        return sum(len(group.halves) for group in self.runtime.groups) * RECORD_WIDTH

    def export(self, full_slots: torch.Tensor) -> torch.Tensor:
        return torch.cat([rows for halves in self.runtime.export_records(full_slots) for rows in halves.values()], 1)

    def install(self, full_slots: torch.Tensor, sidecar: torch.Tensor) -> None:
        columns = iter(sidecar.split(RECORD_WIDTH, 1))
        self.runtime.import_records(full_slots, [{half: next(columns) for half in group.halves}
                                                 for group in self.runtime.groups])

    def receipt(self, full_slots: torch.Tensor) -> list[list[int]]:
        return [group.to_group_slots(full_slots.to(group.device)).tolist() for group in self.runtime.groups]

    def delivered(self, src_full_slots: list[int], dst_full_slots: list[int], receipt: list[list[int]]) -> None:
        note_moves(self.ledger, self.runtime.groups, src_full_slots, dst_full_slots, receipt)


class SideHandle(SidedHandle):
    """The handle of one side's engine in its process (one Side, named by its role)."""

    def __init__(self, role: str, engine: Engine, canary: CanaryConfig) -> None:
        super().__init__()
        self.sides = [Side(role, engine, canary, self.ledger)]


class SideServer:
    """This process's engine, its handle, its half of the pair, and the commands it runs."""

    def __init__(self, spec: PairSpec, rank: int, link: Link) -> None:
        self.role = ROLES[rank]
        self.engine = Engine(spec.engine_config(self.role))
        self.handle = SideHandle(self.role, self.engine, replace(spec.canary, mode="log"))
        self.sidecar = RecordSidecar(self.handle.sides[0], self.handle.ledger)
        self.half = (DecodeProcess(self.engine, link, self.sidecar, spec.timeout_s) if self.role == "decode"
                     else PrefillProcess(self.engine, link, self.sidecar))
        self.context = RankContext(rank, 0, self.handle, {self.role: self.engine})
        self.dangling = 0  # receives that never drained: their slots may still be written

    def set_canary(self, on: bool) -> None:
        """Attach this side's canary (its forward hooks, and the records its transfers carry) or
        detach it: a detached side stamps and verifies nothing, and its transfers carry the KV
        alone (NoRecords). Records go stale while it is detached: reset before the next generate."""
        self.engine.set_forward_hooks(self.handle.sides[0].runtime if on else None)
        self.half.sidecar = self.sidecar if on else NoRecords()

    def run(self, command: tuple) -> Any:
        name, *args = command
        if name == "generate":
            prompts, max_new_tokens, context_keys, timeout_s, faults = args
            if isinstance(self.half, PrefillProcess):
                return self.half.generate(prompts, max_new_tokens, context_keys or [0] * len(prompts), faults)
            result = self.half.generate(len(prompts), timeout_s, faults)
            self.dangling += result.dangling
            return result
        if name == "reset":  # (seed, perturbs[, keep_counts]): a soak's own resets keep the counts
            seed, perturbs, *keep = args
            if isinstance(self.half, DecodeProcess):
                self.half.reset()
            self.sidecar.take_frees()
            self.sidecar.follow_frees = any(p.side in (None, "prefill") for p in perturbs)
            return self.handle.reset(seed, tuple(p for p in perturbs if p.side in (None, self.role)),
                                     keep_counts=bool(keep and keep[0]))
        if name == "canary":  # (on): both sides attach or detach their canaries
            return self.set_canary(bool(args[0]))
        if name == "forwards":
            return self.handle.sides[0].runtime.forwards
        if name == "sweep":  # (role): that side's canary sweeps its prefix cache
            if args[0] == self.role:
                self.handle.sides[0].runtime.sweep()
            return None
        if name == "liveness":
            counts = dict(self.engine.liveness())
            if isinstance(self.half, DecodeProcess):
                counts["transfers"] = self.half.num_landed
            return counts
        if name == "collect":
            handle = self.handle
            found = handle.violations()
            return RankReport(found, [handle.request_label(v) for v in found], handle.injections(), handle.stats(),
                              handle.healthy() and not self.dangling)
        if name == "call":
            return args[0](self.context)
        if name == "close":
            return self.handle.close()
        raise ValueError(f"unknown command {name!r}")

    def exchange(self, control: Any, command: tuple | None) -> tuple[tuple, list[Any]]:
        """Run one command on both sides: rank 0 passes it and broadcasts it, rank 1 passes None
        and receives it. Returns the command and, on rank 0, both results by rank (rank 1: its
        own alone). Raises PeerGone when the other side died during the command."""
        holder = [command]
        dist.broadcast_object_list(holder, src=DECODE_RANK, group=control)
        command = holder[0]
        result = self.run(command)
        results: list[Any] | None = [None, None] if self.role == "decode" else None
        try:
            dist.gather_object(result, results, dst=DECODE_RANK, group=control)
        except RuntimeError:
            raise PeerGone(command, result) from None
        return command, results if results is not None else [result]

    def serve(self, control: Any, commands: Iterator[tuple] | None,
              reply: Callable[[tuple, list[Any]], None] | None) -> bool:
        """Run commands until "close" (rank 0 takes them from `commands` and hands each with the
        results of both sides to `reply`; an exhausted iterator closes). Returns False when the
        other side died during a command (rank 0 has replied with its own result)."""
        while True:
            command = next(commands, ("close",)) if commands is not None else None
            if command is not None and command[0] == "soak":  # rank 0 drives it: its steps are commands
                if reply is not None:
                    reply(command, [self.soak(control, *command[1:]), None])
                continue
            try:
                command, results = self.exchange(control, command)
            except PeerGone as gone:  # answer with what this side saw
                if reply is not None:
                    reply(gone.command, [gone.result, None])
                return False
            if reply is not None:
                reply(command, results)
            if command[0] == "close":
                return True

    def soak(self, control: Any, armed: tuple[int, tuple[PerturbSpec, ...]], transfer_timeout_s: float,
             faults: tuple[TransportFault, ...], options: dict[str, Any]) -> Any:
        """Rank 0: the workload soak (SidedHandle.run_workload's options) over the pair, from its
        current state; its SoakResult, or the ArgumentError its options got."""
        handle = PairSoakHandle(self.handle.sides[0], lambda c: self.exchange(control, c)[1], armed,
                                transfer_timeout_s, faults)
        try:
            return handle.run_workload(**options)
        except ArgumentError as e:
            return e

    def check_request(self, command: tuple) -> None:
        """Raise what the engine raises for a request of a generate command it would refuse."""
        if command[0] == "generate":
            prompts, max_new_tokens, context_keys = command[1:4]
            for i, prompt in enumerate(prompts):
                self.engine.encode_request(prompt, max_new_tokens, 0 if context_keys is None else context_keys[i])


def _join(spec: PairSpec, rank: int, backend: str, store: Any | None) -> tuple[SideServer, Any]:
    """Join the pair's world (through `store`, else env://, as torchrun starts it) and build this side."""
    timeout = timedelta(seconds=spec.timeout_s)
    device = torch.device(spec.device(ROLES[rank]))
    init = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=2, timeout=timeout,
                            device_id=device if device.type == "cuda" else None, **init)
    control = dist.new_group(backend="gloo", timeout=timeout)
    if backend == "nccl":
        _connect(rank, device)
    return SideServer(spec, rank, Link(rank, backend, control)), control


def _connect(rank: int, device: torch.device) -> None:
    """One blocking send, prefill to decode, as the pair starts. NCCL creates two ranks'
    point-to-point connection at their first send/receive, with both taking part: a receive the
    decode side posts first would wait in its host call for a prefill side that waits for it in
    the control exchange."""
    probe = torch.zeros(1, device=device)
    if rank == DECODE_RANK:
        dist.recv(probe, 1 - rank)
    else:
        dist.send(probe, 1 - rank)


def _commands(conn: Connection, server: SideServer) -> Iterator[tuple]:
    """The launcher's commands; a generate the engine would refuse is answered here, as an error."""
    while True:
        try:
            command = conn.recv()
        except EOFError:  # the launcher is gone
            return
        try:
            server.check_request(command)
        except Exception as e:
            conn.send(("error", e))
            continue
        yield command


def main(spec: PairSpec, rank: int, port: int, conn: Connection | None, parent: int) -> None:
    """A side's process, started by RankProcesses: see the module docstring."""
    rank_process._die_with_parent(parent)
    store = None
    try:
        role = ROLES[rank]
        backend = rank_process._backend(torch.device(spec.device(role)), 2)
        store = dist.TCPStore(rank_process.LOCALHOST, port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
        server, control = _join(spec, rank, backend, store)
        if conn is not None:
            conn.send(("ready", server.handle.pool_groups()))
        whole = server.serve(control, None if conn is None else _commands(conn, server),
                             None if conn is None else lambda _, results: conn.send(("ok", results)))
        if whole:
            dist.destroy_process_group()
    except BaseException:
        message = f"{ROLES[rank]} process (rank {rank}): {traceback.format_exc()}"
        if store is not None:
            store.set(f"error/{rank}", message)
        print(message, file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)  # a receive left posted (a pair whose other side died) must not abort the exit


def _job_result(name: str, results: list[Any]) -> Any:
    """A command's results (rank 0's first) as the job's output file holds them."""
    if name == "generate":
        decoded: DecodeResult = results[0]
        return {"outputs": decoded.outputs, "aborted": {str(i): why for i, why in decoded.aborted.items()},
                "failure": decoded.failure}
    if name == "collect":
        return {ROLES[r]: {"violations": [v.to_json() for v in report.violations],
                           "injections": [i.to_json() for i in report.injections], "healthy": report.healthy}
                for r, report in enumerate(results) if report is not None}
    raise ValueError(f"no result of {name!r} goes to the job's output")


def _job_commands(job: dict[str, Any]) -> Iterator[tuple]:
    """A job file's commands as the server takes them: a "fault" arms the generates after it,
    until the next reset."""
    faults: list[TransportFault] = []
    for name, *rest in job["commands"]:
        if name == "fault":
            faults.append(TransportFault(*rest))
        elif name == "reset":
            faults.clear()
            yield ("reset", rest[0], ())
        elif name == "generate":
            yield ("generate", rest[0], rest[1], None, DEFAULT_TRANSFER_TIMEOUT_S, tuple(faults))
        else:
            yield (name,)


def cpu_kernels_problem(kernels: str, device: str, env: Mapping[str, str] = os.environ) -> str | None:
    """Why a rank on `device` cannot run the canary's `kernels`, or None: Triton kernels on the CPU
    need Triton's interpreter (TRITON_INTERPRET=1 before Triton loads)."""
    if kernels != "triton" or torch.device(device).type != "cpu" or interpreter_on(env):
        return None
    return (f"spec.canary.kernels is 'triton' and this rank runs on the CPU ({device}; torchrun gives each local "
            f"rank a GPU only when there are as many GPUs as local ranks): set spec.canary.kernels to 'torch', "
            f"name GPUs in spec.devices, or set TRITON_INTERPRET=1")


def torchrun_main(argv: list[str]) -> None:
    """The entry point under torchrun (env://, two processes: RANK 0 decodes, RANK 1 prefills).
    --job: a JSON file of {"spec": {attention, seed, canary?, model?, engine?, devices?},
    "commands": [...]}, each command ["reset", seed] / ["generate", prompts, max_new_tokens] /
    ["fault", name, transfer] / ["collect"]; rank 0 writes one JSON line per generate and collect
    to --out (docs/pd-processes.md)."""
    parser = argparse.ArgumentParser(prog="python -m pytest_kvcanary.handles.pd_side")
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.job) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    if (world := os.environ["WORLD_SIZE"]) != "2":
        raise SystemExit(f"a prefill/decode pair is two processes: WORLD_SIZE must be 2; got {world}")
    fields = job["spec"]
    local, here = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    own = f"cuda:{local}" if torch.cuda.device_count() >= here else "cpu"  # a GPU each, or the CPU
    spec = PairSpec(fields["attention"], fields.get("seed", 0), CanaryConfig(**fields.get("canary", {})),
                    tuple(fields.get("devices") or (own, own)), fields.get("model"), fields.get("engine", {}))
    problem = cpu_kernels_problem(spec.canary.kernels, spec.device(ROLES[rank]))
    if problem:
        raise SystemExit(f"rank {rank} ({ROLES[rank]}): {problem}")
    backend = rank_process._backend(torch.device(spec.device(ROLES[rank])), 2, one_host=here == 2)
    server, control = _join(spec, rank, backend, None)

    def reply(command: tuple, results: list[Any]) -> None:
        if command[0] in ("generate", "collect"):
            with open(args.out, "a") as out:
                out.write(json.dumps({"command": command[0], "result": _job_result(command[0], results)}) + "\n")

    lead = rank == DECODE_RANK
    if server.serve(control, _job_commands(job) if lead else None, reply if lead else None):
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    torchrun_main(sys.argv[1:])
