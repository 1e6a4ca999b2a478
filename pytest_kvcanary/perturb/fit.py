"""Whether a kv_perturb spec fits an engine: one rule for the plugin (before the test runs, as a
marker error) and the fault injector (when it arms). No torch."""

from __future__ import annotations

from typing import Sequence

from kvcanary_kernels.records import GroupKind

from ..config import PerturbSpec

# What a slot must be for each mode to damage it (a slot already damaged never is).
TARGETS = {
    "req_to_token": "a mapping entry a forward reads and does not write (a cached prefix, or a decoding "
                    "request's earlier positions) and another live entry to point it at",
    "real_kv_used": "a slot a forward reads (a cached prefix, or a decoding request's earlier positions)",
    "real_kv_unused_cache": "a slot the prefix cache holds and no running request reads (a finished request's "
                            "prompt, while other requests run)",
    "real_kv_post_forward": "a slot a forward writes",
}


def misfit(spec: PerturbSpec, groups: Sequence[GroupKind], *, fingerprints_real_kv: bool, engine: str) -> str | None:
    """Why `spec` cannot run on an engine with these pool `groups`, or None when it can: its
    target_group must be one of the groups (and given when there are several), and a mode that
    flips real KV bytes needs a canary that fingerprints them. engine: how the message names the
    engine (e.g. "engine 'reference/swa'")."""
    labels = ", ".join(kind.label for kind in groups)
    if spec.target_group is None and len(groups) > 1:
        return f"target_group is required: {engine} has pool groups {labels}; allowed: {labels}"
    if spec.target_group is not None and GroupKind.from_label(spec.target_group) not in groups:
        return f"target_group={spec.target_group!r} is not a pool group of {engine}; its groups: {labels}"
    if spec.mode != "req_to_token" and not fingerprints_real_kv:
        return (f"mode {spec.mode!r} flips real KV bytes, which the canary fingerprints only with real_data "
                "partial or all; got real_data='none'")
    return None


def target(spec: PerturbSpec, groups: Sequence[GroupKind]) -> GroupKind:
    """The pool group a fitting spec damages."""
    return groups[0] if spec.target_group is None else GroupKind.from_label(spec.target_group)
