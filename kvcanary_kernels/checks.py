"""Argument checks shared by the kernels' launchers and the plugin (no torch, no triton)."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int, note: str = "") -> None:
    """ValueError naming `name` unless `value` is an integer >= `minimum`; `note` follows the
    bound in the message (e.g. " (slot 0 is reserved)")."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{note}; got {value!r}")
