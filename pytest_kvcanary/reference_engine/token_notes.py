"""The engine's token table written a forward at a time, only what changed where it can tell."""

from __future__ import annotations

from typing import Sequence

import torch

from .kv_pool import put_from_host


class TokenNotes:
    """Writes each forward's rows into ``table`` ([rows, max_context] int64 on the engine's
    device): a row holds the tokens the host knows from position 0, and -1 from ``end`` on. The
    tokens of all rows travel in one copy to the device. ``incremental`` (set when nothing else
    writes the table: synchronous scheduling, no draft model): a row last noted for the same
    request, with no more tokens than now, gets only its new positions (its -1 past them already
    stands); otherwise a row is written whole. ``clear`` after the table is reset to -1."""

    def __init__(self, table: torch.Tensor, incremental: bool) -> None:
        self.table, self.incremental = table, incremental
        self._held: dict[int, tuple[object, int]] = {}  # row -> (its request, how many tokens it holds)

    def note(self, rows: Sequence[int], owners: Sequence[object], known: Sequence[list[int]],
             ends: Sequence[int]) -> None:
        """Row rows[i] holds known[i] for owners[i], and -1 from ends[i] (>= len(known[i])) on."""
        at_rows: list[int] = []
        at_positions: list[int] = []
        tokens: list[int] = []
        for row, owner, ids, end in zip(rows, owners, known, ends):
            held = self._held.get(row)
            start = held[1] if self.incremental and held is not None and held[0] is owner and held[1] <= len(ids) else 0
            if not start:
                self.table[row, end:] = -1
            at_rows += [row] * (len(ids) - start)
            at_positions += range(start, len(ids))
            tokens += ids[start:]
            self._held[row] = (owner, len(ids))
        put_from_host(self.table, at_rows, at_positions, tokens)

    def clear(self) -> None:
        self._held.clear()
