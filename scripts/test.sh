#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite on fake CPU devices.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k routing -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
