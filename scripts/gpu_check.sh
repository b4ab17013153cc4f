#!/usr/bin/env bash
# The one prepared GPU check (DESIGN §5), for a lent NVIDIA GPU machine without network:
#   1. builds the module offline against the installed jaxlib (--no-build-isolation, CUDA required,
#      sm_90a SASS only, to be quick),
#   2. runs the GPU tests with JAX_HYBRIDEP_REQUIRE_GPU=1 (a skip for want of a GPU fails),
#   3. compute-sanitizer memcheck and racecheck on the virtual-rank harness (R=2, tiny sizes),
#   4. the transport benchmark (one rank alone through HBM, 1..24 SMs) and the JAX-level
#      benchmark on the Hybrid-EP preset,
# then prints a short table last. Logs and JSON land in $OUT (the device tool brings that folder
# back) or out/gpu. Meant to finish in under 6 minutes on an H200.
#
#   bash scripts/gpu_check.sh            # everything
#   STEPS="build tests" bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STEPS=${STEPS:-"build tests memcheck racecheck transport bench"}
export PYTHONUNBUFFERED=1
declare -A RESULT

# run NAME LIMIT_S CMD...: logs to $OUT/NAME.log, records status and seconds.
run() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) RESULT[$name]="skipped"; return ;; esac
  local start=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  RESULT[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") $((SECONDS - start))s"
  tail -n 4 "$OUT/$name.log"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import sys, jax, jaxlib; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  nvcc --version | tail -n 1
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

run build 240 "$PY" -m pip install -q --no-build-isolation --no-deps --no-index \
  -C cmake.define.JAX_HYBRIDEP_CUDA=ON -C cmake.define.JAX_HYBRIDEP_CUDA_ARCHITECTURES=90a-real \
  -C build-dir=build/gpu_check -e .

GPU_TESTS=(tests/cuda_kernels_test.py tests/cuda_transport_test.py tests/cuda_ipc_test.py
  tests/gpu_jax_test.py)
JAX_HYBRIDEP_REQUIRE_GPU=1 run tests 240 "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
  --junitxml="$OUT/tests.xml" "${GPU_TESTS[@]}"
# Lowering for CUDA is checked on CPU machines too; here it runs beside the real handlers.
run lowering 60 "$PY" -m pytest -q -p no:cacheprovider tests/cuda_lowering_test.py

# Sanitizers on the harness: two ranks, tiny sizes, both copy paths (600-byte and 8208-byte rows).
SANITIZE=(-m pytest -q -p no:cacheprovider tests/cuda_transport_test.py
  -k "float32-random-2 or bfloat16-duplicates-2 or reuses_windows and 5-1")
run memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" "${SANITIZE[@]}"
run racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$PY" "${SANITIZE[@]}"

run transport 120 "$PY" -m jax_hybridep.bench.gpu_transport --json "$OUT/gpu_transport.json"
JAX_PLATFORMS=cuda run bench 180 "$PY" -m jax_hybridep.bench --preset hybridep \
  --capacities dropless,1.25 --directions fwd+bwd --topologies flat \
  --json "$OUT/bench_gpu.json" --png "$OUT/bench_gpu.png"

echo
echo "== summary ($(date -u +%FT%TZ))"
for step in build tests lowering memcheck racecheck transport bench; do
  printf '%-10s %s\n' "$step" "${RESULT[$step]:-not run}"
done
if [ -f "$OUT/transport.log" ]; then
  echo
  tail -n 9 "$OUT/transport.log"
fi
for step in build tests lowering memcheck racecheck transport; do
  case "${RESULT[$step]:-}" in FAILED*) exit 1 ;; esac
done
