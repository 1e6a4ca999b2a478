"""The soak's part of the seam: what the engine members the workload soak uses take and return
(`EngineUnderTest.serve`, `score_uncached`, `engine_defects` in canary/seam.py, which re-exports
these; import them from there).

It imports nothing of the plugin, the canary runtime or torch (only the record layout's
`GroupKind`), so the seam can import it: the one soak module beneath the seam.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from kvcanary_kernels.records import GroupKind

__all__ = ["Arrival", "EngineDefect", "TokenScores"]


class Arrival(NamedTuple):
    """One request of `EngineUnderTest.serve`: its prompt token ids and max_new_tokens; at_forward:
    it is submitted once the serve call has run that many forwards (at once when the engine has
    nothing left to run before); context_key: its context (0 = none); abort_after: forwards after
    its submission at which it is aborted, keeping the tokens it generated so far (None: it runs
    to the end); pause: (after, length): `after` forwards after its submission, if it is running
    then, it is paused for `length` forwards (it keeps its KV and is not scheduled), then resumed
    (None: never; an engine that cannot pause runs it on)."""

    prompt: Sequence[int]
    max_new_tokens: int
    at_forward: int = 0
    context_key: int = 0
    abort_after: int | None = None
    pause: tuple[int, int] | None = None


class TokenScores(NamedTuple):
    """What greedy decoding picks for one request's output without any cached KV (what
    `EngineUnderTest.score_uncached` returns per request): for output token j, the best next token
    after prompt + output[:j], the runner-up (or the output's own token j where it is not the best
    and the scorer knows its logit), and how far the best's logit is ahead of that token's (a
    difference of log-probabilities is the same number)."""

    best: Sequence[int]
    runner_up: Sequence[int]
    margin: Sequence[float]


class EngineDefect(NamedTuple):
    """A documented defect of the engine itself, seen happening (what
    `EngineUnderTest.engine_defects` lists): at forward `step` (counted from the last reset, as
    violations count them) the engine wrote `slots` of `group`, which it must not have; `name` is
    what the docs call it. A violation at one of those slots in that forward is the defect's, not
    the canary's or the adapter's."""

    step: int
    group: GroupKind
    slots: tuple[int, ...]
    name: str
