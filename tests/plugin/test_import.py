"""pytest loads the plugin in every run of the environment: it must stay free of heavy imports."""

from __future__ import annotations

import subprocess
import sys

LIGHT_MODULES = ("plugin", "markers", "assertions", "report", "gpu", "hookspecs", "config")
HEAVY = ("torch", "triton", "kvcanary_kernels", "pytest_kvcanary.engine", "pytest_kvcanary.harness")


def test_plugin_modules_import_without_torch() -> None:
    imports = "; ".join(f"import pytest_kvcanary.{m}" for m in LIGHT_MODULES)
    check = f"heavy = [m for m in {HEAVY!r} if m in sys.modules]; assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", f"import sys; {imports}; {check}"], check=True)


def test_plugin_alone_imports_without_torch() -> None:
    subprocess.run([sys.executable, "-c", "import pytest_kvcanary.plugin, sys; assert 'torch' not in sys.modules"],
                   check=True)


def test_pytest_help_lists_the_options_without_importing_torch() -> None:
    """The installed entry point registers the plugin: `pytest --help` shows its option group,
    and a plain pytest run of the environment never loads torch."""
    code = ("import sys, pytest; rc = pytest.main(['--help']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for flag in ("--kv-canary", "--kv-canary-real-data", "--kv-canary-sweep-interval", "--kv-canary-seed",
                 "--kv-canary-device", "--kv-canary-engine", "--kv-canary-report"):
        assert flag in out
    assert "KV-cache canary" in out
