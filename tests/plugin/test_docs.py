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

from pytest_kvcanary.handles.factories import ENGINE_OPTIONS, INSTALL, install_hint
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


# ------------------------------------------------------------------ the docs against the code

def _row(page: Path, start: str) -> str:
    """The table row of `page` whose first cell starts with `start`."""
    rows = [line for line in page.read_text().splitlines() if line.startswith(f"| `{start}")]
    assert len(rows) == 1, f"{_name(page)}: {len(rows)} rows start with {start!r}"
    return rows[0]


def _bullet(page: Path, start: str) -> str:
    """The list item of `page` that starts with `start`, its lines joined."""
    text = page.read_text()
    at = text.index(f"- `{start}")
    end = re.search(r"\n(?=- |\n)", text[at + 1:])
    return " ".join(text[at:at + 1 + (end.start() if end else len(text))].split())


@pytest.mark.parametrize("method", ["violations", "assert_no_violation", "assert_violation"])
def test_the_assertion_signatures_in_the_docs_are_the_code(method: str) -> None:
    """Every filter an assertion takes is in the README's table and in writing-tests.md."""
    import inspect

    from pytest_kvcanary.assertions import KvCanary

    wanted = [name for name in inspect.signature(getattr(KvCanary, method)).parameters if name != "self"]
    for page, text in ((ROOT / "README.md", _row(ROOT / "README.md", f"{method}(").split("|")[1]),
                       (ROOT / "docs" / "writing-tests.md", _bullet(ROOT / "docs" / "writing-tests.md", f"{method}("))):
        signature = text[text.index("(") + 1:text.index(")")]
        shown = [part.strip().split("=")[0] for part in signature.split(",") if part.strip() != "*"]
        assert shown == wanted, f"{_name(page)}: {method}({', '.join(shown)}) where the code takes {wanted}"


def test_every_canary_setting_is_in_the_kv_canary_marker_docs() -> None:
    from dataclasses import fields

    from pytest_kvcanary.config import CanaryConfig

    for text in (_row(ROOT / "README.md", "kv_canary(**overrides)"),
                 _bullet(ROOT / "docs" / "writing-tests.md", "kv_canary(**overrides)")):
        missing = [f.name for f in fields(CanaryConfig) if f"`{f.name}`" not in text]
        assert not missing, f"the kv_canary marker's docs lack {missing}"


def test_the_kv_perturb_signature_and_modes_in_the_docs_are_the_code() -> None:
    """The signature the marker registers (`pytest --markers`) is the one the docs show, and every
    mode has its row in writing-tests.md's fault table and its words in the README."""
    from pytest_kvcanary.config import PERTURB_MODES
    from pytest_kvcanary.plugin_support.markers import MARKER_LINES

    registered = next(line for line in MARKER_LINES if line.startswith("kv_perturb(")).split(":")[0]
    readme = _row(ROOT / "README.md", "kv_perturb(")
    guide = _bullet(ROOT / "docs" / "writing-tests.md", "kv_perturb(")
    assert f"`{registered}`" in readme and f"`{registered}`" in guide
    table = [line for line in (ROOT / "docs" / "writing-tests.md").read_text().splitlines() if line.startswith("| `")]
    for mode in PERTURB_MODES:
        assert any(line.startswith(f"| `{mode}` |") for line in table), f"writing-tests.md: no fault table row for {mode}"
        assert f"`{mode}`" in readme, f"README.md: kv_perturb row lacks {mode}"


def test_raise_modes_exception_is_named_and_exported() -> None:
    import pytest_kvcanary
    from pytest_kvcanary.canary.log import KvCanaryViolationError

    assert pytest_kvcanary.KvCanaryViolationError is KvCanaryViolationError
    for page in (ROOT / "README.md", ROOT / "docs" / "writing-tests.md"):
        assert "`pytest_kvcanary.KvCanaryViolationError`" in page.read_text(), _name(page)


def test_the_ini_keys_an_empty_value_leaves_unset_are_the_ones_running_md_names() -> None:
    """An empty ini value is "unset" only for options whose default is unset; the others refuse it."""
    accepting = []
    for option in OPTIONS:
        try:
            option.parse("")
        except ValueError:
            continue
        accepting.append(option.name)
    accepting += list(ENGINE_OPTIONS)  # the engines' own options (their plugins'), unset by default
    text = " ".join((ROOT / "docs" / "running.md").read_text().split())
    named = re.search(r"an empty value means unset for the options whose default is unset \(([^)]*)\)", text)
    assert named is not None, "docs/running.md: the sentence on empty ini values"
    assert re.findall(r"`(\w+)`", named.group(1)) == accepting


def test_the_soak_docs_count_the_suites_soaks() -> None:
    """docs/soak.md names the kinds the stock suite soaks, alone and over a prefill/decode pair."""
    import pytest_kvcanary.soak.suite as suite

    def kinds(test: object) -> list[str]:
        return [list(m.args) for m in test.pytestmark if m.name == "kv_attention"][0]

    single, pd = kinds(suite.test_workload_soak), kinds(suite.test_workload_soak_prefill_decode)
    text = " ".join((ROOT / "docs" / "soak.md").read_text().split())
    assert f"one soak per attention kind the engine has ({', '.join(f'`{k}`' for k in single)};" in text
    assert f"one per attention kind ({', '.join(f'`{k}`' for k in pd)}) over its prefill/decode pair" in text
    assert f"{['no', 'one', 'two', 'three', 'four', 'five', 'six', 'seven'][len(single) + len(pd)]} soaks on the reference" in text


def test_the_adapter_reference_names_every_seam_type_member_and_field() -> None:
    """docs/adapters.md is the seam's reference: it names every name the seam exports, has a row
    for each required method and each optional member (with its default), and names every field
    of the types an adapter fills or returns."""
    from dataclasses import fields

    from pytest_kvcanary.canary import seam

    page = ROOT / "docs" / "adapters.md"
    text = page.read_text()
    assert not [name for name in seam.__all__ if f"`{name}" not in text], "names the seam exports"
    for name in seam.REQUIRED_METHODS:
        _row(page, f"{name}(")
    table = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in text.splitlines()
             if line.startswith("| `")]
    for name in seam.OPTIONAL_MEMBERS:  # the optional members' table: member | signature | called by | default
        rows = [cells for cells in table if cells[0] == f"`{name}`" and len(cells) == 4]
        assert len(rows) == 1 and rows[0][3], f"docs/adapters.md: no row for the optional {name} with its default"
    named = {
        seam.PoolGroup: [f.name for f in fields(seam.PoolGroup)],
        seam.SlotMapping: [f.name for f in fields(seam.SlotMapping)],
        seam.ForwardView: [f.name for f in fields(seam.ForwardView)],
        seam.Capacities: [f.name for f in fields(seam.Capacities)],
        seam.Capabilities: [f.name for f in fields(seam.Capabilities)],
        seam.CacheWalk: list(seam.CacheWalk._fields), seam.PagedWalk: list(seam.PagedWalk._fields),
        seam.CheckpointWalk: list(seam.CheckpointWalk._fields), seam.GroupInputs: list(seam.GroupInputs._fields),
        seam.StateInputs: list(seam.StateInputs._fields), seam.HostPool: [f.name for f in fields(seam.HostPool)],
        seam.Arrival: list(seam.Arrival._fields), seam.TokenScores: list(seam.TokenScores._fields),
        seam.EngineDefect: list(seam.EngineDefect._fields),
    }
    missing = {t.__name__: [f for f in names if f"`{f}`" not in text and f"{f}," not in text and f"{f})" not in text]
               for t, names in named.items()}
    assert not {t: m for t, m in missing.items() if m}, "fields docs/adapters.md does not name"
