"""EngineHandle: one engine (side "single") with the canary attached; what kv_engine hands a test."""

from __future__ import annotations

from typing import Callable, Sequence

from ..canary.seam import Arrival, EngineUnderTest, optional
from ..config import CanaryConfig
from .sided import Side, SidedHandle


class EngineHandle(SidedHandle):
    """One engine, side "single"."""

    def __init__(self, engine: EngineUnderTest, canary: CanaryConfig) -> None:
        super().__init__()
        self.side = Side("single", engine, canary, self.ledger)
        self.sides = [self.side]

    @property
    def engine(self) -> EngineUnderTest:
        return self.side.engine

    def _engine_generate(self) -> Callable[..., list[list[int]]]:
        return self.engine.generate

    def _engine_serve(self) -> Callable[[Sequence[Arrival]], list[list[int]]] | None:
        return optional(self.engine, "serve")
