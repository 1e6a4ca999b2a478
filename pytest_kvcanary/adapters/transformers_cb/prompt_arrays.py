"""PromptArrays: each request's prompt tokens as one int64 array, converted from transformers'
list once, ahead of the forwards that stage them where the host can see them coming.

A prefill forward stages up to max_tokens prompt tokens as token-table entries, and turning them
from the request's list into int64 was most of the host's work before the forward could launch
(the device idles then: transformers synchronises after each forward). ``ahead`` runs right after
a forward is launched, while the device computes it: it converts the prompts of the requests
still to stage some (the batch's, then the scheduler's waiting ones, in its order), at least one
and up to `budget` tokens a call. A prompt not converted ahead is converted when its first entries
are staged. The tokens still come from the request, not from the forward's inputs, which they check.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterable

import numpy as np


class PromptArrays:
    """The prompts (RequestState ``initial_tokens``) of requests whose prompt is not staged whole
    yet, keyed by request id and held for that very state (a request transformers re-creates gets
    its new prompt converted)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held: dict[str, tuple[Any, np.ndarray]] = {}

    def of(self, state: Any) -> np.ndarray:
        """`state`'s prompt as int64 (converted now if it was not ahead)."""
        prompt = self._held_for(state)
        if prompt is None:
            prompt = _converted(state)
            self._held[state.request_id] = (state, prompt)
        return prompt

    def ahead(self, batch: Iterable[Any], waiting: Iterable[Any]) -> None:
        """Convert the prompts of the requests in `batch`, then `waiting`, that still have prompt
        tokens to stage (position_offset short of the prompt), in that order, until `budget` tokens
        were converted; hold only those met on the way (the others were staged whole, finished or
        cancelled, or lie past this call's budget: converted when staged)."""
        kept, converted = {}, 0
        for state in chain(batch, waiting):
            if state.position_offset >= len(state.initial_tokens):
                continue
            prompt = self._held_for(state)
            if prompt is None:
                if converted >= self.budget:
                    break
                prompt = _converted(state)
                converted += len(prompt)
            kept[state.request_id] = (state, prompt)
        self._held = kept

    def _held_for(self, state: Any) -> np.ndarray | None:
        """The prompt held for this very state, if any."""
        held = self._held.get(state.request_id)
        return held[1] if held is not None and held[0] is state else None

    def clear(self) -> None:
        self._held = {}


def _converted(state: Any) -> np.ndarray:
    tokens = state.initial_tokens
    return np.fromiter(tokens, dtype=np.int64, count=len(tokens))
