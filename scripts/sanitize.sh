#!/usr/bin/env bash
# Builds the native modules with AddressSanitizer + UndefinedBehaviorSanitizer (CPU only, no
# CUDA) into build/sanitize and runs the host handlers' test cases under it; scripts/test.sh runs
# it after the suite. Any ASan report or undefined behaviour fails the run.
#   bash scripts/sanitize.sh                 # the default selection below
#   bash scripts/sanitize.sh -k scan -x      # other pytest arguments instead of the selection
# The selection (chosen to fit CI's time: under ASan each compile takes ~5x longer):
# tests/native_test.py; test_inside_scan_and_checkpoint[ffi] from tests/dispatch_combine_test.py
# (the VJPs, several generations per call site, remat); and from the contract suite
# (tests/contract_test.py) the host kinds on the fused one-level route with capacity and a
# placement, two EP groups beside a data axis, three walked levels with padding (values and
# VJPs), and the cross-process pack path over two levels (each also compiles the xla reference).
# `tests/contract_test.py -k ffi` runs every host case.
# The normal .venv build is untouched: the sanitized module is loaded in its place inside this
# one Python process only.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh

build=build/sanitize
cxx=${CXX:-g++}  # GCC: its runtime libraries are found with -print-file-name below
asan=$("$cxx" -print-file-name=libasan.so 2>/dev/null || true)
if [ ! -f "$asan" ]; then
  echo "sanitize: $cxx has no AddressSanitizer runtime (libasan.so); install GCC's or set CXX" >&2
  exit 1
fi
mkdir -p "$build"
.venv/bin/cmake -S . -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja" \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g" -DJAX_HYBRIDEP_SANITIZE=ON -DJAX_HYBRIDEP_CUDA=OFF \
  -DJAX_HYBRIDEP_TESTING=ON -DPython_EXECUTABLE="$PWD/.venv/bin/python" >"$build.log" 2>&1 ||
  { cat "$build.log" >&2; exit 1; }
.venv/bin/cmake --build "$build" --target _hybridep _hybridep_testing >>"$build.log" 2>&1 ||
  { cat "$build.log" >&2; exit 1; }
module=$(ls "$build"/_hybridep.*so)

if [ $# -eq 0 ]; then
  contract=tests/contract_test.py::test_contract
  set -- tests/native_test.py "tests/dispatch_combine_test.py::test_inside_scan_and_checkpoint[ffi]" \
    "$contract[ffi-flat4_capacity_placed]" "$contract[ffi-data_groups_capacity]" \
    "$contract[ffi-dc2_node2_local2_capacity_pad2]" \
    "$contract[ffi_packed-node2_local4_capacity_unweighted]"
fi
# Python is not instrumented, so the ASan runtime must be the first library loaded, and libstdc++
# right after it (ASan intercepts C++ throws, and finds the real __cxa_throw only if libstdc++ is
# there when it starts). Leak checking is off: the interpreter and XLA keep allocations until exit
# by design.
export LD_PRELOAD="$asan $("$cxx" -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS="${ASAN_EXTRA:-}detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="${UBSAN_EXTRA:-}print_stacktrace=1:halt_on_error=1"
echo "sanitize: $module and its test module (ASan + UBSan) on: $*"
exec .venv/bin/python - "$build" "$@" <<'EOF'
import importlib.machinery
import importlib.util
import pathlib
import sys

import pytest

# Load the sanitized builds as jax_hybridep._hybridep and the laboratory's _hybridep_testing
# before the package and lab/native_module.py import the installed ones; both find the sanitized
# runtime library beside them (build RPATH).
build, args = pathlib.Path(sys.argv[1]), sys.argv[2:]
loaded = {}
for name, full in (("_hybridep", "jax_hybridep._hybridep"), ("_hybridep_testing", "_hybridep_testing")):
    (path,) = build.glob(f"{name}.*so")
    loader = importlib.machinery.ExtensionFileLoader(full, str(path))
    spec = importlib.util.spec_from_file_location(full, path, loader=loader)
    loaded[name] = sys.modules[full] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded[name])

import jax_hybridep  # noqa: E402
from lab import native_module  # noqa: E402

assert jax_hybridep._native._hybridep is loaded["_hybridep"], "the sanitized module was not loaded"
assert native_module.testing_module() is loaded["_hybridep_testing"]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *args]))
EOF
