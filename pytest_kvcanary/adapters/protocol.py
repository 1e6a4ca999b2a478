"""What the harness needs from an engine under test, beyond the CanaryHost seam, and from a
prefill/decode pair of them (no torch at import)."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from ..canary.host import CanaryHost, ForwardHooks, TransferListener


class UnsupportedAttention(LookupError):
    """An engine factory raises it for an attention kind its engine lacks (transformers has no
    latent pool for mla); tests of that kind skip with this message, which names the engine."""


@runtime_checkable
class EngineUnderTest(CanaryHost, Protocol):
    """An engine the kv fixtures can drive. `pytest_kvcanary_make_engine` returns one.

    set_forward_hooks: the engine calls the hooks around each forward in the order the seam
    states (canary/host.py): before_forward(view) once the batch's slots are mapped and before
    the forward reads KV, kv_stored(...) at its KV-store point if it offers write-through,
    after_forward(view) once the forward wrote its K/V, end_forward() outside any CUDA graph
    (None detaches). generate: greedy output ids per prompt (a sequence of prompts, never one
    bare string), running until every request is done; an engine with per-request contexts
    also takes context_keys=[one int per prompt] (0 = none). reset: drop every request and
    flush the prefix cache.
    Optional: add_free_listener(listener) — listener(group, slots, cause) on every free — lets
    the fault ledger say why an injected fault was never read; request_at(row, step) — the
    (request id, prompt text) that held mapping row `row` at forward `step` since the last reset,
    or None — lets a failure report name the request beside the row; prefix_caching — False
    where the engine runs without a prefix cache (absent means it has one) — lets a test expect
    reuse only where it can happen.
    """

    def set_forward_hooks(self, hooks: ForwardHooks | None) -> None: ...

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    def reset(self) -> None: ...


@runtime_checkable
class PrefillDecodePair(Protocol):
    """Two engines of one model with a KV transfer between them: what kv_pd drives.
    `pytest_kvcanary_make_pd_pair` returns one; the reference pair is engine/pd.py's PDPair.

    prefill / decode: the two EngineUnderTest. generate: greedy output ids per prompt (and
    context_keys, as for EngineUnderTest.generate); each prompt is prefilled on `prefill`, its KV
    transferred, and decoded on `decode`.
    add_transfer_listener: the listener hears every transfer (the harness moves the canary
    records of the transferred slots with the KV there, so the decode side's first read
    re-verifies the whole transferred prefix).
    """

    prefill: EngineUnderTest
    decode: EngineUnderTest

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    def add_transfer_listener(self, listener: TransferListener) -> None: ...
