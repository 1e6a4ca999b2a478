"""The engine-handle protocol: what the kv fixtures hand a test, and what the plugin and its engine
pool read from it (no torch); what the kv_canary assertions read is the part assertions.py declares
(`HandleReadout`), which `Handle` extends. `single.EngineHandle` (kv_engine), `pd.PDHandle` (kv_pd)
and test fakes implement it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from kvcanary_kernels.checks import is_int

from ..assertions import HandleReadout

if TYPE_CHECKING:
    from ..config import PerturbSpec


class ArgumentError(ValueError, TypeError):
    """A handle's call refused its arguments before the engine ran: the engine is as it was, so
    the pool keeps it (any other exception retires it). A ValueError and a TypeError alike."""


@runtime_checkable
class Handle(HandleReadout, Protocol):
    """One engine, or a prefill/decode pair, with the canary attached and a fault ledger.

    side_names: ("single",) or ("prefill", "decode"). pool_groups: the engine's pool groups as
    kv_perturb's target_group names them ("full", and "swa" on a hybrid model). unsupported: why
    an engine of the handle cannot run one of these faults at all (the test then skips), or None.
    reset: flush caches, clear log, ledger and counters, restart step numbering, arm `perturbs`
    seeded by `seed`; called before every test. violations / injections / prompts_since_reset:
    since that reset. request_label: "req <id> '<prompt start>'" for the request a violation's
    row held at its step, when the engine can tell (else None). stats: per side, the canary's
    counters since the reset (forwards, protected_tokens, sweeps, violations, rows, dropped) and
    its health ("ok" or the problems). healthy: False once the canary stopped guarding (the
    plugin then replaces the handle). close: detach the canary. Optional: a `progress` attribute
    (a plugin_support.progress.ProgressFactory or None), which the plugin sets before each test
    where a long generation's progress line can be seen.
    """

    side_names: tuple[str, ...]

    def pool_groups(self) -> tuple[str, ...]: ...

    def unsupported(self, perturbs: tuple[PerturbSpec, ...]) -> str | None: ...

    def reset(self, seed: int, perturbs: tuple[PerturbSpec, ...]) -> None: ...

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 8, *,
                 context_keys: Sequence[int] | None = None) -> list[list[int]]: ...

    def send_parallel_requests(self, n: int, *, distinct_prompts: bool = False,
                               max_new_tokens: int = 8) -> list[list[int]]: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


def check_prompts(prompts: Any) -> None:
    """TypeError unless `prompts` is a sequence of prompts: a bare string would run one request
    per character."""
    if isinstance(prompts, (str, bytes)):
        raise ArgumentError(f"prompts must be a sequence of prompts (a list of str or of token-id lists), not one "
                        f"{type(prompts).__name__}; got {prompts!r:.60}: wrap it in a list")
    if not isinstance(prompts, Sequence):
        raise ArgumentError(f"prompts must be a sequence of prompts (a list of str or of token-id lists); got "
                        f"{type(prompts).__name__} {prompts!r:.60}")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            continue
        ids = prompt if isinstance(prompt, Sequence) and not isinstance(prompt, bytes) else None
        if ids is None or not all(is_int(t) for t in ids):
            raise ArgumentError(f"prompts[{i}] must be a str or a list of token ids (ints); got "
                            f"{type(prompt).__name__} {prompt!r:.60}" +
                            (": the token ids of one prompt go in a list of their own, e.g. [[1, 2, 3]]"
                             if isinstance(prompt, int) else ""))


def check_context_keys(context_keys: Any, prompts: Sequence[Any], generate: Any, engine: str) -> None:
    """TypeError unless the engine's `generate` takes context keys and there is one int per prompt."""
    if "context_keys" not in inspect.signature(generate).parameters:
        raise ArgumentError(f"context_keys: engine {engine!r} has no contexts (cache salts or adapter ids); "
                        "leave context_keys out")
    if (not isinstance(context_keys, Sequence) or len(context_keys) != len(prompts)
            or not all(is_int(k) for k in context_keys)):
        raise ArgumentError(f"context_keys must be one int per prompt ({len(prompts)}); got {context_keys!r:.60}")


def check_max_new_tokens(max_new_tokens: Any) -> None:
    """ArgumentError unless max_new_tokens is an integer >= 1."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ArgumentError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r:.60}")


def check_request_count(n: Any, name: str = "n") -> None:
    """TypeError / ValueError unless `n` is an integer >= 1 (`name`: the argument, counting
    requests or rounds)."""
    what = "rounds" if name == "rounds" else "requests"
    if not is_int(n):
        raise ArgumentError(f"{name} must be an integer >= 1 (the number of {what}); got {n!r:.60}")
    if n < 1:
        raise ArgumentError(f"{name} must be an integer >= 1 (the number of {what}); got {n}")
