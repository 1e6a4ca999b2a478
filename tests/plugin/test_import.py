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
