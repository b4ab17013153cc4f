#!/usr/bin/env bash
# The one prepared GPU check (docs/design.md §5), for a lent NVIDIA GPU machine without network:
#   build      the native module with CUDA (sm_90a SASS only, to be quick), placed in the source
#              tree; or, when .gpu/ holds a module built elsewhere for this Python and jaxlib
#              (scripts/gpu_check.sh --prebuild does that), that one if it imports with CUDA
#   kernels    the CUDA kernel and virtual-rank transport tests (R = 2, 4, 8) against numpy
#   transport, transport_k1
#              the transport benchmark (one rank alone through HBM, 1..24 SMs): top-8 over the
#              rank's 8 experts, then one row per token
#   jaxgpu     JAX-level tests on the GPUs present and CUDA IPC between two processes
#   memcheck, racecheck
#              compute-sanitizer on the virtual-rank harness (R = 2, tiny sizes)
#   layer      a whole MoE layer (dispatch -> grouped GEMM -> combine, fwd + bwd) against the same
#              layer on ragged_all_to_all
#   bench      the Hybrid-EP preset, both backends (rows fusible and behind a barrier) and the
#              baselines
#   lowering   the CUDA lowering tests beside the real handlers
#   profile    (on request) Nsight Compute on the transport kernels at 8 SMs
#   sass       (on request) the module's SASS, to read sanitizer offsets against
# GPU tests run with JAX_HYBRIDEP_REQUIRE_GPU=1 (a skip for want of a GPU fails). Steps run in that
# order inside one time budget (DEADLINE_S, default 540 s, under the device tool's 600 s per call):
# a step gets what is left, and steps that no longer fit are reported as skipped. Logs and JSON are
# written to out/gpu and packed into $OUT/gpu_check.tgz (the device tool brings back at most 8
# files); the table printed last is also $OUT/summary.txt.
#
#   bash scripts/gpu_check.sh                          # everything
#   STEPS="build kernels" bash scripts/gpu_check.sh    # a subset
#   bash scripts/gpu_check.sh --prebuild               # here: build .gpu/ for the GPU machine
# A module already verified on a GPU may ride along in .gpu_fallback/ (carry both folders): if the
# kernel tests fail with .gpu/, the remaining steps run on it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# build_module DIR DEST: builds the wheel with CUDA (sm_90a) offline in DIR and puts its native
# module into DEST.
build_module() {
  rm -rf "$1" && mkdir -p "$2"
  JAX_HYBRIDEP_CUDA=ON JAX_HYBRIDEP_CUDA_ARCHITECTURES=90a-real CMAKE_BUILD_PARALLEL_LEVEL=16 \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index -C build-dir="$1" -w "$1" . ||
    return 1
  "$PY" -c "import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0])
for n in z.namelist():
    if n.startswith('jax_hybridep/_hybridep') and n.endswith('.so'):
        open(sys.argv[2] + '/' + n.split('/')[-1], 'wb').write(z.read(n))" "$1" "$2"
}

if [ "${1:-}" = "--prebuild" ]; then
  # The GPU machine's Python (3.12) and jaxlib (0.11.2) must match the interpreter given here.
  PY=${PYTHON:-python3}
  rm -rf .gpu
  build_module build/gpu_prebuild .gpu && ls -l .gpu
  exit
fi

LOGS=out/gpu
RESULTS=${OUT:-$LOGS}
mkdir -p "$LOGS" "$RESULTS"
rm -f "$LOGS"/* # no stale results from an earlier run
# The lent H200's Python with jax is this venv's; elsewhere the python3 on PATH.
if [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python ]; then PYTHON=/opt/torch/.venv/bin/python; fi
PY=${PYTHON:-python3}
ALL_STEPS="build kernels transport transport_k1 jaxgpu memcheck racecheck layer bench lowering"
STEPS=${STEPS:-$ALL_STEPS}
DEADLINE_S=${DEADLINE_S:-540}
export PYTHONUNBUFFERED=1
# Workers started as scripts (tests/gpu_worker.py) import the package from the source tree.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
declare -A RESULT=()

# run NAME LIMIT_S CMD...: logs to $LOGS/NAME.log, records status and seconds; the limit is cut to
# the time left in the budget.
run() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) RESULT[$name]="skipped"; return ;; esac
  local left=$((DEADLINE_S - SECONDS - 10))
  if [ "$left" -lt 15 ]; then RESULT[$name]="skipped (out of time)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "== $name (<= ${limit}s, t=${SECONDS}s): $*"
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  RESULT[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") $((SECONDS - start))s"
  tail -n 3 "$LOGS/$name.log"
}

# Packs the logs for the trip back, whatever happened.
pack() { tar czf "$RESULTS/gpu_check.tgz" -C "$LOGS" . 2>/dev/null; }
trap pack EXIT

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
  "$PY" -c "import sys, jax, jaxlib; print(sys.version.split()[0], 'jax', jax.__version__)"
  nvcc --version | tail -n 1
  command -v compute-sanitizer || echo "no compute-sanitizer"
} >"$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

# imports_with_cuda LABEL: whether the module in the source tree imports, built with CUDA.
imports_with_cuda() {
  "$PY" -c "from jax_hybridep import _hybridep as m; assert m.with_cuda; print('$1', m.__file__)"
}

# The module: the prebuilt one if it imports with CUDA here, else built here.
build() {
  local so
  rm -f jax_hybridep/_hybridep*.so
  for so in .gpu/_hybridep*.so; do
    [ -f "$so" ] || continue
    cp "$so" jax_hybridep/
    imports_with_cuda prebuilt && return 0
    echo "prebuilt module unusable here; building"
    rm -f jax_hybridep/_hybridep*.so
  done
  build_module build/gpu_check jax_hybridep && imports_with_cuda built
}
export PY
export -f build build_module imports_with_cuda  # `timeout` runs programs: functions go via bash
run build 200 bash -c build

# One hung test fails alone, not the whole step, where pytest-timeout is installed.
PYTEST=("$PY" -m pytest -q -rfE -p no:cacheprovider)
HAS_PYTEST_TIMEOUT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo 1)
per_test_limit() { [ -n "$HAS_PYTEST_TIMEOUT" ] && echo "--timeout=$1"; }
export JAX_HYBRIDEP_REQUIRE_GPU=1

KERNEL_TESTS=(tests/cuda_kernels_test.py tests/cuda_transport_test.py)
run kernels 60 "${PYTEST[@]}" $(per_test_limit 60) -m gpu --junitxml="$LOGS/kernels.xml" \
  "${KERNEL_TESTS[@]}"
# A candidate module in .gpu/ that fails the kernel tests gives way to a verified one in
# .gpu_fallback/ (device time is too short to come back for a second lease), which the remaining
# steps then run on.
MODULE="the module of the build step"
if [[ "${RESULT[kernels]:-}" == FAILED* ]] && compgen -G ".gpu_fallback/_hybridep*.so" >/dev/null; then
  cp .gpu_fallback/_hybridep*.so jax_hybridep/
  MODULE=".gpu_fallback"
  STEPS="$STEPS kernels_fallback"
  run kernels_fallback 60 "${PYTEST[@]}" $(per_test_limit 60) -m gpu \
    --junitxml="$LOGS/kernels_fallback.xml" "${KERNEL_TESTS[@]}"
fi
# Top-8 over this rank's 8 experts (every token expands into 8 rows here), then one row per token.
run transport 90 "$PY" -m jax_hybridep.bench.gpu_transport --json "$LOGS/gpu_transport.json"
run transport_k1 60 "$PY" -m jax_hybridep.bench.gpu_transport --k 1 \
  --json "$LOGS/gpu_transport_k1.json"
run jaxgpu 240 "${PYTEST[@]}" $(per_test_limit 220) -m "gpu or multigpu" --junitxml="$LOGS/jaxgpu.xml" \
  tests/gpu_jax_test.py tests/cuda_ipc_test.py

# Sanitizers on the cooperative harness: two ranks, tiny sizes, both copy paths (600-byte and
# 8208-byte rows), and window reuse over five rounds (the per-rank-stream mode needs kernels of
# several streams running at once, which the sanitizers do not give).
SANITIZE=("$PY" -m pytest -q -p no:cacheprovider tests/cuda_transport_test.py
  -k "float32-random-2 or bfloat16-duplicates-2 or (reuses_windows and 5-1-False)")
run memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 "${SANITIZE[@]}"
run racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 9 "${SANITIZE[@]}"

JAX_PLATFORMS=cuda run layer 120 "$PY" -m jax_hybridep.bench.layer --tokens 4096 --hidden 2048 \
  --ffn 1024 --experts_per_device 8 --k 8 --json "$LOGS/layer_gpu.json"
# FP8 beside 16-bit dispatch (bytes on the wire: payload + scales) in the same run.
JAX_PLATFORMS=cuda run bench 240 "$PY" -m jax_hybridep.bench --preset hybridep --routings uniform \
  --capacities dropless,1.25 --directions fwd+bwd --topologies flat --variants fusible,barrier \
  --wire_dtype native,float8_e4m3fn --repeats 10 --warmup 3 --json "$LOGS/bench_gpu.json" \
  --png "$LOGS/bench_gpu.png"
# Lowering for CUDA is checked on CPU machines too; here it runs beside the real handlers.
run lowering 60 "${PYTEST[@]}" $(per_test_limit 50) tests/cuda_lowering_test.py
# Not in the default steps: Nsight Compute on the four transport kernels at 8 SMs (stall reasons,
# memory throughput), and the module's SASS for reading sanitizer offsets.
run profile 90 ncu --clock-control none -k "regex:SendTokens|ReceiveRows|SendPartials|ReducePartials" \
  -c 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy "$PY" -m jax_hybridep.bench.gpu_transport --sms 8 --iters 1 --warmup 0 --json ''
run sass 60 bash -c "cuobjdump -sass jax_hybridep/_hybridep*.so | gzip > $LOGS/sass.txt.gz"

{
  echo
  echo "== summary ($(date -u +%FT%TZ), ${SECONDS}s; steps after the kernel tests ran on $MODULE)"
  for step in $ALL_STEPS kernels_fallback profile sass; do
    printf '%-10s %s\n' "$step" "${RESULT[$step]:-not run}"
  done
  for step in kernels kernels_fallback jaxgpu memcheck racecheck lowering; do
    [ -f "$LOGS/$step.log" ] || continue
    printf '%-10s %s\n' "$step" "$(grep -E '(passed|failed|error|ERROR SUMMARY)' "$LOGS/$step.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$LOGS/$step.log" | head -n 8
  done
  for step in transport transport_k1 layer bench; do
    if [ -f "$LOGS/$step.log" ]; then
      echo
      tail -n 14 "$LOGS/$step.log"
    fi
  done
} | tee "$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$RESULTS/" 2>/dev/null
for step in $ALL_STEPS; do
  case "${RESULT[$step]:-}" in FAILED*) exit 1 ;; esac
done
exit 0
