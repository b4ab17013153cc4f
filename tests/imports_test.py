"""No import circle among jax_hybridep's modules (pure Python: the sources' ASTs, nothing imported).

Every `import` and `from ... import` anywhere in a module (function-level ones too: a deferred
import still ties the two modules together) is an edge to the module it names: `from p import m`
to the submodule `p.m` when there is one, else to `p` itself. A package's `__init__` is the
module named by the package. An import circle is a strongly connected set of two or more modules;
the test names every one it finds.

The tests and the examples import one another by name, never by path: no file under tests/ or
examples/ imports a `*_test` module (shared helpers live in their own modules) or adds to
`sys.path` (pytest puts tests/ and the repository root there; the examples' two scripts, run by
path, replace their own folder with the root).
"""

from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "jax_hybridep")
PACKAGE = "jax_hybridep"
NATIVE = (  # compiled extension modules (built elsewhere; no imports)
    "jax_hybridep._hybridep",
)


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every .py file under jax_hybridep/."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out | dict.fromkeys(NATIVE)


def _imports(name: str, path: str, modules) -> set[str]:
    """The jax_hybridep modules `name` (at `path`) imports."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()

    def known(dotted: str) -> str | None:  # the longest prefix that is a module
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [known(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the enclosing package, `level - 1` steps up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base)
                for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t and t.split(".")[0] == PACKAGE and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more nodes (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_cycle_finder_finds_a_circle_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_jax_hybridep():
    modules = _modules()
    assert "jax_hybridep.xdc.runtime.domains" in modules and len(modules) > 50
    graph = {
        name: _imports(name, path, modules) if path else set() for name, path in modules.items()
    }
    assert "jax_hybridep.xdc.model.volumes" in graph["jax_hybridep.xdc.model.cost"]
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _seam_breaks(source: str, path: str) -> list[str]:
    """Where `source` imports a test module or adds to sys.path."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "sys.path.insert",
            "sys.path.append",
            "sys.path.extend",
        ):
            out.append(f"{path}:{node.lineno} adds to sys.path")
            continue
        else:
            continue
        if any(name.rpartition(".")[2].endswith("_test") for name in names):
            out.append(f"{path}:{node.lineno} imports a test module")
    return sorted(out, key=lambda line: int(line.split(":")[1].split()[0]))


def test_seam_checker_finds_planted_breaks():
    planted = "import sys\nsys.path.insert(0, 'x')\nfrom fp8_test import helper\nimport a.b_test\n"
    assert _seam_breaks(planted, "p.py") == [
        "p.py:2 adds to sys.path",
        "p.py:3 imports a test module",
        "p.py:4 imports a test module",
    ]
    assert _seam_breaks("import sys\nsys.path[0] = 'root'\nfrom harness import x\n", "ok.py") == []


def test_tests_and_examples_import_no_test_module_and_leave_sys_path_alone():
    breaks, files = [], 0
    for folder in ("tests", "examples"):
        for directory, _, names in os.walk(os.path.join(REPO, folder)):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(directory, name)
                with open(path) as f:
                    breaks += _seam_breaks(f.read(), os.path.relpath(path, REPO))
                files += 1
    assert files > 60
    assert not breaks, "\n".join(breaks)


# The laboratory stands beside the product (lab/__init__.py): no native file of the product
# includes a header from lab/, and the targets a user's wheel installs (CMake's production
# targets and every target they link) build no source from it and add no lab/ path to their
# include directories.
PRODUCTION_TARGETS = ("_hybridep", "hybridep_runtime")
_LAB_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](lab/[^">]*)[">]', re.M)


def _lab_includes(text: str, path: str) -> list[str]:
    """Where the C++ source `text` (at `path`) includes a header under lab/."""
    return [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1} includes {m.group(1)}"
        for m in _LAB_INCLUDE.finditer(text)
    ]


def _cmake_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, arguments) of every CMake command call; comments dropped, quoted arguments whole
    (a parenthesis inside quotes is text, not a call)."""
    plain, quoted, i = [], False, 0
    while i < len(text):  # drop bracket and line comments outside quotes
        ch = text[i]
        if not quoted and text.startswith("#[[", i):
            i = text.index("]]", i) + 2
            continue
        if not quoted and ch == "#":
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
            continue
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        plain.append(ch)
        i += 1
    text = "".join(plain)
    out, i, call = [], 0, re.compile(r"([A-Za-z_]\w*)\s*\(")
    while (m := call.search(text, i)) is not None:
        args, token, depth, quoted, j = [], "", 1, False, m.end()
        while j < len(text) and depth:
            ch = text[j]
            if ch == '"' and text[j - 1] != "\\":
                quoted = not quoted
            if not quoted and ch in "()":
                depth += 1 if ch == "(" else -1
            if depth and (quoted or not ch.isspace()):
                token += ch
            elif token:
                args, token = args + [token], ""
            j += 1
        out.append((m.group(1).lower(), args))
        i = j
    return out


def _linked(commands, roots) -> set[str]:
    """`roots` and every target they link, transitively (target_link_libraries)."""
    links: dict[str, set[str]] = {}
    for name, args in commands:
        if name == "target_link_libraries":
            links.setdefault(args[0], set()).update(args[1:])
    found, todo = set(), list(roots)
    while todo:
        target = todo.pop()
        if target not in found:
            found.add(target)
            todo += sorted(links.get(target, ()))
    return found


def _production_lab_paths(cmake: str, roots=PRODUCTION_TARGETS) -> list[str]:
    """Every lab/ path that `roots` (or a target they link) name as sources or include paths."""
    commands = [(name, args) for name, args in _cmake_commands(cmake) if args]
    targets = _linked(commands, roots)
    per_target = ("add_library", "nanobind_add_module", "target_sources")
    return sorted(
        f"{args[0]}: {name}(... {arg} ...)"
        for name, args in commands
        if (name in per_target or name.startswith("target_")) and args[0] in targets
        for arg in args[1:]
        if "lab/" in arg
    )


def test_laboratory_checkers_find_planted_breaks():
    source = '#include "xla_ffi/common/numeric.h"\n// lab/native/x.h, a comment\n'
    planted = source + '#include "lab/native/introspection.h"\n'
    planted += "#  include <lab/host_executor/ptx.h>\n"
    assert _lab_includes(source, "ok.cc") == []
    assert _lab_includes(planted, "p.cc") == [
        "p.cc:3 includes lab/native/introspection.h",
        "p.cc:4 includes lab/host_executor/ptx.h",
    ]
    cmake = """
      add_library(hybridep_kernels OBJECT xla_ffi/common/layout.cc)  # lab/in_a_comment.cc
      add_library(hybridep_runtime SHARED)
      target_link_libraries(hybridep_runtime PUBLIC hybridep_kernels)
      nanobind_add_module(_hybridep NB_STATIC xla_ffi/module.cc)
      nanobind_add_module(_hybridep_testing NB_STATIC lab/native/module.cc)
      execute_process(COMMAND "print('(lab/not_a_target.cc')")
    """
    assert _production_lab_paths(cmake) == []
    broken = (
        cmake
        + """
      add_library(hybridep_cuda_handlers OBJECT xla_ffi/cuda/handlers/layout.cc)
      target_link_libraries(hybridep_runtime PUBLIC hybridep_cuda_handlers)
      target_sources(hybridep_cuda_handlers PRIVATE "lab/native/cuda/reference.cc")
      target_include_directories(_hybridep PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/lab/native)
    """
    )
    assert _production_lab_paths(broken) == [
        "_hybridep: target_include_directories(... ${CMAKE_CURRENT_SOURCE_DIR}/lab/native ...)",
        'hybridep_cuda_handlers: target_sources(... "lab/native/cuda/reference.cc" ...)',
    ]
    # The same break planted in the real build: a laboratory source in a CUDA handlers' list.
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        real = f.read()
    site = "xla_ffi/cuda/state/site_state.cc"
    assert real.count(site) == 1
    real = real.replace(site, site + " lab/native/cuda/reference.cc")
    assert _production_lab_paths(real) == [
        "hybridep_cuda_handlers: add_library(... lab/native/cuda/reference.cc ...)"
    ]


def test_the_product_builds_nothing_from_the_laboratory():
    breaks, files = [], 0
    for directory, _, names in os.walk(os.path.join(REPO, "xla_ffi")):
        for name in sorted(n for n in names if n.endswith((".h", ".cc", ".cu", ".cuh"))):
            path = os.path.join(directory, name)
            with open(path) as f:
                breaks += _lab_includes(f.read(), os.path.relpath(path, REPO))
            files += 1
    assert files > 40
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        cmake = f.read()
    # The parser sees the build: what the production targets link, and the laboratory's sources
    # in the laboratory's own targets.
    commands = [(name, args) for name, args in _cmake_commands(cmake) if args]
    linked = _linked(commands, PRODUCTION_TARGETS)
    assert {"hybridep_kernels", "hybridep_cpu_handlers", "hybridep_cuda_handlers"} <= linked
    assert "_hybridep_testing" not in linked
    assert "lab/native/module.cc" in " ".join(_production_lab_paths(cmake, ("_hybridep_testing",)))
    breaks += [f"CMakeLists.txt: {line}" for line in _production_lab_paths(cmake)]
    assert not breaks, "\n".join(breaks)
