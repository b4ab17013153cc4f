#!/usr/bin/env bash
# Builds the CPU targets of //:BUILD with Bazel, offline, and smoke-tests the resulting modules.
#
# Made for Debian's bazel-bootstrap (Bazel 4.2.3; `apt-get install bazel-bootstrap`), which cannot
# download rules: every external repository BUILD needs is wired to a local stand-in
# (bazel/offline/README.md) in a scratch workspace, with @jax_hybridep = this checkout read through
# its own BUILD file. Nothing is written to the source tree.
#
# Environment:
#   PYTHON            interpreter whose nanobind, jaxlib headers and Python headers are used
#                     (default: .venv/bin/python of this checkout, else python3)
#   BAZEL             bazel binary (default: bazel)
#   BAZEL_CHECK_ROOT  scratch directory: workspace + Bazel output root, reused across runs for
#                     caching (default: build/bazel_check in this checkout; build/ is git-ignored)
#   BAZEL_CHECK_JOBS  --jobs (default: number of CPUs)
# Exit status 0 when everything built and the modules imported, the production one with its CPU
# handlers.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
BAZEL="${BAZEL:-bazel}"
ROOT="${BAZEL_CHECK_ROOT:-$REPO/build/bazel_check}"
JOBS="${BAZEL_CHECK_JOBS:-$(nproc 2>/dev/null || echo 2)}"
OFFLINE="$REPO/bazel/offline"

command -v "$BAZEL" >/dev/null || { echo "bazel_check: '$BAZEL' not found" >&2; exit 2; }

# Locate everything through the interpreter, without importing jax (one path per line).
PATHS="$("$PYTHON" - <<'EOF'
import importlib.util, pathlib, sysconfig
def pkg(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"bazel_check: python package {name!r} not found")
    return pathlib.Path(spec.origin).parent
print(pkg("nanobind"), pkg("jaxlib") / "include" / "xla" / "ffi" / "api",
      sysconfig.get_paths()["include"], sep="\n")
EOF
)"
{ read -r NB_DIR; read -r XLA_INC; read -r PY_INC; } <<<"$PATHS"
for d in "$NB_DIR/src" "$NB_DIR/ext/robin_map/include" "$XLA_INC" "$PY_INC"; do
  [[ -d "$d" ]] || { echo "bazel_check: missing $d" >&2; exit 2; }
done

WS="$ROOT/ws"
REPOS="$ROOT/repos"
rm -rf "$WS" "$REPOS"
mkdir -p "$WS" "$REPOS"

# stub_repo NAME PACKAGE_DIR FILE_NAME SOURCE: a local repository holding one .bzl file.
stub_repo() {
  mkdir -p "$REPOS/$1/$2"
  : >"$REPOS/$1/WORKSPACE"
  : >"$REPOS/$1/BUILD"
  [[ "$2" == . ]] || : >"$REPOS/$1/$2/BUILD"
  cp "$OFFLINE/$4" "$REPOS/$1/$2/$3"
}
stub_repo rules_cc cc defs.bzl rules_cc.defs.bzl
stub_repo rules_java java defs.bzl rules_java.defs.bzl
stub_repo rules_python python defs.bzl rules_python.defs.bzl
stub_repo rules_cuda cuda defs.bzl rules_cuda.defs.bzl
printf 'load(":defs.bzl", "cuda_library")\n\ncuda_library(name = "runtime", visibility = ["//visibility:public"])\n' \
  >"$REPOS/rules_cuda/cuda/BUILD"  # @rules_cuda//cuda:runtime, named in BUILD's CUDA branch
stub_repo nanobind_bazel . build_defs.bzl nanobind_bazel.build_defs.bzl

# @xla: jaxlib's FFI headers at xla/ffi/api, as in the XLA source tree.
mkdir -p "$REPOS/xla/xla/ffi/api"
: >"$REPOS/xla/WORKSPACE"
ln -s "$XLA_INC"/*.h "$REPOS/xla/xla/ffi/api/"
cp "$OFFLINE/xla_ffi_api.BUILD" "$REPOS/xla/xla/ffi/api/BUILD"

cat >"$WS/WORKSPACE" <<EOF
workspace(name = "jax_hybridep_bazel_check")

# Declared before Bazel's built-in WORKSPACE suffix, which would otherwise download them.
local_repository(name = "rules_cc", path = "$REPOS/rules_cc")
local_repository(name = "rules_java", path = "$REPOS/rules_java")
local_repository(name = "rules_python", path = "$REPOS/rules_python")
local_repository(name = "rules_cuda", path = "$REPOS/rules_cuda")
local_repository(name = "nanobind_bazel", path = "$REPOS/nanobind_bazel")
local_repository(name = "xla", path = "$REPOS/xla")
new_local_repository(name = "nanobind", path = "$NB_DIR", build_file = "$OFFLINE/nanobind.BUILD")
new_local_repository(name = "python_headers", path = "$PY_INC", build_file = "$OFFLINE/python_headers.BUILD")
new_local_repository(name = "jax_hybridep", path = "$REPO", build_file = "$REPO/BUILD")
EOF
: >"$WS/BUILD"

TARGETS=(
  @jax_hybridep//:hybridep_kernels
  @jax_hybridep//:hybridep_cpu_handlers
  @jax_hybridep//:libhybridep_runtime.so
  @jax_hybridep//:_hybridep
  @jax_hybridep//:_hybridep_testing
  @jax_hybridep//:jax_hybridep
  @jax_hybridep//:lab
)
echo "bazel_check: $("$BAZEL" --version 2>/dev/null || echo bazel), python $PYTHON"
echo "bazel_check: nanobind $NB_DIR, XLA FFI $XLA_INC"

# --batch: no server is left behind. The output root lives under $ROOT, so reruns are incremental
# and the user's ~/.cache/bazel is untouched. processwrapper-sandbox still hides undeclared inputs
# (a header missing from BUILD fails the build) but needs no namespaces, and Debian's linux-sandbox
# prints pages of debug output per action.
cd "$WS"
"$BAZEL" --batch --output_user_root="$ROOT/out" build \
  --symlink_prefix=/ \
  --jobs="$JOBS" \
  --spawn_strategy=processwrapper-sandbox \
  --cxxopt=-std=c++17 \
  --compilation_mode=opt \
  --color=no --curses=no --show_progress_rate_limit=30 \
  "${TARGETS[@]}"

BIN="$("$BAZEL" --batch --output_user_root="$ROOT/out" info --compilation_mode=opt bazel-bin 2>/dev/null)"
TOP="$BIN/external/jax_hybridep"
PKG="$TOP/jax_hybridep"
for so in "$PKG/_hybridep.so" "$PKG/libhybridep_runtime.so" "$TOP/_hybridep_testing.so"; do
  [[ -f "$so" ]] || { echo "bazel_check: $so was not built" >&2; exit 1; }
done
if [[ -e "$PKG/_hybridep_testing.so" ]]; then
  echo "bazel_check: the test module is inside the package ($PKG)" >&2; exit 1
fi

# The Bazel-built modules must import from where they are installed (the production module from
# the package directory, finding the runtime beside it; the test module from the top, finding it
# in the package) and expose what the CMake-built ones do: the production module its CPU handlers
# only, the test module its hooks, both on one runtime.
"$PYTHON" - "$TOP" <<'EOF'
import importlib.machinery, importlib.util, sys
def load(name, where):
    path = f"{sys.argv[1]}/{where}{name}.so"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod
mod, testing = load("_hybridep", "jax_hybridep/"), load("_hybridep_testing", "")
regs = mod.cpu_registrations()
assert regs and all(name.startswith("jax_hybridep_") for name in regs), regs
assert mod.with_cuda is False and testing.with_cuda is False, "CPU-only build reports CUDA"
assert {n for n in dir(mod) if not n.startswith("__")} == {
    "cpu_registrations", "limits", "send_plan", "take_recorded_errors", "with_cuda"}, dir(mod)
assert testing.open_exchange_count() == 0
testing.record_transport_error("bazel_check")
assert mod.take_recorded_errors() == [("transport", "bazel_check")], "the modules share no runtime"
print(f"bazel_check: OK, {sys.argv[1]}: _hybridep imports with {len(regs)} CPU handlers "
      f"({', '.join(sorted(regs))}); _hybridep_testing shares its runtime")
EOF
