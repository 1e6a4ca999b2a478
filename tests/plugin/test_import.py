"""pytest loads the plugin in every run of the environment, and engine authors import the seam
from their conftest: both must stay free of heavy imports."""

from __future__ import annotations

import subprocess
import sys

LIGHT_MODULES = ("plugin", "settings", "handles.factories", "handles.checkpoints", "handles.pool", "handles.protocol",
                 "plugin_support.markers", "plugin_support.interrupts", "assertions", "report", "gpu", "hookspecs",
                 "config", "canary.seam", "canary.seam_data", "canary.host", "canary.violation", "adapters.spec",
                 "adapters.reference_hooks", "adapters.transformers_hooks", "adapters.vllm_hooks")
# torch, triton, transformers, vLLM, the engines and adapters, the harness, and every kernel module
# but the record layout, the argument checks and the input types.
HEAVY_CHECK = ("heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers', "
               "'vllm') or m.startswith(('pytest_kvcanary.reference_engine.', 'pytest_kvcanary.adapters.transformers_cb', "
               "'pytest_kvcanary.adapters.vllm.engine', 'pytest_kvcanary.handles.sided', "
               "'pytest_kvcanary.handles.single', 'pytest_kvcanary.handles.pd', 'pytest_kvcanary.handles.start')) "
               "or (m.startswith('kvcanary_kernels.') "
               "and m not in ('kvcanary_kernels.records', 'kvcanary_kernels.checks', 'kvcanary_kernels.inputs'))); "
               "assert not heavy, heavy")


def test_plugin_modules_import_without_torch() -> None:
    imports = "; ".join(f"import pytest_kvcanary.{m}" for m in LIGHT_MODULES)
    subprocess.run([sys.executable, "-c", f"import sys; {imports}; {HEAVY_CHECK}"], check=True)


def test_seam_types_an_engine_author_needs_import_without_torch() -> None:
    """Everything an adapter uses comes from the one seam module, without torch or triton."""
    code = ("import sys; from pytest_kvcanary.canary.seam import (GuardedEngine, EngineUnderTest, PrefillDecodePair, "
            "PoolGroup, ForwardView, SlotMapping, Capacities, CacheWalk, PagedWalk, ForwardHooks, FreeListener, "
            "TransferListener, GroupKind, Half, UnsupportedAttention); from kvcanary_kernels.records import Reason, "
            "Phase; "
            + HEAVY_CHECK)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pytest_help_lists_the_options_without_importing_torch() -> None:
    """The installed entry point registers the plugin: `pytest --help` shows its option group,
    and a plain pytest run of the environment never loads torch."""
    code = ("import sys, pytest; rc = pytest.main(['--help']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for flag in ("--kv-canary", "--kv-canary-real-data", "--kv-canary-sweep-interval", "--kv-canary-seed",
                 "--kv-canary-device", "--kv-canary-engine", "--kv-canary-model", "--kv-canary-report",
                 "--kv-canary-workers-per-gpu", "--kv-canary-lock-dir"):
        assert flag in out
    assert "KV-cache canary" in out


def test_the_public_names_come_from_the_package_root_and_load_on_use() -> None:
    """`from pytest_kvcanary import KvCanaryViolationError` works (raise mode's exception, which
    a test may catch); importing the package alone loads none of them."""
    code = ("import sys; import pytest_kvcanary as p; "
            "assert not any(m.startswith(('pytest_kvcanary.canary', 'pytest_kvcanary.handles')) for m in sys.modules); "
            + HEAVY_CHECK + "; "
            "from pytest_kvcanary import KvCanaryViolationError, Violation, KvCanary, CanaryConfig, PerturbSpec, "
            "Handle, ArgumentError, KvMarkerWarning, UnsupportedAttention; "
            "from pytest_kvcanary.canary.log import KvCanaryViolationError as defined; "
            "assert KvCanaryViolationError is defined and issubclass(defined, RuntimeError); "
            "assert sorted(p.__all__) == sorted(['KvCanaryViolationError', 'Violation', 'KvCanary', 'CanaryConfig', "
            "'PerturbSpec', 'Handle', 'ArgumentError', 'KvMarkerWarning', 'UnsupportedAttention']); "
            "assert all(hasattr(p, n) for n in p.__all__)")
    subprocess.run([sys.executable, "-c", code], check=True)
