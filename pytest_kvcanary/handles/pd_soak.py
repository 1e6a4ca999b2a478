"""PairSoakHandle: a cross-process prefill/decode pair as the workload soak drives it, from the
decode process (rank 0, which takes the pair's commands: handles/pd_side.py).

The soak (soak/runner.py) runs there unchanged: this process's side is the decode engine, whose
no-cache recomputation (`score_uncached`) is the oracle and whose canary gives the workload its
shape; every step that needs both processes (a generate call, a reset, the prefill side's forwards
and sweep, reading the logs) is one command run on both. `ProcessPairHandle.run_workload` sends the
soak there as one command and gets its SoakResult back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, NamedTuple, Sequence

from ..canary.seam import EngineDefect
from ..canary.violation import Violation
from ..config import PerturbSpec
from ..perturb.ledger import Injection, Ledger
from ..reference_engine.pd_remote import DECODE_RANK, PREFILL_RANK, DecodeResult
from ..reference_engine.pd_transport import TransportFault
from .sided import Side, SidedHandle

RunBoth = Callable[[tuple], list[Any]]  # a command run on both processes -> the results by rank


def match_across(injections: list[Injection], violations: list[Violation]) -> list[Injection]:
    """Both sides' injections matched against both sides' violations: damage injected in the
    prefill process and moved by a transfer is detected in the decode process."""
    ledger = Ledger()
    ledger.injections = injections
    ledger.match(violations)
    return ledger.injections


class PeerRuntime:
    """The prefill process's canary as the soak reads it: its forwards and its sweep."""

    def __init__(self, run_both: RunBoth) -> None:
        self._run_both = run_both

    @property
    def forwards(self) -> int:
        return self._run_both(("forwards",))[PREFILL_RANK]

    def sweep(self) -> None:
        self._run_both(("sweep", "prefill"))


class PeerSide(NamedTuple):
    """The prefill side, in the other process: its name and its canary (PeerRuntime); its engine
    is not reachable from here (None)."""

    name: str
    runtime: PeerRuntime
    engine: None = None


class PairSoakHandle(SidedHandle):
    """Sides "decode" (this process's Side) and "prefill" (PeerSide). armed: the seed and faults of
    the pair's last reset; transfer_timeout_s and faults: what each generate call runs with (the
    handle's transfer timeout, its armed transport faults)."""

    def __init__(self, decode: Side, run_both: RunBoth, armed: tuple[int, tuple[PerturbSpec, ...]],
                 transfer_timeout_s: float, faults: tuple[TransportFault, ...]) -> None:
        super().__init__()
        self.sides = [decode, PeerSide("prefill", PeerRuntime(run_both))]
        self.armed = armed
        self._run_both = run_both
        self._transfer = (transfer_timeout_s, faults)

    def _engine_generate(self) -> Callable[..., list[list[int]]]:
        return self._generate

    def _generate(self, prompts: Sequence[Any], max_new_tokens: int,
                  context_keys: Sequence[int] | None = None) -> list[list[int]]:
        """Both halves of one generate call. A request whose transfer was given up raises: its
        output is not the engine's, and the soak would call it damage."""
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        keys = None if context_keys is None else list(context_keys)
        command = ("generate", prompts, max_new_tokens, keys, *self._transfer)
        decoded: DecodeResult = self._run_both(command)[DECODE_RANK]
        if decoded.failure is not None or decoded.aborted:
            raise RuntimeError(f"the pair gave up on transfers during a soak ({decoded.failure or 'both alive'}): "
                               + "; ".join(f"request {i}: {why}" for i, why in sorted(decoded.aborted.items())))
        return decoded.outputs

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...], *, keep_counts: bool = False) -> None:
        """Both processes reset (their ledgers, logs and faults); keep_counts as SidedHandle.reset."""
        self._run_both(("reset", seed, perturbs, keep_counts))
        self._restart(seed)
        self.armed = (seed, perturbs)

    def drain(self) -> None:
        """Nothing: the sides log, and `violations` drains both."""

    def _generating(self, sent: int) -> ContextManager[None]:
        """No progress line: the decode process has no terminal (the launcher shows none either)."""
        return contextlib.nullcontext()

    def _reports(self) -> list[Any]:
        return self._run_both(("collect",))

    def violations(self) -> list[Violation]:
        return [v for report in self._reports() for v in report.violations]

    def injections(self) -> list[Injection]:
        reports = self._reports()
        return match_across([i for r in reports for i in r.injections], [v for r in reports for v in r.violations])

    def engine_defects(self) -> list[tuple[str, EngineDefect]]:
        """None: the reference engine documents no defect of its own."""
        return []
