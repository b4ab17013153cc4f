"""The documentation stays inside the repository and in step with it (no devices, no jax).

* No code or doc line cites a file outside the repository: the design is `docs/design.md`, cited
  by section (`docs/design.md §2.1.3`), never an outside design file, a note in a directory
  beside the checkout or an absolute path of a development machine.
* Every `docs/design.md §N` citation (and every bare `§N` of README.md and docs/design.md, which
  have no numbered sections but the design's) names a section that docs/design.md has.
* README.md is at most 200 lines: a newcomer's page; the rest lives in docs/.
* Every relative link in README.md and docs/*.md resolves to a file, and every repository path
  they name (`tests/x_test.py`, `jax_hybridep/exchange/`) exists.
* Every repository path a source file, script or build file of the product, the laboratory or the
  examples names (in a comment, a docstring, a message) exists, but for the build's own outputs.
* Every bare file name they give (`launch_support.h`, `xdc_*_test.py`: a source, script or doc
  name without its folder) is the name of some file in the tree, unless it is another project's
  file listed in `OTHER_PROJECTS_FILES`. (docs/log/ keeps history as written, and is not checked.)
"""

from __future__ import annotations

import fnmatch
import pathlib
import re
import subprocess

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


# A file name without a folder, with an ending of the tree's own sources, scripts or docs; `*` is
# a glob (`host_executor_*_test.py`).
BARE_NAME = re.compile(
    r"(?<![\w/.*-])([\w*][\w.*-]*\.(?:py|cc|h|cu|cuh|sh|md|toml|bzl|cmake|txt))(?![\w/])"
)
# Files of other projects the docs name (a log line's source, an anchor's file), with why.
OTHER_PROJECTS_FILES = {
    "client.h": "XLA's coordination client, quoted from a runtime log line (docs/multihost.md)",
}


def _tree_names() -> set[str]:
    """The file names of the tree (git's tracked and untracked-but-not-ignored files)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {pathlib.PurePosixPath(path).name for path in listed}


def _unknown_names(text: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each bare file name in `text` that no file of the tree is called."""
    unknown = []
    for m in BARE_NAME.finditer(text):
        name = m.group(1)
        if name in OTHER_PROJECTS_FILES:
            continue
        if not any(fnmatch.fnmatchcase(tree_name, name) for tree_name in names):
            unknown.append((_line(text, m.start()), name))
    return unknown


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


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_bare_file_names_name_files_of_the_tree(page):
    unknown = _unknown_names(page.read_text(), _tree_names())
    lines = [f"line {line}: {name}" for line, name in unknown]
    assert not unknown, f"{page.relative_to(ROOT)} names files the tree does not have:\n" + (
        "\n".join(lines)
    )


def test_a_bare_name_the_tree_does_not_have_is_found():
    """The planted break: the header docs/host_executor.md once named after it was gone."""
    names = {"ptx.cuh", "launch.h", "host_executor_test.py", "host_executor_planted_test.py"}
    text = "Launches go through `LaunchKernel` (`launch_support.h`), PTX through `ptx.cuh`;\n"
    text += "tests: `host_executor_*_test.py`, `device/launch.h`, and `docs_*_test.py`."
    assert _unknown_names(text, names) == [(1, "launch_support.h"), (2, "docs_*_test.py")]


# What the code may name that is not a file of the tree: the build's outputs (the native module and
# its runtime, installed beside the package) and the CUDA windows' key-value keys.
NOT_FILES = re.compile(r"^jax_hybridep/(?:_hybridep\b|libhybridep_runtime\.so$|window/)")
CODE_DIRS = ("jax_hybridep", "xla_ffi", "lab", "examples", "scripts", "bazel", ".ci")
CODE_SUFFIXES = {".py", ".cc", ".h", ".cu", ".cuh", ".sh", ".bzl"}


def _missing_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of each repository path in `text` that the tree does not have."""
    return [
        (_line(text, m.start()), m.group(1))
        for m in REPO_PATH.finditer(text)
        if not NOT_FILES.match(m.group(1)) and not (ROOT / m.group(1)).exists()
    ]


def test_code_names_paths_that_exist():
    files = [ROOT / "CMakeLists.txt", ROOT / "BUILD"]
    for top in CODE_DIRS:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in CODE_SUFFIXES]
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in files
        if "__pycache__" not in path.parts
        for line, name in _missing_paths(path.read_text(errors="replace"))
    ]
    assert len(files) > 200
    assert not missing, "paths that moved or went:\n" + "\n".join(missing)


def test_a_moved_path_in_code_is_found():
    """The planted break: the comments that named the native files before they moved."""
    text = "# xla_ffi/common/fp8.h computes the same bits; xla_ffi/fp8.h once did\n"
    text += "# installed as jax_hybridep/_hybridep.so beside jax_hybridep/libhybridep_runtime.so\n"
    assert _missing_paths(text) == [(1, "xla_ffi/fp8.h")]
