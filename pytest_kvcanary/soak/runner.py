"""The differential workload soak: drive an engine handle with a workload, check every output
against an oracle (the same engine without prefix reuse), give each round a verdict, and shrink
each untrustworthy round to a small workload that still fails.

The oracle is the engine's `score_uncached` where it has one (each output token judged after the
engine's own earlier tokens; a near tie is an oracle limit, not damage), else each request
generated alone after a reset (outputs compared exactly). Rounds run back to back on one cache; at
the end of each the canary sweeps the cache and its log is drained, so a round owns the violations
logged while it ran.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate
from typing import Any, Protocol, Sequence

from ..canary.seam import Arrival, EngineDefect, GroupKind, TokenScores, capabilities_of, optional
from .verdicts import (UNTRUSTWORTHY, Damage, Failure, RoundResult, SoakResult, exact_damage, scored_damage,
                       verdict_of)
from .workload import Geometry, Round, Workload, subsets


class SoakedHandle(Protocol):
    """What the soak drives: an engine handle (handles/sided.py) with its sides (each an engine, its
    canary runtime and name), the seed and faults of its last reset (`armed`), and its log."""

    sides: Sequence[Any]
    armed: tuple[int, tuple[Any, ...]]

    def reset(self, seed: int, perturbs: tuple[Any, ...], *, keep_counts: bool = False) -> None: ...
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **contexts: Any) -> list[list[int]]: ...
    def serve(self, arrivals: Sequence[Arrival]) -> list[list[int]]: ...
    def serves(self) -> bool: ...
    def takes_context_keys(self) -> bool: ...
    def violations(self) -> list[Any]: ...
    def injections(self) -> list[Any]: ...
    def engine_defects(self) -> list[tuple[str, EngineDefect]]: ...

SHRUNK_FAILURES = 2  # failures shrunk per soak (the others keep the whole workload as their replay)
# The default near-tie margin by the KV's dtype: two computations of one logit (prefill and decode,
# or another batch) differ by rounding, about 1e-5 in float32 and 1e-2 in bfloat16 on small models.
TIE_TOLERANCES = {"torch.float32": 1e-3, "torch.float16": 2e-2, "torch.bfloat16": 6e-2}
COARSE_TIE_TOLERANCE = 0.25  # any other dtype (8-bit floats)
# A model that routes tokens to experts, below float32: a decode and its recomputation add up in
# different orders, and at a router's near tie that noise sends a token to another expert, which
# moves a logit by far more than rounding: vLLM's random Qwen3-Next (bfloat16) moved a logit gap by up
# to 0.24 so (docs/soak.md, the oracle's limits).
ROUTED_TIE_TOLERANCE = 0.5
KEPT_VIOLATIONS = 50  # violations described per round


def default_tie_tolerance(dtype: str, routed_experts: bool) -> float:
    """The near-tie margin of a soak given none, for an engine whose FULL pool's K has this dtype
    (`str` of a torch dtype): TIE_TOLERANCES (COARSE_TIE_TOLERANCE for a dtype it lacks), and at
    least ROUTED_TIE_TOLERANCE where the model routes tokens to experts and the dtype is not
    float32."""
    tolerance = TIE_TOLERANCES.get(dtype, COARSE_TIE_TOLERANCE)
    return max(tolerance, ROUTED_TIE_TOLERANCE) if routed_experts and dtype != "torch.float32" else tolerance


def geometry(handle: SoakedHandle, arrivals: bool = True) -> Geometry:
    """The workload shape the handle's (first) engine takes (arrivals False: no request joins a
    running batch, even where the engine could serve it). The longest request also fits every
    pool alone (an engine may hold a whole request in each; its first page is reserved)."""
    runtime = handle.sides[0].runtime
    groups = runtime.readout().kv_groups
    full = groups[0]
    page = full.page_size
    window = next((g.window for g in groups if g.kind is GroupKind.SWA), None)
    caps = runtime.capacities
    longest = min([caps.max_context] + [(g.num_slots // page - 1) * page + 1 for g in groups])
    return Geometry(page_size=page, window=window, capacity=full.num_slots - 1, max_context=longest,
                    max_batch=caps.max_batch, contexts=handle.takes_context_keys(), serves=arrivals and handle.serves())


def timing(handle: SoakedHandle) -> str:
    """What a replay needs of the engine besides its workload: the seed each side whose engine draws
    its timings from one (the reference engine's `jitter`) was given, as "jitter seed 3" (a pair's
    sides named where they differ); "" for none."""
    seeds = [(side.name, getattr(getattr(side.engine, "jitter", None), "seed", None)) for side in handle.sides]
    if {seed for _, seed in seeds} == {None}:
        return ""
    if len({seed for _, seed in seeds}) == 1:
        return f"jitter seed {seeds[0][1]}"
    return ", ".join(f"{name} jitter seed {'none' if seed is None else seed}" for name, seed in seeds)


class Soak:
    """Runs workloads on one handle; `describe()` says where it is (a progress line reads it)."""

    def __init__(self, handle: SoakedHandle, *, tie_tolerance: float | None = None, arrivals: bool = True) -> None:
        """tie_tolerance None: `default_tie_tolerance` of the engine's FULL pool and its
        `routed_experts`."""
        self.handle = handle
        self.geometry = geometry(handle, arrivals)
        if tie_tolerance is None:
            dtype = str(handle.sides[0].runtime.readout().group(GroupKind.FULL).dtype)
            tie_tolerance = default_tie_tolerance(dtype, bool(optional(handle.sides[0].engine, "routed_experts")))
        self.tie_tolerance = tie_tolerance
        self.engine = handle.sides[0].engine  # the oracle's engine (a PD pair's prefill side)
        self.score = optional(self.engine, "score_uncached")
        self._doing = "starting"
        self._done: list[RoundResult] = []
        self._round_start: int | None = None  # the forwards count when the running round began

    def describe(self) -> str:
        """Where the soak is: its round, the forwards so far (the running round's included) and
        the verdicts of the rounds done."""
        verdicts = Counter(r.verdict for r in self._done)
        counts = ", ".join(f"{n} {v}" for v, n in verdicts.items())
        running = 0 if self._round_start is None else self._forwards() - self._round_start
        forwards = sum(r.forwards for r in self._done) + running
        return f"soak {self._doing}, {forwards} forwards" + (f": {counts}" if counts else "")

    @property
    def oracle(self) -> str:
        """How outputs are checked, and what that proves on this engine."""
        if self.score is not None:
            return ("score_uncached (greedy without cached KV, near ties within "
                    f"{self.tie_tolerance:g} not damage)")
        return "each request generated alone after a reset, compared exactly: " + self.alone_proves()

    def alone_proves(self) -> str:
        """What the default oracle (each request run alone on a flushed engine) can prove here:
        that an output does not depend on what else shared the engine, which only means something
        where requests share forwards (concurrent) or reuse cached KV (prefix_cache)."""
        caps = capabilities_of(self.engine)
        shared = [name for name in ("concurrent", "prefix_cache") if getattr(caps, name)]
        if shared:
            return (f"proves outputs do not depend on what else ran ({' and '.join(shared)}); not that a "
                    "request computed alone is right (offer score_uncached for that)")
        return ("proves nothing on this engine beyond repeatability: it runs each request alone without a "
                "prefix cache (concurrent=False, prefix_cache=False), so the oracle repeats the very run; "
                "the canary's checks are the soak's evidence (offer score_uncached for an oracle that "
                "recomputes without cached KV)")

    # ------------------------------------------------------------------------------- running
    def run(self, workload: Workload, shrink_trials: int) -> SoakResult:
        """Every round of the workload from the handle's current state, then each untrustworthy
        round shrunk with up to shrink_trials runs (up to SHRUNK_FAILURES of them; the handle is
        reset for that)."""
        result = SoakResult(workload.seed, workload.to_text(), oracle=self.oracle, timing=timing(self.handle))
        result.rounds = self._rounds(workload, report=True)
        self._done = result.rounds
        for rnd in [r for r in result.rounds if r.verdict in UNTRUSTWORTHY]:
            prefix = Workload(workload.seed, workload.rounds[:rnd.index + 1])
            if shrink_trials and len(result.failures) < SHRUNK_FAILURES:
                result.failures.append(self._shrink(prefix, rnd.verdict, rnd.index, shrink_trials))
            else:
                result.failures.append(Failure(rnd.index, rnd.verdict, prefix.to_text(), prefix.size, reproduced=True))
        return result

    def _rounds(self, workload: Workload, report: bool = False) -> list[RoundResult]:
        results: list[RoundResult] = []
        pending: list[tuple[RoundResult, list[list[int]], list[list[int]], Round]] = []
        if report:
            self._done = results
        for index, rnd in enumerate(workload.rounds):
            if report:
                self._doing = f"round {index + 1}/{len(workload.rounds)}"
            seen = len(self.handle.violations())
            forwards = self._forwards()
            if report:
                self._round_start = forwards
            prompts = [workload.prompt(q, self.geometry.vocab) for q in rnd.requests]
            outputs = self._serve(rnd, prompts)
            scores = self._scores(rnd, prompts, outputs) if self.score is not None else None
            for side in self.handle.sides:  # what the round (and the oracle's forwards) left cached
                side.runtime.sweep()
            result = RoundResult(index, len(prompts), self._forwards() - forwards, verdict="")
            self._judge_violations(result, self.handle.violations()[seen:])
            if scores is not None:
                self._judge_scored(result, outputs, scores)
            else:
                pending.append((result, prompts, outputs, rnd))
            results.append(result)
            self._round_start = None
        for result, prompts, outputs, rnd in pending:  # the oracle that needs the cache flushed
            self._judge_alone(result, rnd, prompts, outputs)
        if pending:
            self.handle.reset(*self.handle.armed, keep_counts=True)
        return results

    def _forwards(self) -> int:
        return sum(side.runtime.forwards for side in self.handle.sides)

    def _serve(self, rnd: Round, prompts: list[list[int]]) -> list[list[int]]:
        contexts = [q.context for q in rnd.requests]
        if self.geometry.serves:
            starts = [0, *accumulate(rnd.gaps)]
            return self.handle.serve([Arrival(p, q.max_new_tokens, starts[q.wave], q.context, q.abort_after, q.pause)
                                      for p, q in zip(prompts, rnd.requests)])
        outputs: list[list[int]] = [[] for _ in prompts]
        groups: dict[int, list[int]] = {}
        for i, q in enumerate(rnd.requests):
            groups.setdefault(q.max_new_tokens, []).append(i)
        for new, members in groups.items():
            keys = {"context_keys": [contexts[i] for i in members]} if self.geometry.contexts else {}
            for i, out in zip(members, self.handle.generate([prompts[i] for i in members], new, **keys)):
                outputs[i] = out
        return outputs

    # ------------------------------------------------------------------------------ judging
    def _judge_violations(self, result: RoundResult, violations: Sequence[Any]) -> None:
        """Sort the round's violations: a fault the test injected, a documented engine defect
        (at a slot the engine wrote wrongly in that forward), or unexplained."""
        injections = self.handle.injections() if violations else []
        own = [v for v in violations if not any(i.matches(v) for i in injections)]
        result.injected = len(violations) - len(own)
        defects = {(side, d.step, d.group.name, slot): d.name
                   for side, d in (self.handle.engine_defects() if own else []) for slot in d.slots}
        unexplained = []
        for v in own:
            name = defects.get((v.side, v.step, v.group, v.slot))
            if name is None:
                unexplained.append(v)
            else:
                result.engine_defects[name] = result.engine_defects.get(name, 0) + 1
        result.unexplained = len(unexplained)
        result.violations = [v.describe() for v in unexplained[:KEPT_VIOLATIONS]]

    def _verdict(self, result: RoundResult) -> str:
        return verdict_of(bool(result.damage), result.unexplained, sum(result.engine_defects.values()), result.injected)

    def _scores(self, rnd: Round, prompts: list[list[int]], outputs: list[list[int]]) -> list[TokenScores]:
        """The oracle's scores of the round's outputs (an engine may run forwards for them)."""
        keys = {"context_keys": [q.context for q in rnd.requests]} if self.geometry.contexts else {}
        return self.score(list(zip(prompts, outputs)), **keys)

    def _judge_scored(self, result: RoundResult, outputs: list[list[int]], scores: list[TokenScores]) -> None:
        for i, (out, s) in enumerate(zip(outputs, scores, strict=True)):
            wrong, ties = scored_damage(out, s.best, s.runner_up, s.margin, self.tie_tolerance)
            result.near_ties += ties
            if wrong is not None:
                result.damage.append(Damage(i, wrong, out[wrong], s.best[wrong]))
        result.verdict = self._verdict(result)

    def _judge_alone(self, result: RoundResult, rnd: Round, prompts: list[list[int]],
                     outputs: list[list[int]]) -> None:
        """Each request generated alone on a flushed engine, without the canary."""
        engine, hooks = self.engine, self.handle.sides[0].runtime
        engine.set_forward_hooks(None)
        try:
            for i, (prompt, out, q) in enumerate(zip(prompts, outputs, rnd.requests)):
                if not out:
                    continue
                engine.reset()
                keys = {"context_keys": [q.context]} if self.geometry.contexts else {}
                expected = engine.generate([prompt], len(out), **keys)[0]
                wrong = exact_damage(out, expected)
                if wrong is not None:
                    result.damage.append(Damage(i, wrong, out[wrong], expected[wrong] if wrong < len(expected) else -1))
        finally:
            engine.set_forward_hooks(hooks)
        result.verdict = self._verdict(result)

    # ---------------------------------------------------------------------------- shrinking
    def _fails(self, workload: Workload, verdict: str) -> bool:
        """Whether the workload, run from a reset, ends in a round of this verdict."""
        self.handle.reset(*self.handle.armed, keep_counts=True)
        return self._rounds(workload)[-1].verdict == verdict

    def _shrink(self, workload: Workload, verdict: str, index: int, trials_left: int) -> Failure:
        """The smallest workload found (greedily, in at most trials_left runs) that still ends in
        `verdict`; the handle is reset after."""
        self._doing = f"shrinking round {index} ({verdict})"
        try:
            if not self._fails(workload, verdict):
                return Failure(index, verdict, workload.to_text(), workload.size, reproduced=False)
            trials = 1
            smaller = True
            while smaller and trials < trials_left:
                smaller = False
                for candidate in subsets(workload):
                    trials += 1
                    if self._fails(candidate, verdict):
                        workload, smaller = candidate, True
                        break
                    if trials >= trials_left:
                        break
            return Failure(index, verdict, workload.to_text(), workload.size, reproduced=True)
        finally:
            self.handle.reset(*self.handle.armed, keep_counts=True)
