"""The kv_canary fixture: assertions over an engine handle's violation log and fault ledger.

Every failure message carries the table of violations (with the request each row held, where the
engine can tell) and the ledger of injected faults, so a failed assertion says what the canary
saw and what happened to each fault, not just "no". Names (reason, phase, group, side, half) are
checked against the allowed values and matched case-insensitively.

A test that reads the log through this fixture owns its violations: the plugin does not list them
again as unexpected (`consulted`), and does not print the tables a second time under a failure
that an assertion here raised (`raised`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import fields
from typing import Any, Protocol, Sequence

from kvcanary_kernels.checks import check_int
from kvcanary_kernels.records import Half, Phase, Reason

from .canary.violation import Violation
from .config import TARGET_GROUPS, PerturbSpec
from .perturb.fit import TARGETS
from .report import ledger_table, violations_table

REASONS = tuple(r.label for r in Reason)
PHASES = tuple(p.name for p in Phase)
HALVES = tuple(h.name for h in Half)

DEDUP_HINT = (
    "the radix cache dedups identical prompts of one batch and frees the duplicates' slots before "
    "anything reads them, so a fault placed on a duplicate can escape every check; send distinct "
    "prompts (send_parallel_requests(n, distinct_prompts=True))"
)


def _name(argument: str, value: str | None, allowed: Sequence[str]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in (a.lower() for a in allowed):
        raise ValueError(f"{argument} must be one of {', '.join(allowed)}; got {value!r}")
    return value.lower()


def _matches(v: Violation, reason: str | None, attrs: dict[str, str | None]) -> bool:
    if reason is not None and reason not in (r.lower() for r in v.reasons):
        return False
    return all(want is None or getattr(v, attr).lower() == want for attr, want in attrs.items())


def _fault(injection: Any) -> str:
    i = injection
    rank = "" if getattr(i, "rank", None) is None else f" rank {i.rank}"
    return f"{i.mode} on {i.side}{rank} {i.group} slot {i.slot} at step {i.step}" + (f": {i.cause}" if i.cause else "")


def _marker(spec: PerturbSpec) -> str:
    """The kv_perturb marker that asks for `spec`, its defaults left out."""
    given = [f"{f.name}={getattr(spec, f.name)!r}" for f in fields(spec)[1:] if getattr(spec, f.name) != f.default]
    return f"kv_perturb({', '.join([repr(spec.mode), *given])})"


def _none_injected(perturbs: Sequence[PerturbSpec], forwards: dict[str, int]) -> str:
    """Why no fault was injected: per marker, what kept it off. forwards: per side since the reset."""
    if not perturbs:
        return "the test has no kv_perturb marker"
    reasons = []
    for spec in perturbs:
        ran = {side: n for side, n in forwards.items() if spec.side in (None, side)}
        after_warmup = sum(max(0, n - spec.warmup_steps) for n in ran.values())
        if not after_warmup:
            shown = ", ".join(f"{n} on {side}" for side, n in ran.items()) if len(ran) > 1 or spec.side else None
            reasons.append(f"{_marker(spec)}: its warm-up of {spec.warmup_steps} forwards outlasted the test's "
                           + (f"forwards ({shown})" if shown else f"{sum(ran.values())} forwards"))
        else:
            drawn = "" if spec.prob == 1 else f"its probability ({spec.prob}) kept it off, or "
            reasons.append(f"{_marker(spec)}: {drawn}no slot qualified in any of the {after_warmup} forwards after "
                           f"its warm-up; it needs {TARGETS[spec.mode]}")
    return "; ".join(reasons)


def _describe_filters(**filters: Any) -> str:
    given = [f"{k}={v}" for k, v in filters.items() if v is not None]
    return f" ({', '.join(given)})" if given else ""


class HandleReadout(Protocol):
    """What the assertions read from an engine handle, since the test's reset (the handles'
    `Handle` protocol, handles/protocol.py, extends it): its violations, the request each one's row
    held (request_label: "req <id> '<prompt start>'", or None where the engine cannot tell), the
    fault ledger's injections, per side the canary's counters and health (stats), and the prompts
    it was given."""

    def violations(self) -> list[Violation]: ...

    def request_label(self, violation: Violation) -> str | None: ...

    def injections(self) -> list[Any]: ...

    def stats(self) -> dict[str, dict[str, Any]]: ...

    def prompts_since_reset(self) -> list[str]: ...


class KvCanary:
    """Assertions over one engine handle for the current test. `sides`: the sides the handle
    has, ("single",) or ("prefill", "decode"); perturbs: the faults the test's kv_perturb markers
    ask for; ranks: how many ranks its engine has (a parallel engine's violations each name theirs;
    `rank=` filters on it, rank 0 matching those of an engine of one rank)."""

    def __init__(self, handle: HandleReadout, sides: tuple[str, ...], perturbs: Sequence[PerturbSpec] = (),
                 ranks: int = 1) -> None:
        self._handle = handle
        self._sides = sides
        self._perturbs = tuple(perturbs)
        self._ranks = ranks
        self.consulted = False
        self.raised: AssertionError | None = None

    def _rank(self, rank: int | None) -> int | None:
        if rank is not None:
            check_int("rank", rank, 0)
            if rank >= self._ranks:
                raise ValueError(f"rank must be a rank of the test's engine, 0 to {self._ranks - 1}; got {rank}")
        return rank

    def _context(self) -> str:
        found = self._handle.violations()
        requests = [self._handle.request_label(v) for v in found]
        return f"{violations_table(found, requests)}\n{ledger_table(self._handle.injections())}"

    def _fail(self, message: str) -> AssertionError:
        """The error to raise for a message that ends with the tables, remembered so the plugin
        knows the failure shows them."""
        self.raised = AssertionError(message)
        return self.raised

    def violations(self, reason: str | None = None, *, phase: str | None = None, group: str | None = None,
                   side: str | None = None, half: str | None = None, rank: int | None = None) -> list[Violation]:
        """Violations since the test's reset that match every filter given (a violation matches a
        reason when any of its reasons is that one)."""
        rank = self._rank(rank)
        attrs = {
            "phase": _name("phase", phase, PHASES),
            "group": _name("group", group, TARGET_GROUPS),
            "side": _name("side", side, self._sides),
            "half": _name("half", half, HALVES),
        }
        wanted = _name("reason", reason, REASONS)
        self.consulted = True
        return [v for v in self._handle.violations()
                if _matches(v, wanted, attrs) and rank in (None, v.rank or 0)]

    def perturbations(self) -> list[Any]:
        """The fault ledger since the test's reset: one entry per injected fault."""
        self.consulted = True
        return self._handle.injections()

    def written_slots(self, side: str | None = None) -> int:
        """KV slots the canary stamped since the test's reset (on `side`, when given): one per
        token an engine computed and wrote, none for a token whose KV a cached prefix supplied (a
        parallel engine writes each token's shard on every rank: counted once, the most any of a
        side's ranks stamped)."""
        _name("side", side, self._sides)
        stamped: dict[str, int] = {}
        for name, stats in self._handle.stats().items():
            owner = stats.get("side", name)
            stamped[owner] = max(stamped.get(owner, 0), stats["protected_tokens"])
        return sum(n for owner, n in stamped.items() if side in (None, owner))

    def assert_no_violation(self, side: str | None = None, *, rank: int | None = None) -> None:
        """Fail when any violation was logged (on `side` and `rank`, when given)."""
        __tracebackhide__ = True
        found = self.violations(side=side, rank=rank)
        if found:
            raise self._fail(f"expected no violation{_describe_filters(side=side, rank=rank)}, found {len(found)}\n"
                             + self._context())

    def assert_violation(self, reason: str, *, phase: str | None = None, group: str | None = None,
                         side: str | None = None, rank: int | None = None, within_steps: int | None = None,
                         require_distinct_prompts: bool = False) -> list[Violation]:
        """Fail unless a violation with this reason (and phase / group / side / rank) was logged;
        return the matching ones. within_steps=N: only violations of the first N forwards after the
        test's reset count (step < N). require_distinct_prompts: fail at once when a prompt was
        sent twice since the reset, since radix dedup can let the fault escape."""
        __tracebackhide__ = True
        if reason is None:  # violations(None) means any reason; an assertion names the one it expects
            raise ValueError(f"reason must be one of {', '.join(REASONS)}; got None (any violation at all: "
                             "assert kv_canary.violations())")
        if within_steps is not None:
            check_int("within_steps", within_steps, 1)
        found = self.violations(reason, phase=phase, group=group, side=side, rank=rank)
        repeated = sorted(p for p, n in Counter(self._handle.prompts_since_reset()).items() if n > 1)
        if require_distinct_prompts and repeated:
            raise AssertionError(f"{len(repeated)} prompt(s) were sent more than once since the reset, e.g. "
                                 f"{repeated[0]!r}: {DEDUP_HINT}")
        found = [v for v in found if within_steps is None or v.step < within_steps]
        if found:
            return found
        lines = [f"expected a {reason} violation"
                 f"{_describe_filters(phase=phase, group=group, side=side, rank=rank, within_steps=within_steps)}, "
                 "found none"]
        escaped = [i for i in self._handle.injections() if i.status == "escaped"]
        lines += [f"escaped: {_fault(i)}" for i in escaped]
        if escaped and repeated:
            lines.append(f"hint: {DEDUP_HINT}")
        raise self._fail("\n".join(lines) + "\n" + self._context())

    def assert_perturbations_detected(self) -> None:
        """Fail unless at least one fault was injected and every injected fault was detected;
        the message lists the others with their status and cause."""
        __tracebackhide__ = True
        injections = self.perturbations()
        if not injections:
            forwards = {side: stats["forwards"] for side, stats in self._handle.stats().items()}
            raise self._fail(f"no fault was injected since the reset: {_none_injected(self._perturbs, forwards)}\n"
                             + self._context())
        missed = [i for i in injections if i.status != "detected"]
        if missed:
            lines = [f"{len(missed)} of {len(injections)} injected faults were not detected"]
            lines += [f"{i.status}: {_fault(i)}" for i in missed]
            raise self._fail("\n".join(lines) + "\n" + self._context())
