"""What the harness needs from an engine under test, beyond the CanaryHost seam."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from ..canary.host import CanaryHost, ForwardHooks

@runtime_checkable
class EngineUnderTest(CanaryHost, Protocol):
    """An engine the kv fixtures can drive. `pytest_kvcanary_make_engine` returns one.

    set_forward_hooks: the engine calls hooks.before_forward(view) once the batch's slots are
    mapped and before the forward reads KV, and hooks.after_forward(view) once the forward wrote
    K/V for view.out_cache_loc (None detaches). generate: greedy output ids per prompt, running
    until every request is done. reset: drop every request and flush the radix cache.
    Optional: add_free_listener(listener) — listener(group, FULL slots, cause) on every free — lets
    the fault ledger say why an injected fault was never read.
    """

    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None: ...

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    def reset(self) -> None: ...
