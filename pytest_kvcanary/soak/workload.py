"""Seeded workloads shaped like traffic, and their one-line text form (the replay of a failure).

A workload is rounds of requests; the engine keeps its cache from one round to the next. Each
request is a recipe: part of a shared "system prompt" (a stem), then a random tail drawn from its
own seed, how many tokens to generate, the wave it arrives in, its context key, when it is
aborted and when it is paused. Prompts are token ids, so lengths are exact (whole pages, one token either side of them).
Pure Python: no torch.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Iterator

STEMS = 6  # shared system prompts per workload
TOKENS = 256  # prompt token ids are drawn from [1, min(vocab, TOKENS)): valid in any vocabulary


@dataclass(frozen=True)
class Geometry:
    """What a workload is shaped to: the engine's page size (1 for a per-token table), its sliding
    window (None: none), the FULL pool's slots, the longest request (prompt plus new tokens) and
    batch; contexts: it takes context keys; serves: requests can join running batches and be
    aborted (EngineUnderTest.serve)."""

    page_size: int
    window: int | None
    capacity: int
    max_context: int
    max_batch: int
    contexts: bool
    serves: bool
    vocab: int = TOKENS


@dataclass(frozen=True)
class Recipe:
    """One request. stem: index of the workload's shared prompt it starts with (-1: none), of
    which stem_len tokens; then tail_len random tokens drawn from seed `tail`. wave: it arrives
    with the round's wave of that number; abort_after: forwards after its arrival at which it is
    aborted (None: never); pause: (after, length), forwards after its arrival at which it is paused
    and for how many forwards (None: never; Arrival.pause)."""

    stem: int
    stem_len: int
    tail: int
    tail_len: int
    max_new_tokens: int
    wave: int = 0
    context: int = 0
    abort_after: int | None = None
    pause: tuple[int, int] | None = None

    @property
    def prompt_len(self) -> int:
        return self.stem_len + self.tail_len


@dataclass(frozen=True)
class Round:
    """Requests served together; gaps[i]: forwards between wave i and wave i + 1."""

    requests: tuple[Recipe, ...]
    gaps: tuple[int, ...] = ()


@dataclass(frozen=True)
class Workload:
    """The rounds of one seed; stems are drawn from the seed for the engine's geometry."""

    seed: int
    rounds: tuple[Round, ...]

    def prompt(self, recipe: Recipe, vocab: int = TOKENS) -> list[int]:
        """The recipe's prompt token ids."""
        high = min(vocab, TOKENS)
        stem = _tokens(self.seed * 1_000_003 + recipe.stem, recipe.stem_len, high) if recipe.stem >= 0 else []
        return stem + _tokens(recipe.tail, recipe.tail_len, high)

    @property
    def size(self) -> int:
        return sum(len(r.requests) for r in self.rounds)

    def to_text(self) -> str:
        """One line: `seed/round/round...`, a round `gaps:request;request`, a request
        `stem.stem_len+tail.tail_len*max_new@wave[~context][!abort_after][^pause_after.pause_length]`."""
        return "/".join([str(self.seed), *(_round_text(r) for r in self.rounds)])

    @classmethod
    def from_text(cls, text: str) -> Workload:
        """The workload `to_text` wrote; ValueError naming the part it cannot read, or the round,
        request and field that no workload has (a stem past the workload's STEMS, a wave the round
        does not have, an empty prompt, no new tokens)."""
        seed, *rounds = text.strip().split("/")
        if not seed.isdigit():
            raise ValueError(f"a workload's text starts with its seed (digits); got {seed!r}")
        workload = cls(int(seed), tuple(_parse_round(r) for r in rounds))
        for i, r in enumerate(workload.rounds):
            _check_round(i, r)
        return workload

    def misfit(self, geometry: Geometry) -> str | None:
        """Why an engine of this geometry cannot run the workload (a request longer than its
        longest), naming the round, the request and its fields; None when it can."""
        for i, r in enumerate(self.rounds):
            for j, q in enumerate(r.requests):
                if q.prompt_len + q.max_new_tokens > geometry.max_context:
                    return (f"round {i}, request {j}: stem_len + tail_len + max_new ({q.stem_len} + {q.tail_len} + "
                            f"{q.max_new_tokens}) exceeds the engine's longest request ({geometry.max_context} tokens)")
        return None


def _tokens(seed: int, n: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, high) for _ in range(n)]


_REQUEST = re.compile(r"(-?\d+)\.(\d+)\+(\d+)\.(\d+)\*(\d+)@(\d+)(?:~(\d+))?(?:!(\d+))?(?:\^(\d+)\.(\d+))?")


def _round_text(r: Round) -> str:
    def one(q: Recipe) -> str:
        text = f"{q.stem}.{q.stem_len}+{q.tail}.{q.tail_len}*{q.max_new_tokens}@{q.wave}"
        text += (f"~{q.context}" if q.context else "") + (f"!{q.abort_after}" if q.abort_after is not None else "")
        return text + (f"^{q.pause[0]}.{q.pause[1]}" if q.pause is not None else "")

    return ",".join(map(str, r.gaps)) + ":" + ";".join(map(one, r.requests))


def _check_round(index: int, r: Round) -> None:
    if not r.requests:
        raise ValueError(f"round {index} has no requests")
    waves = len(r.gaps) + 1
    for j, q in enumerate(r.requests):
        where = f"round {index}, request {j}"
        if not -1 <= q.stem < STEMS:
            raise ValueError(f"{where}: stem must be -1 (none) or one of the workload's {STEMS} stems, 0 to "
                             f"{STEMS - 1}; got {q.stem}")
        if q.stem == -1 and q.stem_len:
            raise ValueError(f"{where}: stem_len must be 0 without a stem (stem -1); got {q.stem_len}")
        if q.prompt_len < 1:
            raise ValueError(f"{where}: stem_len + tail_len must be >= 1 (a prompt); got 0")
        if q.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new must be >= 1; got 0")
        if q.wave >= waves:
            raise ValueError(f"{where}: wave must be one of the round's {waves} wave(s), 0 to {waves - 1} (one more "
                             f"than its gaps); got {q.wave}")


def _parse_round(text: str) -> Round:
    gaps, sep, requests = text.partition(":")
    if not sep:
        raise ValueError(f"a round reads 'gaps:request;request...'; got {text!r}")
    recipes = []
    for part in filter(None, requests.split(";")):
        m = _REQUEST.fullmatch(part)
        if m is None:
            raise ValueError("a request reads 'stem.stem_len+tail.tail_len*max_new@wave[~context][!abort]"
                             f"[^pause_after.pause_length]'; got {part!r}")
        stem, stem_len, tail, tail_len, new, wave, context, abort, pause_after, pause_length = m.groups()
        recipes.append(Recipe(int(stem), int(stem_len), int(tail), int(tail_len), int(new), int(wave),
                              int(context or 0), None if abort is None else int(abort),
                              None if pause_after is None else (int(pause_after), int(pause_length))))
    return Round(tuple(recipes), tuple(int(g) for g in gaps.split(",") if g))


# ------------------------------------------------------------------------------------ making

class _Maker:
    """Draws the requests of one workload: every kind of reuse a KV cache meets in traffic."""

    def __init__(self, seed: int, geometry: Geometry) -> None:
        self.rng = random.Random(seed)
        self.g = geometry
        self.seen: list[Recipe] = []  # earlier rounds' requests, for A -> B -> A reuse
        page, longest = geometry.page_size, geometry.max_context
        # Stems of whole pages and a token either side of them, of several lengths, and past the window.
        lengths = [n * k + d for n in {page, 16} if n > 1 for k in (1, 2, 3) for d in (-1, 0, 1)]
        if geometry.window is not None:
            lengths += [geometry.window + 1, 2 * geometry.window + 3]
        self.stem_lens = sorted({n for n in lengths if n <= longest // 2}) or [max(1, longest // 4)]

    def budget(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length may ask for."""
        return self.g.max_context - prompt_len

    def fresh(self, pressure: bool) -> Recipe:
        g, rng = self.g, self.rng
        stem = rng.randrange(STEMS) if rng.random() < 0.8 else -1
        stem_len = rng.choice(self.stem_lens) if stem >= 0 else 0
        if rng.random() < 0.25:  # exactly k pages, or one token either side
            page = g.page_size if g.page_size > 1 else 16
            total = max(stem_len + 1, page * rng.randrange(1, 4) + rng.choice((-1, 0, 1)))
            tail_len = total - stem_len
        else:
            tail_len = rng.randrange(1, 41)
        if pressure:
            tail_len += rng.randrange(g.max_context // 4, g.max_context // 2)
        tail_len = max(1, min(tail_len, g.max_context - 2 - stem_len))
        room = self.budget(stem_len + tail_len)
        if rng.random() < 0.15:
            new = 1
        elif g.window is not None and rng.random() < 0.2:  # decode past the window
            new = g.window + rng.randrange(1, 9)
        elif pressure:  # long decodes: running requests outgrow the pool, so the scheduler preempts
            new = rng.randrange(1, g.max_context // 4 + 1)
        else:
            new = rng.randrange(1, 41)
        context = rng.choice((1, 2)) if g.contexts and rng.random() < 0.3 else 0
        return Recipe(stem, stem_len, rng.randrange(1 << 20), tail_len, max(1, min(new, room)), context=context)

    def round(self, kind: str) -> Round:
        """A round of this kind: "plain", "pressure" (more than the pool holds), "burst" (earlier
        requests again, then at the next forward a pressure wave that evicts while their prefixes
        load back), "abort storm" (half the round aborted at one forward) or "pauses" (a third of
        the round paused at one forward for 1 to 4 forwards, a pressure wave arriving meanwhile)."""
        if kind == "burst":
            return self._burst()
        pressure = kind in ("pressure", "pauses")
        g, rng = self.g, self.rng
        n = rng.randrange(2, max(3, g.max_batch + g.max_batch // 2) + 1)
        if pressure:  # more than the pool holds, so the cache evicts and the scheduler retracts
            n = max(n, 2 * g.max_batch)
        requests: list[Recipe] = []
        while len(requests) < n:
            roll = rng.random()
            if requests and roll < 0.15:  # an exact duplicate inside the batch
                requests.append(rng.choice(requests))
            elif self.seen and roll < 0.3:  # a request of an earlier round again (A -> B -> A)
                requests.append(rng.choice(self.seen))
            else:
                requests.append(self.fresh(pressure))
        waves = rng.randrange(1, 4) if g.serves else 1
        gaps = tuple(rng.randrange(1, 7) for _ in range(waves - 1))
        placed = []
        for q in requests:
            abort = rng.randrange(1, 7) if g.serves and rng.random() < 0.05 else None
            placed.append(replace(q, wave=rng.randrange(waves), abort_after=abort))
        if kind == "abort storm":  # a wave of clients gone at once: half the round, one forward
            wave, after = rng.randrange(waves), rng.randrange(1, 4)
            storm = set(rng.sample(range(len(placed)), len(placed) // 2))
            placed = [replace(q, wave=wave, abort_after=after) if j in storm else q for j, q in enumerate(placed)]
        if kind == "pauses":  # clients that stop reading for a while, mid-decode, while others keep arriving
            after, length = rng.randrange(1, 4), rng.randrange(1, 5)
            paused = set(rng.sample(range(len(placed)), max(1, len(placed) // 3)))
            placed = [replace(q, wave=0, abort_after=None, pause=(after, length)) if j in paused else q
                      for j, q in enumerate(placed)]
        self.seen += requests
        return Round(tuple(placed), gaps)

    def _burst(self) -> Round:
        g, rng = self.g, self.rng
        again = [rng.choice(self.seen) if self.seen else self.fresh(False) for _ in range(max(1, g.max_batch // 2))]
        burst = [self.fresh(True) for _ in range(2 * g.max_batch)]
        self.seen += again + burst
        return Round(tuple([replace(q, wave=0, abort_after=None) for q in again]
                           + [replace(q, wave=1, abort_after=None) for q in burst]), (1,))


def make_workload(seed: int, rounds: int, geometry: Geometry) -> Workload:
    """`rounds` rounds drawn from `seed`: shared system prompts with random tails, exact
    duplicates inside a round and across rounds (A -> B -> A after eviction), prompts of exactly
    k pages and k pages +- 1, prompts and decodes past the window, single-token outputs, waves
    joining a running batch and aborts (engines that serve), context keys (engines that take
    them), and every third round more than the pool holds. On engines that serve, every sixth of
    those is a burst (earlier requests again, a pressure wave one forward later), every sixth
    round from the fourth an abort storm, and every sixth from the fifth a round of pauses (a third
    of its requests paused mid-decode while a pressure wave arrives)."""
    maker = _Maker(seed, geometry)
    return Workload(seed, tuple(maker.round(_kind(i, geometry.serves)) for i in range(rounds)))


def _kind(i: int, serves: bool) -> str:
    if serves and i % 6 == 5:
        return "burst"
    if serves and i % 6 == 3:
        return "abort storm"
    if serves and i % 6 == 4:
        return "pauses"
    return "pressure" if i % 3 == 2 else "plain"


def subsets(workload: Workload) -> Iterator[Workload]:
    """Smaller workloads to try when shrinking a failure that shows in the last round: fewer
    rounds before it, fewer requests, shorter prompts and outputs (largest cuts first)."""
    rounds = workload.rounds
    for keep in (1, 2, 4, 8):
        if keep < len(rounds):
            yield replace(workload, rounds=rounds[-keep:])
    for i in reversed(range(len(rounds))):
        requests = rounds[i].requests
        for size in (len(requests) // 2, 1):
            for start in range(0, len(requests), max(size, 1)):
                kept = requests[:start] + requests[start + size:]
                if size and kept and len(kept) < len(requests):
                    yield _with_round(workload, i, replace(rounds[i], requests=kept))
    for i in reversed(range(len(rounds))):
        for j, q in enumerate(rounds[i].requests):
            for smaller in (replace(q, tail_len=max(1, q.tail_len // 2)), replace(q, stem=-1, stem_len=0),
                            replace(q, max_new_tokens=max(1, q.max_new_tokens // 2)),
                            replace(q, abort_after=None), replace(q, pause=None), replace(q, wave=0),
                            replace(q, context=0)):
                if smaller != q:
                    requests = rounds[i].requests
                    yield _with_round(workload, i, replace(rounds[i], requests=requests[:j] + (smaller,) + requests[j + 1:]))


def _with_round(workload: Workload, i: int, r: Round) -> Workload:
    return replace(workload, rounds=workload.rounds[:i] + (r,) + workload.rounds[i + 1:])
