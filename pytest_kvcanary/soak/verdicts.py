"""What a soak found: one verdict per round, from the outputs checked against the oracle and the
violations the canary logged in that round (no torch).

    clean                  outputs right, no violation
    engine defect          outputs right; every violation is at a slot a documented defect of the
                           engine wrote (EngineDefect, reported by its adapter): the canary was right
    damage detected        an output is wrong and the canary reported something
    damage missed          an output is wrong and the canary reported nothing: a blind spot
    suspected false alarm  the canary reported something and every output is right

Violations the fault ledger matches to a fault the test injected (kv_perturb) are the test's own:
they do not make a round a suspected false alarm, and they are what detected the damage their
faults did to an output.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

CLEAN = "clean"
ENGINE_DEFECT = "engine defect"
DETECTED = "damage detected"
MISSED = "damage missed"
FALSE_ALARM = "suspected false alarm"
VERDICTS = (CLEAN, ENGINE_DEFECT, DETECTED, MISSED, FALSE_ALARM)
UNTRUSTWORTHY = (MISSED, FALSE_ALARM)


@dataclass(frozen=True)
class Damage:
    """A wrong output token: request (its index in the round), token (its index in the output),
    the token the engine produced and the one the oracle expected there."""

    request: int
    token: int
    got: int
    expected: int


def scored_damage(output: Sequence[int], best: Sequence[int], runner_up: Sequence[int], margin: Sequence[float],
                  tie_tolerance: float) -> tuple[int | None, int]:
    """(the first output token greedy decoding without cached KV would not have produced, or None;
    how many tokens were the runner-up of a near tie: within tie_tolerance of the best, which
    numerical noise alone can decide). Each token is judged after the engine's own earlier tokens."""
    ties = 0
    for j, token in enumerate(output):
        if token == best[j]:
            continue
        if token == runner_up[j] and margin[j] <= tie_tolerance:
            ties += 1
            continue
        return j, ties
    return None, ties


def exact_damage(output: Sequence[int], expected: Sequence[int]) -> int | None:
    """The first token where output differs from the oracle's own generation (a prefix of it when
    the request was aborted), or None."""
    for j, token in enumerate(output):
        if j >= len(expected) or token != expected[j]:
            return j
    return None


@dataclass
class RoundResult:
    """One round: forwards (summed over the engine's sides), unexplained (violations neither an
    injected fault nor an engine defect explains) and the first of them described (violations),
    injected (violations the ledger matched to injected faults), engine_defects (violations a
    documented engine defect explains, by the defect's name), damage (each wrong output's first
    wrong token), near_ties (tokens that were the runner-up of a near tie: an oracle limit, not
    damage)."""

    index: int
    requests: int
    forwards: int
    verdict: str
    unexplained: int = 0
    violations: list[str] = field(default_factory=list)
    injected: int = 0
    engine_defects: dict[str, int] = field(default_factory=dict)
    damage: list[Damage] = field(default_factory=list)
    near_ties: int = 0


def verdict_of(damaged: bool, unexplained: int, engine_defects: int = 0, injected: int = 0) -> str:
    """The verdict from whether an output is wrong and the violations the round logged: those
    nothing explains, those a documented engine defect does, and those of injected faults."""
    if damaged:
        return DETECTED if unexplained or engine_defects or injected else MISSED
    if unexplained:
        return FALSE_ALARM
    return ENGINE_DEFECT if engine_defects else CLEAN


@dataclass
class Failure:
    """A round whose verdict cannot be trusted, with the replay of the smallest workload found
    that still ends in that verdict (reproduced: whether it did after a reset at all)."""

    round: int
    verdict: str
    replay: str
    requests: int
    reproduced: bool


@dataclass
class SoakResult:
    """Every round of one soak on one engine handle, and the failures shrunk to a replay."""

    seed: int
    workload: str  # the whole workload's text (Workload.to_text)
    rounds: list[RoundResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    oracle: str = ""  # how outputs were checked
    timing: str = ""  # what a replay needs of the engine besides its workload ("jitter seed 3"), "" for none

    @property
    def forwards(self) -> int:
        return sum(r.forwards for r in self.rounds)

    def counts(self) -> dict[str, int]:
        """Rounds per verdict, every verdict named."""
        found = Counter(r.verdict for r in self.rounds)
        return {v: found[v] for v in VERDICTS}

    @property
    def trustworthy(self) -> bool:
        return not any(r.verdict in UNTRUSTWORTHY for r in self.rounds)

    def engine_defects(self) -> dict[str, int]:
        """Violations explained by each documented engine defect, over every round."""
        found: Counter[str] = Counter()
        for r in self.rounds:
            found.update(r.engine_defects)
        return dict(found)

    def summary(self) -> str:
        counts = ", ".join(f"{n} {v}" for v, n in self.counts().items() if n)
        ties = sum(r.near_ties for r in self.rounds)
        notes = [f"{ties} near-tie token(s) not counted as damage"] if ties else []
        notes += [f"{n} violation(s) of the engine defect '{name}'" for name, n in self.engine_defects().items()]
        return (f"soak seed {self.seed}: {len(self.rounds)} rounds, {self.forwards} forwards: {counts or 'no rounds'}"
                + "".join(f"; {note}" for note in notes) + f" (oracle: {self.oracle})")

    def describe_failures(self) -> list[str]:
        lines = []
        for f in self.failures:
            rnd = self.rounds[f.round]
            what = (f"damage {', '.join(f'request {d.request} token {d.token}: {d.got} != {d.expected}' for d in rnd.damage[:3])}"
                    if rnd.damage else f"violations {'; '.join(rnd.violations[:3])}")
            again = "" if f.reproduced else " (did not reproduce after a reset: the replay is the whole workload)"
            lines.append(f"round {f.round}: {f.verdict}: {what}{again}")
            on = f", on an engine of {self.timing}" if self.timing else ""
            lines.append(f"  replay ({f.requests} requests{on}): run_workload(replay={f.replay!r})")
        return lines

    def failure_message(self) -> str:
        """The verdict counts and every untrustworthy round, each failure with its replay."""
        bad = [r for r in self.rounds if r.verdict in UNTRUSTWORTHY]
        return "\n".join([
            f"the soak found {len(bad)} round(s) it cannot trust: {self.summary()}", *self.describe_failures(),
            *(f"round {r.index}: {r.verdict}" for r in bad if r.index not in {f.round for f in self.failures})])

    def assert_trustworthy(self) -> None:
        """Fail on any round with missed damage or a suspected false alarm (`failure_message`)."""
        __tracebackhide__ = True
        if not self.trustworthy:
            raise AssertionError(self.failure_message())

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "oracle": self.oracle, "timing": self.timing, "rounds": len(self.rounds),
                "forwards": self.forwards,
                "verdicts": self.counts(), "near_ties": sum(r.near_ties for r in self.rounds),
                "engine_defects": self.engine_defects(),
                "failures": [asdict(f) for f in self.failures],
                "untrusted_rounds": [asdict(r) for r in self.rounds if r.verdict in UNTRUSTWORTHY],
                "workload": self.workload}
