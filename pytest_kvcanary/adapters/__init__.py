"""The engines the project ships behind the canary seam, and how each is built by name.

Each built-in engine is a pytest plugin of its own (reference_hooks, transformers_hooks,
vllm_hooks), an ordinary implementation of the `pytest_kvcanary_make_engine` hook that the
plugin registers as a conftest or a third-party plugin registers one; it imports its engine only
when asked for one, and registers its own options. `EngineSpec` (spec.py) is what every engine is
built from. reference: the reference engine sized for tests; transformers_cb, vllm: the adapters
of those engines (their packages are optional extras), each recording every patch it installs on
its engine's objects in a `Patches` (patches.py) that its ``close()`` undoes.
"""

from __future__ import annotations

from .spec import EngineSpec

__all__ = ["EngineSpec"]
