"""The README's commands are written the way they work."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from pytest_kvcanary.handles.factories import INSTALL, install_hint
from pytest_kvcanary.settings import OPTIONS

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_valued_options_are_written_with_an_equals_sign() -> None:
    """`--kv-canary-report /tmp/r.json` would let pytest read the path as a test path and move
    the rootdir of a project without an ini file: the README writes `--opt=value` everywhere."""
    valued = "|".join(re.escape(o.flag) for o in OPTIONS if o.name != "kv_canary")
    spaced = re.findall(rf"(?:{valued}) [A-Za-z0-9/.~]\S*", README)
    assert not spaced, f"write these as --opt=value: {spaced}"


def test_ci_runs_the_readme_vllm_recipe_and_the_hints_match_the_readme() -> None:
    """`.ci/vllm.sh` runs the command between the README's vllm-recipe markers verbatim; the
    install hints of error messages are the README's commands."""
    root = Path(__file__).parents[2]
    recipe = subprocess.run(["bash", str(root / ".ci" / "vllm.sh"), "--print-recipe"], capture_output=True,
                            text=True, check=True).stdout
    block = README.split("<!-- vllm-recipe -->\n", 1)[1].split("<!-- /vllm-recipe -->", 1)[0]
    assert recipe.splitlines() == [line.removeprefix("    ") for line in block.splitlines()] == [INSTALL["vllm"]]
    for package, command in INSTALL.items():
        assert f"    {command}" in README, package
        assert command in install_hint(package)
