"""pytest-kvcanary: a pytest plugin that catches KV-cache corruption (the plugin: plugin.py).

The public names a test or a conftest uses are importable from here, each loaded on first use so
that importing the package (every pytest run of the environment does) stays light:
`KvCanaryViolationError` (what raise mode raises, with `.violations`), `Violation`, `KvCanary`
(the kv_canary fixture's assertions), `CanaryConfig`, `PerturbSpec`, `Handle` (what kv_engine and
kv_pd hand a test), `ArgumentError` (a handle call's arguments refused; the engine untouched),
`KvMarkerWarning` and `UnsupportedAttention`.

PYTEST_DONT_REWRITE: the package may be imported before pytest loads it as a plugin (a pytester
test's outer run), when it can no longer be rewritten; its asserts are invariants that need no rewritten messages.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_PUBLIC = {
    "KvCanaryViolationError": "canary.log",
    "Violation": "canary.violation",
    "KvCanary": "assertions",
    "CanaryConfig": "config",
    "PerturbSpec": "config",
    "Handle": "handles.protocol",
    "ArgumentError": "handles.protocol",
    "KvMarkerWarning": "plugin_support.markers",
    "UnsupportedAttention": "canary.seam",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pytest_kvcanary' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
