"""The README and docs/ stay true: every relative link and anchor resolves, every shell block
marked runnable runs, commands are written the way they work, and what CI and the error messages
take from the docs is there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvcanary.handles.factories import INSTALL, install_hint
from pytest_kvcanary.settings import OPTIONS

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(page: Path) -> list[tuple[int, str, str, list[str]]]:
    """Each fenced block: (line number of its fence, language, the line before it, its lines)."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start, language = i, lines[i].strip()[3:].strip()
            i += 1
            while i < len(lines) and not FENCE.match(lines[i]):
                i += 1
            blocks.append((start + 1, language, lines[start - 1] if start else "", lines[start + 1:i]))
        i += 1
    return blocks


def _prose(page: Path) -> list[str]:
    """The page's lines outside fenced and indented code blocks, inline code removed."""
    prose, fenced, previous = [], False, ""
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and not (line.startswith("    ") and (not previous.strip() or previous.startswith("    "))):
            prose.append(re.sub(r"`[^`]*`", "", line))
        previous = line if not fenced else ""
    return prose


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes from the page's headings."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced or not (match := re.match(r"^#{1,6} +(.*?) *#*$", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").lower()).replace(" ", "-")
        found.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
        counts[slug] = counts.get(slug, 0) + 1
    return found


def _links(page: Path) -> list[str]:
    return [target for line in _prose(page) for target in LINK.findall(line)
            if not re.match(r"^[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or ROOT.resolve() not in (resolved, *resolved.parents):
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading makes #{anchor} in {_name(resolved)})")
    assert not broken, f"{_name(page)}: broken links: {broken}"


def test_the_link_check_sees_links_and_anchors() -> None:
    """The reading itself works: the README's links to docs pages and their headings are found."""
    assert "docs/reports.md#the-json-report" in _links(ROOT / "README.md")
    assert {"the-json-report", "counters"} <= _anchors(ROOT / "docs" / "reports.md")
    assert "docs/how-it-works.md" not in _links(ROOT / "docs" / "development.md"), "code is not prose"


def _runnable() -> list[tuple[str, int, str]]:
    return [(_name(page), line, "\n".join(body)) for page in PAGES
            for line, language, before, body in _blocks(page) if before == RUNNABLE]


def test_a_runnable_mark_precedes_a_shell_block() -> None:
    marks = [(_name(page), n) for page in PAGES for n, line in enumerate(page.read_text().splitlines(), 1)
             if line == RUNNABLE]
    blocks = [(_name(page), line - 1) for page in PAGES for line, language, before, _ in _blocks(page)
              if before == RUNNABLE and language in ("bash", "sh")]
    assert marks == blocks, "a runnable mark must sit on the line before a ```bash block"
    assert len(blocks) >= 2, "the docs mark cheap commands runnable"


@pytest.mark.parametrize("page, line, script", _runnable(), ids=[f"{p}:{n}" for p, n, _ in _runnable()])
def test_runnable_commands_run(page: str, line: int, script: str) -> None:
    """From the repository root, with this environment's python and pytest first on the PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"{page}:{line}: {script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _code_lines() -> list[str]:
    return [code for page in PAGES for _, _, _, body in _blocks(page) for code in body]


def test_valued_options_are_written_with_an_equals_sign() -> None:
    """`--kv-canary-report /tmp/r.json` would let pytest read the path as a test path and move
    the rootdir of a project without an ini file: the docs write `--opt=value` everywhere."""
    valued = "|".join(re.escape(o.flag) for o in OPTIONS if o.name != "kv_canary")
    spaced = [found for page in PAGES for found in re.findall(rf"(?:{valued}) [A-Za-z0-9/.~]\S*", page.read_text())]
    assert not spaced, f"write these as --opt=value: {spaced}"


def test_ci_runs_the_documented_vllm_recipe_and_the_hints_match_the_docs() -> None:
    """`.ci/vllm.sh` runs the command between docs/vllm.md's vllm-recipe markers verbatim; the
    install hints of error messages are the docs' commands."""
    recipe = subprocess.run(["bash", str(ROOT / ".ci" / "vllm.sh"), "--print-recipe"], capture_output=True,
                            text=True, check=True).stdout
    page = (ROOT / "docs" / "vllm.md").read_text()
    block = page.split("<!-- vllm-recipe -->\n", 1)[1].split("<!-- /vllm-recipe -->", 1)[0]
    assert recipe.splitlines() == [line for line in block.splitlines() if not FENCE.match(line)] == [INSTALL["vllm"]]
    for package, command in INSTALL.items():
        assert any(line.startswith(command) for line in _code_lines()), package
        assert command in install_hint(package)
