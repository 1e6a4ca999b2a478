"""What every engine handle is built from: the requests it sends (`RequestSender`: prompts, the
requests' nonces), sides (one engine each, its canary and fault injector) and the state a handle
keeps across them (the fault ledger, results, the workload soaks it ran).

single.EngineHandle has one side, pd.PDHandle two; both derive from SidedHandle, so neither
module imports the other. parallel.ParallelHandle sends its requests to the ranks of a parallel
engine, each of which holds a SidedHandle of its own.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence

from ..canary.runtime import CanaryRuntime
from ..canary.seam import EngineDefect, EngineUnderTest, capabilities_of, optional
from ..canary.violation import Violation
from ..config import CanaryConfig, PerturbSpec
from ..perturb.fit import lacking
from ..perturb.injector import FaultInjector
from ..perturb.ledger import Injection, Ledger
from .protocol import ArgumentError, check_context_keys, check_max_new_tokens, check_prompts, check_request_count

if TYPE_CHECKING:
    from ..canary.seam import Arrival
    from ..soak.verdicts import SoakResult
    from ..plugin_support.progress import ProgressFactory

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
        """Detach the canary, then close the engine when it has a close() (optional: an engine
        with patches or processes of its own undoes them there); the side is not used after."""
        self.engine.set_forward_hooks(None)
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


class RequestSender:
    """What every handle does with the requests a test sends (see protocol.Handle): checks them,
    records the prompts since the reset, draws the nonces of distinct prompts from the test's seed."""

    def __init__(self) -> None:
        self._prompts: list[str] = []
        self._rng = random.Random(0)

    def _restart(self, seed: int) -> None:
        """A new test: no prompts sent yet, nonces drawn from `seed`."""
        self._prompts.clear()
        self._rng = random.Random(seed)

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
        check_max_new_tokens(max_new_tokens)
        self._prompts.extend(p if isinstance(p, str) else repr(list(p)) for p in prompts)
        generate = self._engine_generate()
        contexts = {}
        if context_keys is not None:
            check_context_keys(context_keys, prompts, generate, type(getattr(generate, "__self__", generate)).__name__)
            contexts = {"context_keys": list(context_keys)}
        with self._generating(len(prompts)):
            outputs = generate(prompts, max_new_tokens, **contexts)
        self.drain()  # raise mode: a violation of the last forwards raises here, in the test's call
        return outputs

    def _generating(self, sent: int) -> ContextManager[None]:
        """Around a generate call of `sent` requests (a handle that shows progress shows it)."""
        return contextlib.nullcontext()

    def _engine_generate(self) -> Callable[..., list[list[int]]]:
        """The engine's (or pair's) generate(prompts, max_new_tokens[, context_keys=])."""
        raise NotImplementedError

    def prompts_since_reset(self) -> list[str]:
        return list(self._prompts)

    def drain(self) -> None:
        """Move what the engines logged where violations() reads it (raise mode raises)."""
        raise NotImplementedError


# The counters a reset inside a test (the soak's) keeps for the test's summary line: what the engine
# did. Violations, rows and drops stay the log's own, as the test's assertions see them.
KEPT_COUNTERS = ("forwards", "protected_tokens", "sweeps")


class SidedHandle(RequestSender):
    """What single and PD handles share (see protocol.Handle for the contract): the requests sent,
    the ledger, results read from the sides, the workload soak. progress: what makes the line a
    long generation or soak shows (requests finished of those sent, where the engines tell, and
    forwards); None shows none."""

    sides: list[Side]
    progress: ProgressFactory | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.armed: tuple[int, tuple[PerturbSpec, ...]] = (0, ())  # the last reset's seed and faults
        self.soak_results: list[SoakResult] = []  # the soaks run since the last reset
        self._showing = False  # a progress line is up (one at a time: the outermost work's)
        self._kept_counts: dict[str, dict[str, int]] = {}  # per side: counts a reset inside the test kept

    @property
    def side_names(self) -> tuple[str, ...]:
        return tuple(side.name for side in self.sides)

    def pool_groups(self) -> tuple[str, ...]:
        return tuple(kind.label for kind in self.sides[0].runtime.group_kinds)

    def require(self, *capabilities: str) -> None:
        """Skip the calling test where a side's engine lacks one of these capabilities (fields of
        the seam's `Capabilities`, as its adapter declares them), naming the capability and the
        engine: what a stock example that needs, say, a prefix cache calls first."""
        for side in self.sides:
            if missing := capabilities_of(side.engine).missing(*capabilities):
                import pytest

                pytest.skip(f"needs an engine with {' and '.join(missing)}; the {side.name} engine "
                            f"({type(side.engine).__name__}) declares {', '.join(f'{m}=False' for m in missing)} "
                            f"(EngineUnderTest.capabilities)")

    def unsupported(self, perturbs: tuple[PerturbSpec, ...]) -> str | None:
        """Why a side's engine cannot run one of these faults at all (perturb.fit.lacking), or None."""
        for spec in perturbs:
            for side in self.sides:
                why = (lacking(spec, side.engine, f"the {side.name} engine", [g.pool for g in side.runtime.groups],
                               side.runtime.capacities.max_context)
                       if spec.side in (None, side.name) else None)
                if why:
                    return why
        return None

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...], *, keep_counts: bool = False) -> None:
        """Flush caches, clear log, ledger and counters, restart step numbering, arm this test's faults.
        keep_counts: a reset inside a test (the soak's oracle and shrinking): the forwards, tokens and
        sweeps counted so far still count in `stats`, the test's summary line."""
        for side in self.sides:
            kept = self._kept_counts.setdefault(side.name, dict.fromkeys(KEPT_COUNTERS, 0))
            stats = side.runtime.stats()
            for name in KEPT_COUNTERS:
                kept[name] = kept[name] + getattr(stats, name) if keep_counts else 0
        self.ledger.clear()
        self._restart(seed)
        self.armed = (seed, perturbs)
        self.soak_results = []
        for side in self.sides:
            side.reset(seed, perturbs)

    # ------------------------------------------------------------------------------- progress
    def _finished(self) -> int | None:
        """Requests the sides' engines finished since the reset, or None when one cannot tell."""
        counts = [optional(side.engine, "finished_requests")() for side in self.sides]
        return None if None in counts else sum(counts)

    def _generating(self, sent: int) -> ContextManager[None]:
        """The progress line of a generate call of `sent` requests."""
        forwards, finished = sum(s.runtime.forwards for s in self.sides), self._finished()

        def describe() -> str:
            now = self._finished()
            done = (f"{sent} requests sent" if now is None or finished is None
                    else f"{now - finished}/{sent} requests finished")
            n = sum(s.runtime.forwards for s in self.sides) - forwards
            return f"{done}, {n} forward{'' if n == 1 else 's'}"

        return self._showing_progress(describe)

    @contextlib.contextmanager
    def _showing_progress(self, describe: Callable[[], str]) -> Iterator[None]:
        """A progress line reading describe(), ticked at every forward of either side; none while
        another is up (a soak's generate calls show the soak's line)."""
        if self.progress is None or self._showing:
            yield
            return
        line = self.progress(describe)
        tick = line.tick
        self._showing = True
        for side in self.sides:
            side.runtime.on_end_forward.append(tick)
        try:
            yield
        finally:
            for side in self.sides:
                side.runtime.on_end_forward.remove(tick)
            self._showing = False
            line.close()

    # ------------------------------------------------------------------------ the workload soak
    def _engine_serve(self) -> Callable[[Sequence[Arrival]], list[list[int]]] | None:
        """The engine's serve (EngineUnderTest.serve), or None when it has none."""
        return None

    def serves(self) -> bool:
        """Whether requests can join a running batch and be aborted (`serve`)."""
        return self._engine_serve() is not None

    def takes_context_keys(self) -> bool:
        return "context_keys" in inspect.signature(self._engine_generate()).parameters

    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]:
        """Requests arriving while others run (EngineUnderTest.serve): output ids per arrival."""
        serve = self._engine_serve()
        if serve is None:
            raise ArgumentError("this engine cannot serve requests that arrive while others run (no serve method)")
        check_prompts([a.prompt for a in arrivals])
        self._prompts.extend(repr(list(a.prompt)) for a in arrivals)
        outputs = serve(arrivals)
        self.drain()
        return outputs

    def run_workload(self, seed: int | None = None, rounds: int = 12, *, replay: str | None = None,
                     tie_tolerance: float | None = None, shrink_trials: int = 48, arrivals: bool = True
                     ) -> SoakResult:
        """Drive the engine with a seeded random workload (or the workload a failure's `replay`
        printed) and judge each round against the oracle (soak/runner.py). seed: the workload's
        (default: the test's seed); rounds: how many; tie_tolerance: a logit margin within which a
        token that is not the oracle's best is a near tie, not damage (default: by the KV's dtype,
        1e-3 in float32, 2e-2 in float16, 6e-2 in bfloat16; 0.5 below float32 where the engine
        declares `routed_experts`); shrink_trials: runs of
        smaller workloads tried to shrink each round that cannot be trusted (0: none); arrivals:
        requests join running batches and are aborted where the engine can serve them (False:
        each round's requests go in `generate` batches). Returns the verdicts
        (`SoakResult.assert_trustworthy()`)."""
        from ..soak.runner import Soak
        from ..soak.workload import Workload, make_workload

        if replay is not None and not isinstance(replay, str):
            raise ArgumentError(f"replay must be the text a soak failure printed (a str); got {replay!r:.60}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ArgumentError(f"seed must be an integer >= 0; got {seed!r}")
        check_request_count(rounds, "rounds")
        if tie_tolerance is not None and (isinstance(tie_tolerance, bool) or not isinstance(tie_tolerance, (int, float))
                                          or not tie_tolerance >= 0):
            raise ArgumentError(f"tie_tolerance must be a number >= 0 (or None: by the KV's dtype); got {tie_tolerance!r}")
        if isinstance(shrink_trials, bool) or not isinstance(shrink_trials, int) or shrink_trials < 0:
            raise ArgumentError(f"shrink_trials must be an integer >= 0; got {shrink_trials!r}")
        if not isinstance(arrivals, bool):
            raise ArgumentError(f"arrivals must be True or False; got {arrivals!r}")
        soak = Soak(self, tie_tolerance=None if tie_tolerance is None else float(tie_tolerance), arrivals=arrivals)
        if replay is not None:
            try:
                workload = Workload.from_text(replay)
            except ValueError as e:
                raise ArgumentError(f"replay {replay!r:.80} is not a workload a soak prints: {e}") from None
            if why := workload.misfit(soak.geometry):
                raise ArgumentError(f"replay {replay!r:.80} does not fit this engine: {why}")
        else:
            workload = make_workload(self.armed[0] if seed is None else seed, rounds, soak.geometry)
        with self._showing_progress(soak.describe):
            result = soak.run(workload, shrink_trials)
        self.soak_results.append(result)
        return result

    # ----------------------------------------------------------------------------- results
    def drain(self) -> None:
        """Move every violation the devices logged into the sides' logs (raise mode raises)."""
        for side in self.sides:
            side.runtime.drain()

    def engine_defects(self) -> list[tuple[str, EngineDefect]]:
        """(side, defect) for the documented engine defects each side's adapter saw since the reset."""
        found = []
        for side in self.sides:
            defects = optional(side.engine, "engine_defects")
            found += [(side.name, d) for d in (defects() if defects is not None else [])]
        return found

    def violations(self) -> list[Violation]:
        self.drain()
        return [v for side in self.sides for v in side.runtime.log.violations]

    def injections(self) -> list[Injection]:
        """The ledger's injections, matched against every sighting: the violations and the repeats
        the logs did not report again (a later injection's damage may look like an earlier one's)."""
        self.ledger.match(self.violations() + [v for side in self.sides for v in side.runtime.log.repeated])
        return list(self.ledger.injections)

    def request_label(self, violation: Violation) -> str | None:
        side = next((s for s in self.sides if s.name == violation.side), None)
        return None if side is None else side.request_label(violation.row, violation.step)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per side, the runtime's counters since the test began (a reset inside it keeps its counts)."""
        found = {}
        for side in self.sides:
            stats = {**asdict(side.runtime.stats()), "device": str(side.runtime.device)}
            for name, n in self._kept_counts.get(side.name, {}).items():
                stats[name] += n
            found[side.name] = stats
        return found

    def healthy(self) -> bool:
        return all(not side.runtime.health_problems() for side in self.sides)

    def close(self) -> None:
        for side in self.sides:
            side.close()
