"""The soak's oracle on vLLM: score_uncached measures an output token that is not the best against
the best (vLLM reports each prompt token's own log-probability), so a third token tied with the
top two within a bfloat16 rounding step is a near tie, not damage."""

from __future__ import annotations

import pytest

from .support import INSTALL, make_engine

pytest.importorskip("vllm", reason=INSTALL)

PROMPT = [11, 57, 203, 9, 148, 77, 31, 190, 64, 5, 122, 240, 18, 99]


def test_an_output_token_that_is_not_the_best_is_measured_against_the_best():
    engine = make_engine("mha")
    greedy = engine.generate([PROMPT], 6)[0]
    [clean] = engine.score_uncached([(PROMPT, greedy)])
    assert list(clean.best) == greedy, "the oracle agrees with greedy decoding"

    # Token 3 swapped for one that is neither the best nor the runner-up there.
    other = next(t for t in range(1, 256) if t not in (clean.best[3], clean.runner_up[3]))
    output = [*greedy[:3], other, *greedy[4:]]
    [swapped] = engine.score_uncached([(PROMPT, output)])
    assert swapped.best[3] == clean.best[3]
    assert swapped.runner_up[3] == other
    assert swapped.margin[3] >= clean.margin[3], "no token but the best is ahead of the runner-up"
    assert [swapped.runner_up[j] for j in (0, 1, 2)] == [clean.runner_up[j] for j in (0, 1, 2)]


def test_the_last_output_token_is_measured_against_the_best_too():
    """The last token's own log-probability comes from the scoring request's prompt too (vLLM's
    generated-token log-probabilities hold only the top two and the token it picked itself)."""
    engine = make_engine("mha")
    greedy = engine.generate([PROMPT], 6)[0]
    [clean] = engine.score_uncached([(PROMPT, greedy)])
    other = next(t for t in range(1, 256) if t not in (clean.best[-1], clean.runner_up[-1]))
    [swapped] = engine.score_uncached([(PROMPT, [*greedy[:-1], other])])
    assert swapped.best == clean.best
    assert swapped.runner_up[-1] == other and swapped.margin[-1] >= clean.margin[-1]
    first = next(t for t in range(1, 256) if t not in (clean.best[0], clean.runner_up[0]))
    [one] = engine.score_uncached([(PROMPT, [first])])  # a one-token output is all last token
    assert one.best == [clean.best[0]] and one.runner_up == [first]
