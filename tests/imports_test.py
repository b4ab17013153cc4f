"""No import circle among jax_hybridep's modules (pure Python: the sources' ASTs, nothing imported).

Every `import` and `from ... import` anywhere in a module (function-level ones too: a deferred
import still ties the two modules together) is an edge to the module it names: `from p import m`
to the submodule `p.m` when there is one, else to `p` itself. A package's `__init__` is the
module named by the package. An import circle is a strongly connected set of two or more modules;
the test names every one it finds.

The tests and the examples import one another by name, never by path: no file under tests/ or
examples/ imports a `*_test` module (shared helpers live in their own modules) or edits `sys.path`
(adds to it or assigns into it: pytest puts tests/ and the repository root there, and the
examples' two jobs run as modules from the root, `python -m examples.train_moe`, where Python
puts the root there itself).

The package apart from its laboratory: no module under jax_hybridep/ imports lab/, the tests or
the examples; nothing but the benchmark and the simulator imports them; and `import
jax_hybridep.nn` (in a fresh interpreter, the one test that imports) loads no cost model,
simulator or benchmark. Each check is shown to fire on a planted break.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

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
    """Where `source` imports a test module or edits sys.path (a call that adds to it, an
    assignment to it or into it)."""
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
        elif isinstance(node, ast.Assign | ast.AugAssign) and any(
            ast.unparse(t).startswith("sys.path")
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        ):
            out.append(f"{path}:{node.lineno} assigns to sys.path")
            continue
        else:
            continue
        if any(name.rpartition(".")[2].endswith("_test") for name in names):
            out.append(f"{path}:{node.lineno} imports a test module")
    return sorted(out, key=lambda line: int(line.split(":")[1].split()[0]))


def test_seam_checker_finds_planted_breaks():
    planted = (
        "import sys\nsys.path.insert(0, 'x')\nfrom fp8_test import helper\nimport a.b_test\n"
        "sys.path[0] = 'root'\nsys.path += ['x']\n"
    )
    assert _seam_breaks(planted, "p.py") == [
        "p.py:2 adds to sys.path",
        "p.py:3 imports a test module",
        "p.py:4 imports a test module",
        "p.py:5 assigns to sys.path",
        "p.py:6 assigns to sys.path",
    ]
    clean = "import sys\npaths = list(sys.path)\nfrom harness import x\n"
    assert _seam_breaks(clean, "ok.py") == []


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


# ----------------------------------------------------------------------------- the laboratory
# What ships is what a user imports or runs; the laboratory (lab/), the tests and the examples
# import the package, never the reverse.

OUTSIDE_ROOTS = ("lab", "tests", "examples")


def _outside_names() -> set[str]:
    """Top-level names a package module must not import: lab, tests, examples, and the tests'
    own modules (importable by bare name when pytest puts tests/ on sys.path)."""
    helpers = {
        n[: -len(".py")] for n in os.listdir(os.path.join(REPO, "tests")) if n.endswith(".py")
    }
    return set(OUTSIDE_ROOTS) | helpers


def _outside_imports(source: str, path: str, outside: set[str]) -> list[str]:
    """Where `source` imports a module whose top-level name is in `outside` (relative imports
    stay inside the package)."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        out += [f"{path}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in outside]
    return out


def test_outside_import_checker_finds_planted_breaks():
    planted = (
        "import lab.xdc_paper\n"
        "from tests import harness\n"
        "from examples.main_job import train\n"
        "def f():\n"
        "    import route_kinds\n"
        "from . import ops\n"
        "import labrador, jax_hybridep.lab\n"
    )
    assert _outside_imports(planted, "p.py", _outside_names()) == [
        "p.py:1 imports lab.xdc_paper",
        "p.py:2 imports tests",
        "p.py:3 imports examples.main_job",
        "p.py:5 imports route_kinds",
    ]


def test_the_package_imports_no_laboratory_test_or_example():
    outside, breaks = _outside_names(), []
    assert {"lab", "harness", "route_kinds"} <= outside
    for path in _modules().values():
        if path:
            with open(path) as f:
                breaks += _outside_imports(f.read(), os.path.relpath(path, REPO), outside)
    assert not breaks, "\n".join(breaks)


# ------------------------------------------------- the algorithm apart from the user commands
# The benchmark (jax_hybridep.bench) and the simulator (jax_hybridep.sim) are commands a user
# runs; nothing of the library's algorithm imports them.

COMMANDS = ("jax_hybridep.bench", "jax_hybridep.sim")


def _in(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _command_imports(graph: dict[str, set[str]]) -> list[str]:
    """Where a module outside the commands' packages imports one of them."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if not _in(name, COMMANDS)
        for target in targets
        if _in(target, COMMANDS)
    )


def test_command_import_checker_finds_a_planted_break(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def table():\n    from jax_hybridep.bench import cli\n")
    modules = _modules() | {"jax_hybridep.balance.planted": str(planted)}
    graph = {
        "jax_hybridep.balance.planted": _imports(
            "jax_hybridep.balance.planted", str(planted), modules
        ),
        "jax_hybridep.bench.balance": {"jax_hybridep.balance.balancer", "jax_hybridep.bench.cli"},
        "jax_hybridep.sim.network": {"jax_hybridep.xdc.model.cost"},
        "jax_hybridep.simulation": {"jax_hybridep.ops"},
    }
    assert _command_imports(graph) == [
        "jax_hybridep.balance.planted imports jax_hybridep.bench.cli"
    ]


def test_the_algorithm_imports_neither_the_benchmark_nor_the_simulator():
    modules = _modules()
    assert "jax_hybridep.bench.balance" in modules and "jax_hybridep.sim.network" in modules
    graph = {
        name: _imports(name, path, modules) if path else set() for name, path in modules.items()
    }
    breaks = _command_imports(graph)
    assert not breaks, "\n".join(breaks)


# ----------------------------------------------------------------------------- what nn loads
# `import jax_hybridep.nn` loads what a block runs: no cost model, planner or re-planner
# (xdc.model), simulator or benchmark (checked in a fresh interpreter).

NOT_FOR_A_BLOCK = ("jax_hybridep.xdc.model", "jax_hybridep.sim", "jax_hybridep.bench")


def _loaded_by(code: str) -> list[str]:
    """The NOT_FOR_A_BLOCK modules in sys.modules after `code` runs in a fresh interpreter."""
    probe = (
        f"import sys\n{code}\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('jax_hybridep.'))))"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.split() if _in(m, NOT_FOR_A_BLOCK)]


def test_what_nn_loads_checker_finds_a_planted_break():
    """Asking `xdc` for its planner (loaded at first use) or importing the simulator is seen."""
    loaded = _loaded_by(
        "import jax_hybridep.nn, jax_hybridep.xdc, jax_hybridep.sim\njax_hybridep.xdc.plan"
    )
    assert "jax_hybridep.xdc.model.planner" in loaded and "jax_hybridep.sim" in loaded


def test_importing_nn_loads_no_cost_model_simulator_or_benchmark():
    assert _loaded_by("import jax_hybridep.nn") == []


# ----------------------------------------------------------------------------- the native side
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
