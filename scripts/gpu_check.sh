#!/usr/bin/env bash
# The one prepared GPU check (DESIGN §5), for a lent NVIDIA GPU machine without network:
#   1. builds the module offline against the installed jaxlib (--no-build-isolation, CUDA required,
#      sm_90a SASS only, to be quick),
#   2. runs the GPU tests with JAX_HYBRIDEP_REQUIRE_GPU=1 (a skip for want of a GPU fails), and the
#      CUDA lowering tests,
#   3. the transport benchmark (one rank alone through HBM, 1..24 SMs),
#   4. compute-sanitizer memcheck and racecheck on the virtual-rank harness (R=2, tiny sizes),
#   5. the JAX-level benchmarks: the Hybrid-EP preset, and a whole MoE layer (dispatch -> grouped
#      GEMM -> combine, forward + backward) against the same layer on ragged_all_to_all,
# then prints a short table last. Steps run in that order inside one time budget (DEADLINE_S,
# default 540 s, under the device tool's 600 s per call): a step gets what is left, and steps that
# no longer fit are reported as skipped. Logs and JSON land in $OUT (the device tool brings that
# folder back) or out/gpu.
#
#   bash scripts/gpu_check.sh                          # everything
#   STEPS="build tests" bash scripts/gpu_check.sh      # a subset
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/tests.xml  # no stale results from an earlier run
# The lent H200's Python with jax is this venv's; elsewhere the python3 on PATH.
if [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python ]; then PYTHON=/opt/torch/.venv/bin/python; fi
PY=${PYTHON:-python3}
STEPS=${STEPS:-"build tests lowering transport memcheck racecheck layer bench"}
DEADLINE_S=${DEADLINE_S:-540}
export PYTHONUNBUFFERED=1
declare -A RESULT=()

# run NAME LIMIT_S CMD...: logs to $OUT/NAME.log, records status and seconds; the limit is cut to
# the time left in the budget.
run() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) RESULT[$name]="skipped"; return ;; esac
  local left=$((DEADLINE_S - SECONDS - 15))
  if [ "$left" -lt 20 ]; then RESULT[$name]="skipped (out of time)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "== $name (<= ${limit}s): $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  RESULT[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") $((SECONDS - start))s"
  tail -n 4 "$OUT/$name.log"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader || true
  "$PY" -c "import sys, jax, jaxlib; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  nvcc --version | tail -n 1
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# pyproject.toml reads these for the CMake options.
JAX_HYBRIDEP_CUDA=ON JAX_HYBRIDEP_CUDA_ARCHITECTURES=90a-real run build 240 \
  "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -C build-dir=build/gpu_check -e .

GPU_TESTS=(tests/cuda_kernels_test.py tests/cuda_transport_test.py tests/cuda_ipc_test.py
  tests/gpu_jax_test.py)
JAX_HYBRIDEP_REQUIRE_GPU=1 run tests 330 "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
  --junitxml="$OUT/tests.xml" "${GPU_TESTS[@]}"
# Lowering for CUDA is checked on CPU machines too; here it runs beside the real handlers.
run lowering 60 "$PY" -m pytest -q -p no:cacheprovider tests/cuda_lowering_test.py tests/cuda_kernels_test.py::test_built_with_cuda_when_nvcc_present

run transport 120 "$PY" -m jax_hybridep.bench.gpu_transport --json "$OUT/gpu_transport.json"

# Sanitizers on the cooperative harness: two ranks, tiny sizes, both copy paths (600-byte and
# 8208-byte rows), and window reuse over five rounds (the per-rank-stream mode needs kernels of
# several streams running at once, which the sanitizers do not give).
SANITIZE=(-m pytest -q -p no:cacheprovider tests/cuda_transport_test.py
  -k "float32-random-2 or bfloat16-duplicates-2 or (reuses_windows and 5-1-False)")
run memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" "${SANITIZE[@]}"
run racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 9 "$PY" "${SANITIZE[@]}"

JAX_PLATFORMS=cuda run layer 90 "$PY" -m jax_hybridep.bench.layer --tokens 4096 --hidden 2048 \
  --ffn 1024 --experts_per_device 8 --k 8 --json "$OUT/layer_gpu.json"
JAX_PLATFORMS=cuda run bench 150 "$PY" -m jax_hybridep.bench --preset hybridep --routings uniform \
  --capacities dropless,1.25 --directions fwd+bwd --topologies flat --repeats 10 --warmup 3 \
  --json "$OUT/bench_gpu.json" --png "$OUT/bench_gpu.png"

echo
echo "== summary ($(date -u +%FT%TZ), ${SECONDS}s)"
for step in build tests lowering transport memcheck racecheck layer bench; do
  printf '%-10s %s\n' "$step" "${RESULT[$step]:-not run}"
done
for step in tests lowering memcheck racecheck; do
  [ -f "$OUT/$step.log" ] && printf '%-10s %s\n' "$step" "$(grep -E '(passed|failed|error)' "$OUT/$step.log" | tail -n 1)"
done
for step in layer transport; do
  if [ -f "$OUT/$step.log" ]; then
    echo
    tail -n 9 "$OUT/$step.log"
  fi
done
for step in build tests lowering transport memcheck racecheck; do
  case "${RESULT[$step]:-}" in FAILED*) exit 1 ;; esac
done
