"""The engine's own defects the adapter names (transformers 5.17, layout_block_manager.py): a forward
that writes a block transformers has hashed, whose content other requests may read or adopt."""

from __future__ import annotations

from typing import Any, Container, Sequence

from ...canary.seam import EngineDefect, GroupKind
from .versions import DEFECT_CACHED_BLOCK_REWRITE, DEFECT_SHARED_DECODE_BLOCK, BlockManagerLayout, SectorLayout


class HashedBlockWrites:
    """The slots each forward writes in hashed FULL blocks (``defects``, since the last clear), and
    the requests that may write one (``writers``): seen writing one, or marked with a hashed block
    at or past their next write."""

    def __init__(self, layout: SectorLayout | BlockManagerLayout, page_size: int) -> None:
        self.layout, self.page_size = layout, page_size
        self.writers: set[str] = set()  # request ids
        self.defects: list[EngineDefect] = []

    def marked(self, request_id: str, blocks: Sequence[int], length: int, hashed: Container[int]) -> None:
        """transformers hashed the request's completed blocks (`blocks`: its FULL block table;
        `length`: its tokens so far; the last one's KV is written by the next forward)."""
        next_write = max(length - 1, 0)
        if self.layout.writes_hashed_blocks and any(b in hashed for b in blocks[next_write // self.page_size:]):
            self.writers.add(request_id)

    def note(self, batch: list[Any], step: int, *, every_row: bool) -> None:
        """The slots forward `step` writes in hashed blocks, noted as the engine's defect: a prompt's
        token rewritten into a cached block (DEFECT_CACHED_BLOCK_REWRITE), a generated token into a
        block hashed before it was full (DEFECT_SHARED_DECODE_BLOCK). batch: its
        FutureRequestStates; every_row: look at every row (another batch, or rows of more than one
        token); else (a decode step of the same batch) only at the `writers`."""
        if not every_row and not self.writers:
            return
        rows = batch if every_row else [f for f in batch if f.state.request_id in self.writers]
        full, page, hashed = self.layout.groups[0], self.page_size, self.layout.hashed_ids()
        slots: dict[str, list[int]] = {DEFECT_CACHED_BLOCK_REWRITE: [], DEFECT_SHARED_DECODE_BLOCK: []}
        for future in rows:
            state = future.state
            end = state.position_offset
            start = end - future.query_length
            prompt = len(state.initial_tokens)
            blocks = self.layout.block_ids(full, state.request_id)
            wrote = False
            for index in range(start // page, min(-(-end // page), len(blocks))):
                if blocks[index] in hashed:
                    wrote = True
                    for p in range(max(start, index * page), min(end, (index + 1) * page)):
                        defect = DEFECT_CACHED_BLOCK_REWRITE if p < prompt else DEFECT_SHARED_DECODE_BLOCK
                        slots[defect].append(blocks[index] * page + p % page)
            if wrote:
                self.writers.add(state.request_id)
            else:
                self.writers.discard(state.request_id)
        self.defects += [EngineDefect(step, GroupKind.FULL, tuple(s), name) for name, s in slots.items() if s]

    def clear(self) -> None:
        self.writers.clear()
        self.defects.clear()
