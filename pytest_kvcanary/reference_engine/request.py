"""A generation request and the KV bookkeeping the scheduler and the radix cache keep on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .radix_node import Node


@dataclass(eq=False)
class Request:
    """While running, the request's KV is ``req_to_token[row, :kv_len]``. The first prefix_len of
    those slots belong to the radix cache and are locked through last_node; the rest are the
    request's own. Own positions below swa_from have had their SWA slots freed (slid out of the
    window). A hybrid model's running request holds a state slot (its recurrent state after kv_len
    tokens) and, between a forward that wrote one and its KV's insertion into the radix cache, a
    checkpoint (slot, length); in a speculative decode, rollback_slots (the states after each of
    its proposals but the last, one of which becomes its state when some are rejected; under async
    scheduling those of the decode in flight, then the next one's). Waiting requests hold nothing
    (row -1). context_key: the context the tokens are read
    in (a cache salt or adapter id; 0 = none): KV is shared only between equal contexts. ahead: the
    positions past kv_len that launched forwards write and whose results are not processed yet
    (their slots are in the row already); with async scheduling a decode input at one of them is a
    token the host does not know yet."""

    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    context_key: int = 0
    output_ids: list[int] = field(default_factory=list)
    row: int = -1
    kv_len: int = 0
    prefix_len: int = 0
    swa_from: int = 0
    last_node: Node | None = None
    state_slot: int = 0
    checkpoint: tuple[int, int] | None = None
    rollback_slots: list[int] = field(default_factory=list)
    ahead: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def launched_len(self) -> int:
        """Positions with KV written or being written: where the next forward starts."""
        return self.kv_len + self.ahead

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens

    def extra_states(self, start: int, proposals: int) -> tuple[list[int], list[int]]:
        """The states a hybrid request's forward from position `start` writes besides its running
        one, and their lengths: its checkpoint, or in a decode of `proposals` + 1 positions its
        rollback states (the last `proposals` of rollback_slots, allocated for it)."""
        if self.checkpoint:
            return [self.checkpoint[0]], [self.checkpoint[1]]
        slots = self.rollback_slots[len(self.rollback_slots) - proposals:] if proposals else []
        return slots, [start + j for j in range(1, len(slots) + 1)]
