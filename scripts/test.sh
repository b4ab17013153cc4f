#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite on fake CPU devices, then (when no
# arguments are given) the host handlers' cases again under ASan + UBSan (scripts/sanitize.sh).
# Extra arguments go to pytest alone, e.g. `bash scripts/test.sh -k routing -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ $# -eq 0 ]; then
  bash scripts/sanitize.sh || status=$?
fi
exit $status
