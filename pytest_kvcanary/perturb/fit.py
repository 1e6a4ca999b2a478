"""Whether a kv_perturb spec fits an engine: one rule for the plugin (before the test runs, as a
marker error, or a skip where the engine lacks what a mode needs) and the fault injector (when it
arms). No torch."""

from __future__ import annotations

from typing import Any, Sequence

from kvcanary_kernels.records import GroupKind

from ..canary.seam import capabilities_of
from ..config import FLIP_MODES, SCALE_MODES, PerturbSpec

# What a slot must be for each mode to damage it (a slot already damaged never is).
TARGETS = {
    "req_to_token": "a mapping entry a forward reads and does not write (a cached prefix, or a decoding "
                    "request's earlier positions) and another live entry to point it at",
    "real_kv_used": "a slot a forward reads (a cached prefix, or a decoding request's earlier positions)",
    "real_kv_unused_cache": "a slot the prefix cache holds and no running request reads (a finished request's "
                            "prompt, while other requests run)",
    "real_kv_post_forward": "a slot a forward writes",
    "state_wrong_restore": "a recurrent state a forward starts from past its first token (a restored checkpoint, or "
                           "a decoding request's state) and another checkpoint, or a free state slot, to restore instead",
    "scale_corrupt": "a scale a forward dequantizes its quantized KV with (every forward of an engine with a scales group)",
    "scale_reset": "a scale a forward dequantizes its quantized KV with that is not 1.0 already",
    "index_stale": "an entry a sparse layer's indexer selected (every forward of an engine with an indexer group) and "
                   "a slot its row does not hold, freed since or another request's, to point it at",
}


def misfit(spec: PerturbSpec, groups: Sequence[GroupKind], *, fingerprints_real_kv: bool, engine: str) -> str | None:
    """Why `spec` cannot run on an engine with these pool `groups`, or None when it can: its
    target_group must be one of the groups (and given when several could take the mode's damage:
    a KV mode's are the groups but SCALES; not for next_token_swap, which is no group's), and a
    mode that flips real KV bytes needs a canary that fingerprints them. engine: how the message names the engine (e.g. "engine 'reference/swa'")."""
    labels = ", ".join(kind.label for kind in groups)
    damageable = [kind for kind in groups if (kind is GroupKind.SCALES) == (spec.mode in SCALE_MODES)
                  and (kind is GroupKind.INDEXER or spec.mode != "index_stale")]
    if spec.target_group is None and len(damageable) > 1 and spec.mode != "next_token_swap":
        allowed = ", ".join(kind.label for kind in damageable)
        return f"target_group is required: {engine} has pool groups {labels}; allowed: {allowed}"
    if spec.target_group is not None and GroupKind.from_label(spec.target_group) not in groups:
        return f"target_group={spec.target_group!r} is not a pool group of {engine}; its groups: {labels}"
    state, indexer = GroupKind.STATE.label, GroupKind.INDEXER.label
    if spec.mode == "index_stale" and spec.target_group != indexer:
        return (f"mode 'index_stale' damages a sparse attention's selection: it needs target_group={indexer!r} (an "
                f"engine with an INDEXER group: attention 'sparse'); got target_group={spec.target_group!r}")
    if spec.mode == "state_wrong_restore" and spec.target_group != state:
        return (f"mode 'state_wrong_restore' damages a recurrent state: it needs target_group={state!r} (an engine "
                f"with a STATE group: attention 'hybrid'); got target_group={spec.target_group!r}")
    scales = GroupKind.SCALES.label
    if (spec.mode in SCALE_MODES) != (spec.target_group == scales) and spec.mode != "next_token_swap":
        if spec.mode in SCALE_MODES:
            return (f"mode {spec.mode!r} damages a dequantization scale: it needs target_group={scales!r} (an engine "
                    f"with a SCALES group: quantized KV); got target_group={spec.target_group!r}")
        return (f"mode {spec.mode!r} damages KV slots; the {scales} group holds dequantization scales: use "
                "'scale_corrupt' or 'scale_reset'")
    if spec.mode == "req_to_token" and spec.target_group == state:
        return (f"mode 'req_to_token' remaps a KV mapping entry; the {state} group has no mapping (its slots come "
                "with each forward): use 'state_wrong_restore'")
    if spec.mode in FLIP_MODES and not fingerprints_real_kv:
        return (f"mode {spec.mode!r} flips real KV bytes, which the canary fingerprints only with real_data "
                "partial or all; got real_data='none'")
    return None


# The capability (a Capabilities field, named as the seam's member that offers it) each mode needs.
NEEDS = {
    "next_token_swap": ("feed_token", "an engine that can feed a forward another token (GuardedEngine.feed_token)"),
    "real_kv_host": ("host_tier", "an engine with a host-memory tier (GuardedEngine.host_tier)"),
    "real_kv_unused_cache": ("cache_walk", "an engine whose prefix cache the sweep can walk (GuardedEngine.cache_walk)"),
}


def lacking(spec: PerturbSpec, engine: Any, name: str, groups: Sequence[Any] = (), max_context: int | None = None
            ) -> str | None:
    """Why engine `name` (an EngineUnderTest) cannot run `spec`'s mode at all, or None: a mode
    that needs a capability the engine does not declare (`Capabilities`, read through
    `capabilities_of`), or req_to_token on a block table where a request's whole context fits in
    one block (groups: the engine's PoolGroups, max_context: its Capacities'; no mapping entry is
    then read without being written). A test asking for it skips with this reason."""
    caps = capabilities_of(engine)
    if spec.mode in NEEDS:
        field, what = NEEDS[spec.mode]
        if not getattr(caps, field):
            return f"kv_perturb({spec.mode!r}) needs {what}; {name} ({type(engine).__name__}) has none"
    if spec.mode == "req_to_token":
        full = next((g for g in groups if g.kind is GroupKind.FULL), None)
        page = full.mapping.page_size if full is not None else 1
        if page > 1 and max_context is not None and max_context <= page:
            return (f"kv_perturb('req_to_token') needs a mapping entry a forward reads and does not write; {name} "
                    f"({type(engine).__name__}) maps each request through one block of page_size={page} "
                    f">= max_context={max_context}, so every entry a forward reads it also writes")
    return None


def target(spec: PerturbSpec, groups: Sequence[GroupKind]) -> GroupKind:
    """The pool group a fitting spec damages (next_token_swap without one: the first)."""
    return groups[0] if spec.target_group is None else GroupKind.from_label(spec.target_group)
