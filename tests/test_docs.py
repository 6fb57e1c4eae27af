"""The documentation under docs/ and the README: contract citations resolve (in the code and in the pages), the
README stays short, the options table is complete, every page is in the nav, no page names a path of one
machine or installs dstest from a package index, the modules pages name exist, and the site builds with
``mkdocs build --strict``.

Nothing here imports torch: the options come from ``pytest --help`` and ``dstest --help`` run in
subprocesses, the citations from the source text.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# CI runs `pytest -m cpu`: these tests need nothing but a CPU.
pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONTRACTS = DOCS / "contracts.md"
README_MAX_WORDS = 1200
#: Where code cites contracts. This file is left out: its strings are the extractor's test data.
CITING_DIRS = ("dstest", "impl", "tests", "benchmarks", "ci", ".ci")
CITING_SUFFIXES = {".py", ".sh", ".toml", ".cfg", ".ini", ".md", ""}

# -- contract citations ---------------------------------------------------------------------------------------
# A contract number is a group letter A-G and a number from 1 ("A4", "E13"). Such tokens are common in code
# for other reasons (test ids, -k expressions, "A1, A2, ..., A10" as an example of sort order), so a token
# counts as a citation only in a context that marks it as one:
#   - after a name of the contracts document: "SPEC A4", "SPEC.md A4", "docs/contracts.md A4",
#     "contracts.md#a4", "contract B4", "contracts E9, E10";
#   - as a spec's or deviation's contract: contract="A4", r["contract"] == "A4", Deviation("A6", ...),
#     _crash_is_deviation("A1-A4", ...);
#   - in parentheses, as the whole or the closing item: "(D5, D6)", "(A1-A7)", "(ZeRO-3's layout, D1)";
#   - at the start of a docstring or a comment: '"""F1, E3: ...', "# -- A1-A4: ...", "# A8: ...".
# A list ("D5, D6", "A1-A4", "A6/A7", "B2 and B8") is one citation of each number; a range of one letter
# ("A1-A8") cites every number in it.
_ID = r"[A-G][1-9][0-9]?"
_LIST = rf"{_ID}(?:(?:\s*[,/-]\s*|\s+and\s+){_ID})*"
_END = r"(?![\w.\[])"  # not the start of a longer token ("A1x", "D5.view", "B2[0]")
_CITATION_PATTERNS = [
    re.compile(rf"\b(?:SPEC(?:\.md)?|(?:docs/)?contracts?(?:\.md)?)(?:'s)?:?\s+(?P<ids>{_LIST}){_END}"),
    re.compile(r"\bcontracts\.md#(?P<ids>[a-g][1-9][0-9]?)\b", re.IGNORECASE),
    re.compile(rf"""\bcontract["']?\]?\s*(?:==|=|:)\s*["'](?P<ids>{_ID})["']"""),
    re.compile(rf"""[Dd]eviation\(\s*["'](?P<ids>{_LIST})["']"""),
    re.compile(rf"\((?P<ids>{_LIST}){_END}"),
    re.compile(rf"[,;]\s*(?P<ids>{_LIST})\)"),
    re.compile(rf'"""(?P<ids>{_LIST}){_END}'),
    re.compile(rf"#\s*(?:--\s*)?(?P<ids>{_LIST})(?=[\s:,)]|$)", re.MULTILINE),
]
_ID_RE = re.compile(r"([A-Ga-g])([1-9][0-9]?)")
_RANGE_RE = re.compile(r"([A-G])([1-9][0-9]?)\s*-\s*\1([1-9][0-9]?)")


def cited_contracts(text: str) -> set[str]:
    """The contract numbers ``text`` cites, upper case (see the patterns above)."""
    found: set[str] = set()
    for pattern in _CITATION_PATTERNS:
        for match in pattern.finditer(text):
            ids = match.group("ids")
            found.update(f"{letter.upper()}{number}" for letter, number in _ID_RE.findall(ids))
            for letter, first, last in _RANGE_RE.findall(ids):
                found.update(f"{letter}{n}" for n in range(int(first), int(last) + 1))
    return found


def _citing_files() -> list[Path]:
    files = []
    for top in CITING_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if (
                path.is_file()
                and path.suffix in CITING_SUFFIXES
                and "__pycache__" not in path.parts
                and path.resolve() != Path(__file__).resolve()
            ):
                files.append(path)
    return files


def contract_anchors() -> dict[str, int]:
    """The ``{#x9}`` heading anchors of docs/contracts.md, upper case, with their line numbers."""
    anchors: dict[str, int] = {}
    for lineno, line in enumerate(CONTRACTS.read_text(encoding="utf-8").splitlines(), 1):
        for anchor in re.findall(r"\{#([a-z][0-9]+)\}", line):
            anchors[anchor.upper()] = lineno
    return anchors


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('"""Predicates on optional process groups (SPEC A1-A4).', {"A1", "A2", "A3", "A4"}),
        ("see SPEC.md D5 and docs/contracts.md E9", {"D5", "E9"}),
        ("contracts.md#a4, contracts E9, E10", {"A4", "E9", "E10"}),
        ('@dstest.spec(world_size=[2], contract="B4")', {"B4"}),
        ('rows = [r for r in rows if r["contract"] == "C6"]', {"C6"}),
        ('with _crash_is_deviation("A6", "the loss"):', {"A6"}),
        ("gathers several tensors (D5, D6). A view (ZeRO-3's layout, D1)", {"D1", "D5", "D6"}),
        ('    """F1, E3: the harness\'s verdicts."""', {"F1", "E3"}),
        ("# -- A5-A7: guarded collectives", {"A5", "A6", "A7"}),
        # not citations: sort-order examples, -k expressions, test ids, hex, names
        ('"""SPEC order: A1, A2, ..., A10, B1, ...; specs without a contract last."""', set()),
        ('cli.main(["-k", "A1 or A3"]); keyword="A1"', set()),
        ("test_b2_sum[threaded-ws2] 0xE5 C10_CUDA_CHECK B2x (A1x)", set()),
    ],
)
def test_the_citation_pattern_finds_citations_and_nothing_else(text: str, expected: set[str]) -> None:
    assert cited_contracts(text) == expected


def test_every_contract_the_code_cites_has_a_section_in_docs_contracts() -> None:
    """Each contract number cited in dstest/, impl/, tests/, benchmarks/ or ci/ is a heading anchor of
    docs/contracts.md (``### A4 ... {#a4}``), so ``docs/contracts.md#a4`` resolves."""
    anchors = contract_anchors()
    cited: dict[str, list[str]] = {}
    for path in _citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number in cited_contracts(text):
            cited.setdefault(number, []).append(str(path.relative_to(ROOT)))
    # A pattern that stopped matching would pass vacuously: the code cites contracts of every group.
    assert {n[0] for n in cited} >= set("ABCDEF"), f"citations found only for {sorted(cited)}"
    missing = {n: files for n, files in sorted(cited.items()) if n not in anchors}
    assert not missing, (
        "contracts cited in the code without a section in docs/contracts.md (add a heading "
        "'### X9 ... {#x9}'): " + "; ".join(f"{n} in {', '.join(files[:3])}" for n, files in missing.items())
    )


def test_each_contract_anchor_is_on_the_heading_of_that_contract() -> None:
    """``{#a4}`` ends the heading of A4 and nothing else; no anchor is given twice."""
    seen: dict[str, int] = {}
    for lineno, line in enumerate(CONTRACTS.read_text(encoding="utf-8").splitlines(), 1):
        for anchor in re.findall(r"\{#([a-z][0-9]+)\}", line):
            assert anchor not in seen, f"docs/contracts.md:{lineno}: {{#{anchor}}} is also at line {seen[anchor]}"
            seen[anchor] = lineno
            assert re.match(rf"#{{2,4}} {anchor.upper()}\b.*\{{#{anchor}\}}\s*$", line), (
                f"docs/contracts.md:{lineno}: {{#{anchor}}} must end the heading of {anchor.upper()}: {line!r}"
            )
    assert len(seen) >= 50, f"docs/contracts.md has {len(seen)} contract anchors"


# -- the README -----------------------------------------------------------------------------------------------
def test_the_readme_is_under_1200_words() -> None:
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words < README_MAX_WORDS, (
        f"README.md has {words} words; keep it under {README_MAX_WORDS} and move detail into docs/"
    )


# -- the pages ---------------------------------------------------------------------------------------------------
#: The pages a reader sees: every page of docs/ and the README.
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
#: Pages that keep measurements as they were taken, each with its commit: the module paths they name are those
#: of that commit, not of today's tree.
HISTORICAL_PAGES = {"results.md"}


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered lines of a page, without its fenced code blocks (examples may print anything)."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append((lineno, line))
    return lines


def test_every_code_fence_of_a_page_is_closed() -> None:
    """A fence left open turns the rest of a page into one code block, headings and their anchors included."""
    open_at = {}
    for path in PAGES:
        fence_line = 0
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith(("```", "~~~")):
                fence_line = 0 if fence_line else lineno
        if fence_line:
            open_at[str(path.relative_to(ROOT))] = fence_line
    assert not open_at, f"code fences opened and never closed (page: line): {open_at}"


def test_no_page_names_a_path_of_the_machine_it_was_written_on() -> None:
    """A page tells any reader what to run: no home directory, venv or work tree of one machine."""
    machine_path = re.compile(r"(?<![\w.~$}])/(?:work|home|root|Users|mnt|scratch)/")
    found = [
        f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}"
        for path in PAGES
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if machine_path.search(line)
    ]
    assert not found, "paths of one machine (write a placeholder such as DS_CHECKOUT, or none):\n" + "\n".join(found)


def test_every_contract_a_page_names_has_a_section() -> None:
    """Every token of the form A4 / E13 in a page's prose is a contract with a heading in docs/contracts.md.

    The pages name contracts in plain words ("A1-A5 and A7 pass"), not only as links, so every such token counts.
    """
    anchors = contract_anchors()
    found = {
        f"{path.relative_to(ROOT)}:{lineno}: {token}"
        for path in PAGES
        for lineno, line in _prose_lines(path)
        for token in re.findall(r"\b[A-H][0-9]{1,2}\b", line)
        if token not in anchors
    }
    assert not found, "contracts named without a section in docs/contracts.md:\n" + "\n".join(sorted(found))


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, in order (``- Title: page.md`` or ``- page.md``)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") :]
    return re.findall(r"^\s*-\s+(?:[^:\n]+:\s+)?([\w./-]+\.md)\s*$", nav, re.MULTILINE)


def test_every_page_is_in_the_nav_once_and_every_nav_entry_is_a_page() -> None:
    nav = _nav_pages()
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(set(nav)) == pages, (
        f"in docs/ but not in mkdocs.yml's nav: {sorted(set(pages) - set(nav))}; "
        f"in the nav but not in docs/: {sorted(set(nav) - set(pages))}"
    )
    twice = sorted({n for n in nav if nav.count(n) > 1})
    assert not twice, f"pages listed twice in mkdocs.yml's nav: {twice}"


def test_no_page_installs_dstest_from_a_package_index() -> None:
    """dstest is not on a package index: a page installs it from a checkout or from a wheel built from one."""
    found = []
    for path in PAGES:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for command in re.findall(r"pip install ([^`;&|]*)", line):
                for word in command.split():
                    if re.fullmatch(r"""['"]?dstest(\[[\w,-]+\])?([<>=!~].*)?['"]?""", word):
                        found.append(f"{path.relative_to(ROOT)}:{lineno}: pip install {command.strip()}")
    assert not found, (
        "dstest installed by name, as if it were on an index (use `pip install -e '.[extra]'` in a checkout, "
        "or a wheel built from one):\n" + "\n".join(found)
    )


def test_the_modules_a_page_names_exist() -> None:
    """A module or package of dstest named in a page (``dstest/worlds/core/matching.py``) is where the page
    says, so that pages follow modules that move. (Paths under tests/ or impl/ are not checked: pages also name
    other projects' files, such as DeepSpeed's ``tests/unit/common.py``.)"""
    missing = []
    for path in PAGES:
        if path.name in HISTORICAL_PAGES:
            continue
        for lineno, line in _prose_lines(path):
            for code in re.findall(r"`([^`]+)`", line):
                for name in re.findall(r"(?<![\w./-])(dstest/[\w./*-]*)", code):
                    name = name.rstrip(".")
                    if not list(ROOT.glob(name.rstrip("/"))):
                        missing.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert not missing, "modules named in the pages that are not in the repository:\n" + "\n".join(missing)


# -- options ---------------------------------------------------------------------------------------------------
def _help_text(args: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    # No other plugin is loaded, so the only difference the dstest plugin makes to --help is its own.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["COLUMNS"] = "120"
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _options_and_ini(help_text: str) -> tuple[set[str], set[str]]:
    """The long options and the ini names in a ``pytest --help`` text."""
    options: set[str] = set()
    ini: set[str] = set()
    in_ini = False
    for line in help_text.splitlines():
        if line.startswith("[pytest]"):  # "[pytest] ini-options in ..." / "[pytest] configuration options in ..."
            in_ini = True
        elif in_ini and line and not line.startswith(" "):
            in_ini = False
        elif in_ini:
            match = re.match(r"  ([A-Za-z_][\w-]*) \(", line)
            if match:
                ini.add(match.group(1))
        elif line.startswith("  -"):
            flags = re.split(r"\s{2,}", line.strip())[0]
            options.update(re.findall(r"--[A-Za-z][\w-]*", flags))
    return options, ini


def _documented_names() -> set[str]:
    """The names in the first column of every table of docs/options.md (``--json PATH`` -> ``--json``)."""
    names: set[str] = set()
    for line in (DOCS / "options.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first_cell = line.split("|")[1]
            for code in re.findall(r"`([^`]+)`", first_cell):
                names.add(re.split(r"[\s=]", code)[0])
    return names


def test_the_options_table_names_every_option_and_ini_setting_the_plugin_registers(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    without = _options_and_ini(_help_text(["-m", "pytest", "--help", "-p", "no:cacheprovider"], tmp_path))
    with_ = _options_and_ini(
        _help_text(["-m", "pytest", "--help", "-p", "no:cacheprovider", "-p", "dstest.pytest.plugin"], tmp_path)
    )
    options, ini = with_[0] - without[0], with_[1] - without[1]
    assert options and ini, f"no dstest option or ini setting found in pytest --help: {options}, {ini}"
    missing = sorted((options | ini) - _documented_names())
    assert not missing, f"registered by the dstest plugin but not in a table of docs/options.md: {missing}"


def test_the_options_table_names_every_flag_of_the_dstest_command(tmp_path: Path) -> None:
    flags, _ = _options_and_ini(_help_text(["-m", "dstest", "--help"], tmp_path))
    flags.discard("--help")
    assert flags, "no flag found in dstest --help"
    missing = sorted(flags - _documented_names())
    assert not missing, f"flags of the dstest command not in a table of docs/options.md: {missing}"


# -- the site ---------------------------------------------------------------------------------------------------
def test_the_site_builds_with_mkdocs_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install 'mkdocs>=1.6' (the test and docs extras carry it)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "site" / "contracts" / "index.html").is_file()
