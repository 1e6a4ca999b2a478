"""Seeded timing jitter at the reference engine's asynchronous points (`EngineConfig.jitter_seed`):
lifetime races shaken on purpose, reproducibly.

On a CPU the engine's copies are synchronous and its prefill/decode pair transfers in order, so a
bug that needs a copy to finish late, or a transfer to overtake another, never shows. With a seed,
the engine draws, at each point, a choice a real engine's timing could make:
- a finished load-back from the host tier is acknowledged 0 to `MAX_DELAY` acknowledgements late
  (its path stays locked that long; the next ones may be acknowledged before it);
- a pair's transfers wait 0 to `MAX_DELAY` decode steps while the decode side has work, and a
  waiting prefilled request other than the first may move first;
- with async scheduling, each launched step's forward runs at launch, once the host has processed
  the step before it, or when the host first waits for its results (async_steps.py's RUN_POINTS).
On a GPU the host tier's copies run on a copy stream of their own, and the device decides when
they finish: with a seed, a spin-wait of 0 to `MAX_SPIN_CYCLES` clock cycles is queued on that
stream ahead of each batch of copies (`spin`), so a copy lands late against the forwards and
acknowledgements around it, as it could under load. A forward on a GPU spins too (`spin_at`), at
four points on its stream: before the canary's HEAD, between HEAD and the model, between the model
and TAIL, and after TAIL; so the forward, and each of the canary's phases, ends late against the
host's frees and schedules, the copy streams and a pair's transfers. A graph decode step captures
its spins with it (the cycles drawn at capture, the same at each replay).
Each choice comes from `random.Random(seed)` in the order the engine asks (the spins from a
generator of their own, so the CPU choices are the same on either device), restarted by the
engine's reset: a workload replayed after a reset meets the same choices. Off (seed None), every
choice is the engine's natural one and nothing is drawn.
"""

from __future__ import annotations

import random
from typing import Sequence, TypeVar

import torch

MAX_DELAY = 2
MAX_SPIN_CYCLES = 2_000_000  # about a millisecond at a GPU's clock
T = TypeVar("T")


class Jitter:
    """The seeded choices of one engine (or pair); seed None: off."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._rng: random.Random | None = None
        self._spins: random.Random | None = None
        self.restart()

    @property
    def on(self) -> bool:
        return self.seed is not None

    def restart(self) -> None:
        """Draw from the seed's first choice again."""
        self._rng = None if self.seed is None else random.Random(self.seed)
        self._spins = None if self.seed is None else random.Random(f"{self.seed}/spin")

    def delay(self) -> int:
        """Steps (or acknowledgements) to wait, 0 to MAX_DELAY; 0 when off."""
        return 0 if self._rng is None else self._rng.randint(0, MAX_DELAY)

    def pick(self, n: int) -> int:
        """Which of n waiting items goes first, 0 when off (n >= 1)."""
        return 0 if self._rng is None else self._rng.randrange(n)

    def choose(self, options: Sequence[T], natural: T) -> T:
        """One of options, drawn from the seed; natural (the engine's own choice) when off."""
        return natural if self._rng is None else options[self._rng.randrange(len(options))]

    def spin(self) -> int:
        """Queue a seeded spin-wait on the current CUDA stream (0 to MAX_SPIN_CYCLES clock cycles,
        0 for a third of the draws); returns the cycles. Nothing when off. Call it only where that
        stream is a CUDA one."""
        if self._spins is None:
            return 0
        cycles = 0 if self._spins.random() < 1 / 3 else self._spins.randrange(1, MAX_SPIN_CYCLES + 1)
        if cycles:
            torch.cuda._sleep(cycles)
        return cycles

    def spin_at(self, device: torch.device) -> int:
        """spin() where the device is a GPU (a forward's spin points); 0, nothing drawn, on a CPU."""
        return self.spin() if device.type == "cuda" else 0
