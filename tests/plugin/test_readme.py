"""The README's commands are written the way they work."""

from __future__ import annotations

import re
from pathlib import Path

from pytest_kvcanary.settings import OPTIONS

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_valued_options_are_written_with_an_equals_sign() -> None:
    """`--kv-canary-report /tmp/r.json` would let pytest read the path as a test path and move
    the rootdir of a project without an ini file: the README writes `--opt=value` everywhere."""
    valued = "|".join(re.escape(o.flag) for o in OPTIONS if o.name != "kv_canary")
    spaced = re.findall(rf"(?:{valued}) [A-Za-z0-9/.~]\S*", README)
    assert not spaced, f"write these as --opt=value: {spaced}"
