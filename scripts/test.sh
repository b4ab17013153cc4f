#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite on fake CPU devices, then (when no
# arguments are given) the host handlers' cases again under ASan + UBSan (scripts/sanitize.sh) and,
# beside both, the host executor's many-seed sweep (docs/testing.md).
# Extra arguments go to pytest alone, e.g. `bash scripts/test.sh -k routing -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
if [ $# -eq 0 ]; then
  # The sweep (-m sweep, deselected from the suite) runs once per full run, at the lowest CPU
  # priority: it takes the core the suite leaves idle and never slows the suite's timed waits.
  mkdir -p build
  sweep_log=build/host_executor_sweep.log
  nice -n 19 .venv/bin/python -m pytest -q -p no:cacheprovider -m "host_executor and sweep" \
    tests/host_executor_transport_test.py >"$sweep_log" 2>&1 &
  sweep=$!
fi
.venv/bin/python -m pytest -q "$@" || status=$?
if [ $# -eq 0 ]; then
  bash scripts/sanitize.sh || status=$?
  if wait "$sweep"; then
    echo "host executor sweep: $(tail -n 1 "$sweep_log")"
  else
    echo "host executor sweep failed:" >&2
    cat "$sweep_log" >&2
    status=1
  fi
fi
exit $status
