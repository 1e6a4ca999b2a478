"""The plugin's package may be imported before pytest loads it as a plugin (the outer run of a
pytester test, a program that imports it and then runs pytest), when pytest can no longer rewrite
it, so it opts out of assertion rewriting: no PytestAssertRewriteWarning, which a `-W error` run
would turn into a failure."""

from __future__ import annotations

import sys

import pytest

RUN = "import sys, pytest_kvcanary.plugin, pytest; sys.exit(pytest.main(['-W', 'error', '-p', 'no:cacheprovider']))"


def test_a_run_after_the_package_was_imported_does_not_warn(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_a(): pass")
    result = pytester.run(sys.executable, "-c", RUN)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "PytestAssertRewriteWarning" not in result.stdout.str() + result.stderr.str()
