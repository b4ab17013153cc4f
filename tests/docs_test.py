"""The documentation stays inside the repository and in step with it (no devices, no jax).

* No code or doc line cites a file outside the repository: the design is `docs/design.md`, cited
  by section (`docs/design.md §2.1.3`), never an outside design file, a note in a directory
  beside the checkout or an absolute path of a development machine.
* Every `docs/design.md §N` citation (and every bare `§N` of README.md and docs/design.md, which
  have no numbered sections but the design's) names a section that docs/design.md has.
* README.md is at most 200 lines: a newcomer's page; the rest lives in docs/.
* Every relative link in README.md and docs/*.md resolves to a file, and every repository path
  they name (`tests/x_test.py`, `jax_hybridep/exchange/`) exists.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"
DOC_PAGES = sorted([README, *(ROOT / "docs").glob("*.md")])

# Where code and docs live; build outputs, virtual environments and raw results are not scanned.
SCANNED_DIRS = (
    "jax_hybridep",
    "xla_ffi",
    "lab",
    "tests",
    "examples",
    "scripts",
    "docs",
    "bazel",
    ".ci",
)
SCANNED_SUFFIXES = {".py", ".cc", ".h", ".cu", ".sh", ".md", ".toml", ".bzl", ".txt", ".cfg"}
ROOT_FILES = ("README.md", "BUILD", "CMakeLists.txt", "pyproject.toml")
RAW_RESULTS = ("docs/gpu/", "docs/sim/")

# Spelled in pieces so that this file does not match itself.
OUTSIDE = [
    (re.compile(r"\b" + "DES" + r"IGN(\.md)?\s+§"), "the design outside the repository"),
    (re.compile("DES" + r"IGN\.md"), "a design file outside the repository"),
    (re.compile(r"\.\./" + "shared"), "a note outside the repository"),
    (re.compile(r"(?<![\w.])/(?:" + "work" + "|" + "home" + r")/"), "an absolute path"),
]

# A section reference: §2.1.3, §2.1.2-3 (2.1.2 to 2.1.3), §3.2-3.3.
SECTION = r"§\s*\d+(?:\.\d+)*(?:-\d+(?:\.\d+)*)?"
# `docs/design.md §N`, also as a markdown link (`[design.md](design.md) §N`), a comment wrapped
# between the name and the section, and lists (`§2.1, §3`).
DESIGN_CITATION = re.compile(
    r"design\.md[`)\]]*(?:\s|//|#)*(" + SECTION + r"(?:(?:\s*,\s*|\s+and\s+)" + SECTION + r")*)"
)
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:jax_hybridep|xla_ffi|lab|tests|examples|scripts|docs|bazel|\.ci)/[\w/.-]*\w/?)"
    r"(?![\w{*/]|\.[{*\w])"
)


def _scanned_files() -> list[pathlib.Path]:
    files = [ROOT / name for name in ROOT_FILES if (ROOT / name).is_file()]
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if (
                path.is_file()
                and path.suffix in SCANNED_SUFFIXES
                and not rel.startswith(RAW_RESULTS)
                and "__pycache__" not in rel
            ):
                files.append(path)
    return files


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _design_sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text()))


def _cited_sections(refs: str) -> list[str]:
    """'§2.1.2-3, §3' -> ['2.1.2', '2.1.3', '3']."""
    sections = []
    for ref in re.findall(SECTION, refs):
        number = ref.lstrip("§").strip()
        first, _, last = number.partition("-")
        sections.append(first)
        if last:  # a range: '2.1.2-3' ends at 2.1.3, '3.2-3.3' at 3.3
            sections.append(last if "." in last else ".".join([*first.split(".")[:-1], last]))
    return sections


def test_the_design_is_in_the_repository():
    assert DESIGN.is_file()
    sections = _design_sections()
    # The numbering the code cites: the contract's items and the top-level parts.
    for number in ["1", "2", "2.1", *(f"2.1.{i}" for i in range(1, 9)), "3", "4", "5"]:
        assert number in sections, f"docs/design.md has no section {number}"


def test_nothing_cites_a_file_outside_the_repository():
    found = []
    for path in _scanned_files():
        text = path.read_text(errors="replace")
        for pattern, what in OUTSIDE:
            for m in pattern.finditer(text):
                rel = path.relative_to(ROOT)
                found.append(f"{rel}:{_line(text, m.start())}: {what}: {m.group(0)!r}")
    assert not found, "cite docs/design.md §N (or a file in the repository):\n" + "\n".join(found)


def test_every_design_citation_names_a_section():
    sections = _design_sections()
    bad = []
    for path in _scanned_files():
        text = path.read_text(errors="replace")
        refs = [(m.start(), m.group(1)) for m in DESIGN_CITATION.finditer(text)]
        if path in (README, DESIGN):  # no numbered sections of their own: bare § is the design's
            refs += [(m.start(), m.group(0)) for m in re.finditer(SECTION, text)]
        for offset, ref in refs:
            for number in _cited_sections(ref):
                if number.rstrip(".") not in sections:
                    rel = path.relative_to(ROOT)
                    bad.append(f"{rel}:{_line(text, offset)}: §{number}")
    assert not bad, f"sections not in docs/design.md ({sorted(sections)}):\n" + "\n".join(bad)


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail into a docs/ page"


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_paths_resolve(page):
    text = page.read_text()
    missing = []
    for m in LINK.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):  # an anchor, http:, mailto:
            continue
        if not (page.parent / target).exists():
            missing.append(f"line {_line(text, m.start())}: link {m.group(1)}")
    for m in REPO_PATH.finditer(text):
        if not (ROOT / m.group(1)).exists():
            missing.append(f"line {_line(text, m.start())}: path {m.group(1)}")
    assert not missing, f"{page.relative_to(ROOT)}:\n" + "\n".join(missing)
