#!/usr/bin/env bash
# Formats and lints everything: ruff (Python) and clang-format (C++/CUDA), from the venv.
#   bash scripts/format.sh          # rewrite files
#   bash scripts/format.sh --check  # report only (exit 1 on differences)
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip --disable-pip-version-check -q install ruff clang-format
native=$(git ls-files -- {xla_ffi,lab}/'*'.{h,cc,cu,cuh})
if [ "${1:-}" = "--check" ]; then
  .venv/bin/ruff format --check . && .venv/bin/ruff check .
  .venv/bin/clang-format --dry-run --Werror $native
else
  .venv/bin/ruff format . && .venv/bin/ruff check --fix .
  .venv/bin/clang-format -i $native
fi
