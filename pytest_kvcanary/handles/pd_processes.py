"""ProcessPairHandle: a prefill/decode pair whose engines run in processes of their own, the KV
moving between them over torch.distributed point-to-point (handles/pd_side.py, the processes;
reference_engine/pd_remote.py and pd_transport.py, the transfers). What kv_pd hands a test under
`kv_pd(transport="processes")` / `--kv-canary-pd-transport=processes`.

It is a parallel.ParallelHandle of two processes (RankProcesses starts and watches them), whose
sides are "prefill" and "decode" and whose generate also reports the requests whose transfer was
given up. The fault ledger's injections are matched here, against both sides' violations: damage
injected in the prefill process is detected in the decode process. `run_workload` runs the workload
soak in the decode process, which drives both (handles/pd_soak.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ..config import PerturbSpec
from ..perturb.ledger import Injection
from ..reference_engine.pd_remote import DecodeResult
from ..reference_engine.pd_transport import TransportFault
from . import pd_side
from .parallel import ParallelHandle, RankFailure, RankProcesses, _unsupported
from .pd_side import DEFAULT_TRANSFER_TIMEOUT_S, PairSpec
from .pd_soak import match_across
from .protocol import ArgumentError

if TYPE_CHECKING:
    from ..soak.verdicts import SoakResult


class PairFailure(RuntimeError):
    """A process of the pair died during a generate call; the message says which requests the
    decode side aborted (it never decodes one whose transfer did not complete)."""


class Aborted(NamedTuple):
    """A request whose transfer the decode side gave up on: its prompt and why."""

    prompt: str
    reason: str


class ProcessPairHandle(ParallelHandle):
    """Sides "prefill" (rank 1) and "decode" (rank 0)."""

    def __init__(self, spec: PairSpec) -> None:
        super().__init__(spec, RankProcesses(spec, pd_side.main, world=2, grace_s=spec.timeout_s))
        self.transfer_timeout_s = DEFAULT_TRANSFER_TIMEOUT_S
        self._faults: list[TransportFault] = []
        self._aborted: list[Aborted] = []
        self.armed: tuple[int, tuple[PerturbSpec, ...]] = (0, ())  # the last reset's seed and faults

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None:
        super().reset(seed, perturbs)
        self.transfer_timeout_s = DEFAULT_TRANSFER_TIMEOUT_S
        self._faults, self._aborted = [], []
        self.armed, self.soak_results = (seed, perturbs), []

    def arm_transport_fault(self, fault: str, transfer: int = 0) -> None:
        """Put a transport fault on transfer number `transfer` since the reset, until the next
        reset: one of pd_transport's TRANSPORT_FAULTS, the defects stale_bytes, freed_slots and
        logical_ids, which the canary must catch, or the failures late_transfer and prefill_killed,
        which abort requests."""
        try:
            armed = TransportFault(fault, transfer)
        except ValueError as e:
            raise ArgumentError(f"arm_transport_fault: {e}") from None
        if fault == "late_transfer" and self.spec.devices[0].startswith("cuda"):
            raise ArgumentError("arm_transport_fault: late_transfer sends a transfer after later ones, and NCCL "
                                "matches sends to receives in order: it runs on a CPU pair (gloo) only")
        self._faults.append(armed)

    def set_transfer_timeout(self, seconds: float) -> None:
        """How long the decode side waits for a transfer it admitted before it gives up on it and
        aborts its request, until the next reset (default DEFAULT_TRANSFER_TIMEOUT_S)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ArgumentError(f"set_transfer_timeout: seconds must be a number > 0; got {seconds!r}")
        self.transfer_timeout_s = float(seconds)

    def set_canary(self, on: bool) -> None:
        """Attach both sides' canaries (as the pair starts) or detach them: a detached pair stamps
        and verifies nothing (no HEAD on the decode side) and its transfers carry no sidecar.
        Then resets the pair with the last reset's seed and faults: records stamped before a detach
        are stale after it. In the same processes, so a benchmark pairs canary on and off."""
        self.processes.call("canary", bool(on))
        self.reset(*self.armed)

    def transfer_aborts(self) -> list[Aborted]:
        """The requests whose transfer was given up since the reset, in the order they were sent."""
        return list(self._aborted)

    def unsupported(self, perturbs: tuple[PerturbSpec, ...]) -> str | None:
        """Why either side's engine cannot run one of these faults at all."""
        return next((why for why in self.call(functools.partial(_unsupported, perturbs)) if why), None)

    def _generate(self, prompts: Sequence[Any], max_new_tokens: int,
                  context_keys: Sequence[int] | None = None) -> list[list[int]]:
        self._reports = None
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        keys = None if context_keys is None else list(context_keys)
        try:
            decoded: DecodeResult = self.processes.call("generate", prompts, max_new_tokens, keys,
                                                        self.transfer_timeout_s, tuple(self._faults))[0]
        except RankFailure as e:
            raise PairFailure(f"the prefill/decode pair's processes died during generate: {e}") from None
        self._aborted += [Aborted(str(prompts[i]), why) for i, why in sorted(decoded.aborted.items())]
        if decoded.failure is not None:
            lines = [f"  request {i} ({str(prompts[i])[:40]!r}): {why}" for i, why in sorted(decoded.aborted.items())]
            raise PairFailure(f"{decoded.failure}; the decode side aborted {len(lines)} request(s) whose transfer "
                              "had not completed, and decoded none of them:\n" + "\n".join(lines) +
                              f"\n{self.processes.failure()}")
        return decoded.outputs

    def injections(self) -> list[Injection]:
        """Both sides' injections, matched against both sides' violations."""
        return match_across(super().injections(), self.violations())

    def run_workload(self, seed: int | None = None, rounds: int = 12, **options: Any) -> SoakResult:
        """The workload soak (SidedHandle.run_workload: the same arguments and result), run in
        the decode process over both, from the pair's current state; each generate call runs with
        this handle's transfer timeout and armed transport faults. The pair soaks in generate
        batches (no request joins a running batch: neither side serves arrivals)."""
        self._reports = None
        try:
            result = self.processes.call("soak", self.armed, self.transfer_timeout_s, tuple(self._faults),
                                         {"seed": seed, "rounds": rounds, **options})[0]
        except RankFailure as e:
            raise PairFailure(f"the prefill/decode pair's processes died during a soak: {e}") from None
        if isinstance(result, ArgumentError):
            raise result
        self.soak_results.append(result)
        return result

    def liveness(self) -> dict[str, int]:
        """Both engines' `Engine.liveness` counts added up, and the transfers the decode side
        landed, since the pair started (a soak's liveness gate)."""
        counts: dict[str, int] = {}
        for side in self.processes.call("liveness"):
            for name, n in side.items():
                counts[name] = counts.get(name, 0) + n
        return counts


def start_pd_processes(attention: str, seed: int, canary: Any, devices: Sequence[str], model: str | None = None,
                       **engine: Any) -> ProcessPairHandle:
    """A cross-process pair of the reference engine: prefill on devices[0], decode on devices[-1]
    (the same device for both when one is given)."""
    return ProcessPairHandle(PairSpec(attention, seed, canary, (devices[0], devices[-1]), model, engine))

