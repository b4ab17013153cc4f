#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12) with jax_hybridep built from source (native module, and CUDA
# kernels when nvcc is found), the laboratory's test module and the test tools. Safe to re-run;
# prints the interpreter it used.
#   PYTHON=/path/to/python3.12 bash scripts/setup.sh    # pick the interpreter yourself
#   JAX_HYBRIDEP_CUDA=OFF bash scripts/setup.sh         # skip the CUDA kernels
set -euo pipefail
cd "$(dirname "$0")/.."

is_new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null && is_new_enough "$candidate"; then
      command -v "$candidate"
      return
    fi
  done
  # pyenv installs that are not selected (pyenv's shims refuse them): use them directly.
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for candidate in $(ls -d "$root"/versions/3.* 2>/dev/null | sort -V -r); do
    if [ -x "$candidate/bin/python3" ] && is_new_enough "$candidate/bin/python3"; then
      echo "$candidate/bin/python3"
      return
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_new_enough .venv/bin/python; then
  python=$(find_python) || {
    echo "setup: no Python >= 3.12 found (tried \$PYTHON, python3.13, python3.12, python3 and" \
         "pyenv versions); install one or set PYTHON=/path/to/python3.12" >&2
    exit 1
  }
  echo "setup: creating .venv with $python ($("$python" --version))"
  rm -rf .venv
  "$python" -m venv .venv
fi

pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
# Build tools first, so the package builds against the jaxlib it will run with (no isolated
# build environment, which would download a second jaxlib).
"${pip[@]}" install "jax>=0.11.2" "jaxlib>=0.11.2" "scikit-build-core>=0.10" "nanobind>=2.4" \
  cmake ninja
# The developer install: the package editable, with the laboratory's test module beside it
# (_hybridep_testing, installed outside the package; a user's `pip install .` has none).
JAX_HYBRIDEP_TESTING=ON "${pip[@]}" install --no-build-isolation -e ".[test,examples]"
.venv/bin/python -c "import jax, jax_hybridep._hybridep as m, _hybridep_testing as t
print(f'setup: jax {jax.__version__}, native module built (CUDA kernels: {m.with_cuda}),' \
  f' test module {t.__name__} beside it')"
