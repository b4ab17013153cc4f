"""BUILD (Bazel, for monorepo users) must keep mirroring CMakeLists.txt (the authoritative build).

Both files are read as text: every quoted or unquoted path under xla_ffi/ (the product) or lab/
(the laboratory: the test module's hooks, the host executor) with a native-source suffix counts,
comments do not. Bazel glob() patterns are expanded against the tree. The slow test
at the bottom builds BUILD's CPU targets with a real (offline) Bazel, when one is installed.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tokenize

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NATIVE_DIRS = ("xla_ffi", "lab")
SOURCE_SUFFIXES = (".cc", ".cpp", ".cu")
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")

# A path (or glob pattern) under xla_ffi/ or lab/, possibly behind a prefix such as
# ${CMAKE_CURRENT_SOURCE_DIR}/ or ./, ending in a native suffix and not followed by more path.
_PATH_RE = re.compile(
    r"(?<![\w.*/-])(?:[\w${}.-]+/)*?"
    r"(?P<path>(?:xla_ffi|lab)/[\w.*/-]*?\.(?:cc|cpp|cu|h|hpp|cuh))(?![\w.-])"
)


def _strip_cmake_comments(text: str) -> str:
    text = re.sub(r"#\[(=*)\[.*?\]\1\]", " ", text, flags=re.S)  # bracket comments
    out = []
    for line in text.splitlines():
        # A '#' outside a quoted argument starts a line comment.
        in_quote = False
        cut = len(line)
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                in_quote = not in_quote
            elif ch == "#" and not in_quote:
                cut = i
                break
        out.append(line[:cut])
    return "\n".join(out)


def _strip_starlark_comments(text: str) -> str:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    try:
        return "\n".join(
            tok.string for tok in tokens if tok.type not in (tokenize.COMMENT, tokenize.NL)
        )
    except (tokenize.TokenError, SyntaxError):  # not valid Python syntax: fall back to lines
        return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def _named_paths(text: str) -> set[str]:
    names: set[str] = set()
    for match in _PATH_RE.finditer(text):
        path = re.sub(r"/+", "/", match.group("path"))
        if "*" in path:  # Bazel glob() / CMake file(GLOB): what it matches in the tree
            names.update(p.relative_to(REPO).as_posix() for p in REPO.glob(path) if p.is_file())
        else:
            names.add(path)
    return names


def _split(paths: set[str]) -> tuple[set[str], set[str]]:
    sources = {p for p in paths if p.endswith(SOURCE_SUFFIXES)}
    headers = {p for p in paths if p.endswith(HEADER_SUFFIXES)}
    return sources, headers


def _on_disk() -> tuple[set[str], set[str]]:
    files = {
        p.relative_to(REPO).as_posix()
        for top in NATIVE_DIRS
        for p in (REPO / top).rglob("*")
        if p.is_file()
    }
    return _split(files)


def cmake_paths() -> set[str]:
    return _named_paths(_strip_cmake_comments((REPO / "CMakeLists.txt").read_text()))


def bazel_paths() -> set[str]:
    return _named_paths(_strip_starlark_comments((REPO / "BUILD").read_text()))


def _diff_report(what: str, expected: tuple[str, set[str]], actual: tuple[str, set[str]]) -> str:
    (exp_name, exp), (act_name, act) = expected, actual
    lines = [f"{what}: {act_name} and {exp_name} disagree."]
    if exp - act:
        lines.append(f"  in {exp_name} but missing from {act_name}:")
        lines += [f"    {p}" for p in sorted(exp - act)]
    if act - exp:
        lines.append(f"  in {act_name} but not in {exp_name}:")
        lines += [f"    {p}" for p in sorted(act - exp)]
    return "\n".join(lines)


def test_parsers_see_the_known_targets():
    # Guards against a regex that silently matches nothing.
    for name, paths in (("CMakeLists.txt", cmake_paths()), ("BUILD", bazel_paths())):
        known = {
            "xla_ffi/common/layout.cc",
            "xla_ffi/cpu/handlers/handlers.cc",
            "xla_ffi/module.cc",
            "lab/native/module.cc",
            "lab/host_executor/executor.cc",
        }
        assert known <= paths, f"{name}: parsed {sorted(paths)}"


def test_parser_handles_formatting_variants():
    text = """
      add_library(x STATIC ${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/a.cc "xla_ffi/b.cu"
        xla_ffi/cuda/c.cu lab/d.cc)  # xla_ffi/commented.cc
      #[[ xla_ffi/bracket.cc ]]
    """
    assert _named_paths(_strip_cmake_comments(text)) == {
        "xla_ffi/a.cc",
        "xla_ffi/b.cu",
        "xla_ffi/cuda/c.cu",
        "lab/d.cc",
    }
    build = 'srcs = ["xla_ffi/a.cc", \'xla_ffi/b.h\'],  # "xla_ffi/c.cc"\nhdrs = ["xla_ffi/x.hh"]'
    assert _named_paths(_strip_starlark_comments(build)) == {"xla_ffi/a.cc", "xla_ffi/b.h"}


def test_build_and_cmake_name_the_same_sources():
    cmake_src, _ = _split(cmake_paths())
    bazel_src, _ = _split(bazel_paths())
    assert bazel_src == cmake_src, _diff_report(
        "native sources (.cc/.cpp/.cu)", ("CMakeLists.txt", cmake_src), ("BUILD", bazel_src)
    )


def test_every_native_source_is_built_by_both():
    disk_src, _ = _on_disk()
    problems = []
    for name, paths in (("CMakeLists.txt", cmake_paths()), ("BUILD", bazel_paths())):
        src, _ = _split(paths)
        if disk_src - src:
            problems.append(
                f"under {'/ or '.join(NATIVE_DIRS)}/ but not in {name}:\n"
                + "\n".join(f"    {p}" for p in sorted(disk_src - src))
            )
    assert not problems, "\n".join(problems)


def test_build_names_the_same_headers():
    _, cmake_hdr = _split(cmake_paths())
    _, bazel_hdr = _split(bazel_paths())
    if cmake_hdr:  # CMake lists headers: mirror that list
        expected = ("CMakeLists.txt", cmake_hdr)
    else:  # it does not: Bazel must declare every header in the tree (sandboxing needs them)
        expected = (f"{'/ and '.join(NATIVE_DIRS)}/ on disk", _on_disk()[1])
    assert bazel_hdr == expected[1], _diff_report("headers", expected, ("BUILD", bazel_hdr))


def test_named_files_exist():
    missing = {
        name: sorted(p for p in paths if not (REPO / p).is_file())
        for name, paths in (("CMakeLists.txt", cmake_paths()), ("BUILD", bazel_paths()))
    }
    assert not any(missing.values()), f"files named but not in the tree: {missing}"


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("bazel") is None and os.environ.get("JAX_HYBRIDEP_REQUIRE_BAZEL") != "1",
    reason="bazel is not installed (CI installs Debian's bazel-bootstrap and requires this test)",
)
def test_bazel_builds_cpu_targets_offline():
    for pkg in ("nanobind", "jaxlib"):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{pkg} is not importable from {sys.executable}")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "bazel_check.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (
        f"scripts/bazel_check.sh exited {proc.returncode}\n"
        f"--- stdout (tail) ---\n{proc.stdout[-6000:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )
    assert "bazel_check: OK" in proc.stdout
