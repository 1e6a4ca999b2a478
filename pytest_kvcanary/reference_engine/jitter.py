"""Seeded timing jitter at the reference engine's asynchronous points (`EngineConfig.jitter_seed`):
lifetime races shaken on purpose, reproducibly.

On a CPU the engine's copies are synchronous and its prefill/decode pair transfers in order, so a
bug that needs a copy to finish late, or a transfer to overtake another, never shows. With a seed,
the engine draws, at each point, a choice a real engine's timing could make:
- a finished load-back from the host tier is acknowledged 0 to `MAX_DELAY` acknowledgements late
  (its path stays locked that long; the next ones may be acknowledged before it);
- a pair's transfers wait 0 to `MAX_DELAY` decode steps while the decode side has work, and a
  waiting prefilled request other than the first may move first.
Each choice comes from `random.Random(seed)` in the order the engine asks, restarted by the
engine's reset: a workload replayed after a reset meets the same choices. Off (seed None), every
choice is the engine's natural one and nothing is drawn.
"""

from __future__ import annotations

import random

MAX_DELAY = 2


class Jitter:
    """The seeded choices of one engine (or pair); seed None: off."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._rng: random.Random | None = None
        self.restart()

    @property
    def on(self) -> bool:
        return self.seed is not None

    def restart(self) -> None:
        """Draw from the seed's first choice again."""
        self._rng = None if self.seed is None else random.Random(self.seed)

    def delay(self) -> int:
        """Steps (or acknowledgements) to wait, 0 to MAX_DELAY; 0 when off."""
        return 0 if self._rng is None else self._rng.randint(0, MAX_DELAY)

    def pick(self, n: int) -> int:
        """Which of n waiting items goes first, 0 when off (n >= 1)."""
        return 0 if self._rng is None else self._rng.randrange(n)
