#!/usr/bin/env bash
# The one prepared GPU check (docs/design.md §5), for a lent NVIDIA GPU machine without network
# (docs/gpu.md "What a lease measures"). Default steps, in order:
#   build       the native libraries (_hybridep and its libhybridep_runtime.so in jax_hybridep/,
#               the laboratory's test module _hybridep_testing at the top): those
#               scripts/gpu_check.sh --prebuild made in .gpu/ (for this Python and jaxlib) if they
#               import with CUDA, else built here (sm_90a SASS)
#   csm         C_sm: what 1 and 8 SMs copy by 16-byte LSU accesses and by bulk copies
#   transport   the transport alone on one rank through HBM at 1..24 SMs against the
#               device-to-device copy: send (16-bit, FP8), combine's send back, the wide permute,
#               unpermute and reduce
#   kernels     the kernels against the §2.1 model: virtual-rank harness R = 2, 4, 8, window
#               reuse, FP8 of every bf16 pattern, flag mismatch and timeout; the slot-map and the
#               layout step's kernels against the references
#   jax         JAX-level dispatch/combine and VJPs through the CUDA handlers (FP8 of every bf16
#               pattern included) against the xla backend
#   bench       JAX-level bench, only once kernels and jax passed (never time a wrong transport):
#               ffi, xla and the baselines (rows fusible and behind a barrier, dropless and
#               f = 1.25, 16-bit and FP8)
#   memcheck    compute-sanitizer memcheck on the harness (R = 2, tiny sizes)
# On request (STEPS=...): multigpu (the JAX-level tests on every local GPU, CUDA IPC between
# processes), racecheck, layer, lowering, profile (Nsight Compute at 8 SMs), sass (the runtime's
# and the test module's SASS, to read sanitizer offsets against).
# Run from the repository root's copy: the package and the laboratory (lab/) from the source tree.
# GPU tests run with JAX_HYBRIDEP_REQUIRE_GPU=1 (a skip for want of a GPU fails). Steps run in that
# order inside one time budget (DEADLINE_S, default 540 s, under the device tool's 600 s per call):
# a step gets what is left, and steps that no longer fit are reported as skipped. A failing step
# never stops the next. Each step writes out/gpu/step_<step>.json as it ends (status, seconds, the
# tests' summary, and the JSON of its figures), and the logs are re-packed into
# $OUT/gpu_check.tgz after every step, so a call cut short still brings back what finished; the
# table printed last is also $OUT/summary.txt.
#
#   bash scripts/gpu_check.sh                          # the default steps
#   STEPS="build csm transport" bash scripts/gpu_check.sh      # a subset
#   bash scripts/gpu_check.sh --prebuild               # here: build .gpu/ for the GPU machine
#   bash scripts/gpu_check.sh --dry-run                # here: the steps' logic, commands echoed
#                                                      # (DRY_RUN_FAIL="step ..." fails those)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# build_module DIR DEST: builds the wheel with CUDA (sm_90a) and the test module offline in DIR
# and puts its native libraries where the wheel has them, under DEST: jax_hybridep/_hybridep and
# jax_hybridep/libhybridep_runtime.so, and _hybridep_testing at the top (on the same runtime).
build_module() {
  local dir=$1 dest=$2
  rm -rf "$dir" && mkdir -p "$dest/jax_hybridep"
  JAX_HYBRIDEP_CUDA=ON JAX_HYBRIDEP_TESTING=ON JAX_HYBRIDEP_CUDA_ARCHITECTURES=90a-real \
    CMAKE_BUILD_PARALLEL_LEVEL=16 "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index \
    -C build-dir="$dir" -w "$dir" . || return 1
  "$PY" -c "import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0])
names = [n for n in z.namelist() if n.endswith('.so')]
assert len(names) == 3, names  # _hybridep, libhybridep_runtime, _hybridep_testing
for n in names:
    open(sys.argv[2] + '/' + n, 'wb').write(z.read(n))" "$dir" "$dest"
}

DRY_RUN=
case "${1:-}" in
  --prebuild)
    # The GPU machine's Python (3.12) and jaxlib (0.11.2) must match the interpreter given here.
    PY=${PYTHON:-python3}
    rm -rf .gpu
    # The built files themselves, loaded by path (an editable install's finder would otherwise
    # answer for _hybridep_testing), where the GPU machine will have them: one runtime under both.
    build_module build/gpu_prebuild .gpu && ls -lR .gpu &&
      "$PY" -c "import glob, importlib.util
def load(name, where):
    spec = importlib.util.spec_from_file_location(name, glob.glob(f'.gpu/{where}{name}.*so')[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
m, t = load('_hybridep', 'jax_hybridep/'), load('_hybridep_testing', '')
handlers = m.cuda_registrations()
assert m.with_cuda and 'jax_hybridep_cuda_dispatch' in handlers and t.cuda_selftest_transport, m
t.record_transport_error('prebuild')
assert ('transport', 'prebuild') in m.take_recorded_errors(), 'the modules share no runtime'
print('prebuilt:', m.__file__, t.__file__, 'CUDA handlers:', len(handlers))"
    exit
    ;;
  --dry-run) DRY_RUN=1 ;;
esac

LOGS=${GPU_CHECK_LOGS:-out/gpu}
RESULTS=${OUT:-$LOGS}
mkdir -p "$LOGS" "$RESULTS"
rm -f "$LOGS"/* # no stale results from an earlier run
# The lent H200's Python with jax is this venv's; elsewhere the python3 on PATH.
if [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python ]; then PYTHON=/opt/torch/.venv/bin/python; fi
PY=${PYTHON:-python3}
DEFAULT_STEPS="build csm transport kernels jax bench memcheck"
EXTRA_STEPS="multigpu racecheck layer lowering profile sass"
STEPS=${STEPS:-$DEFAULT_STEPS}
DEADLINE_S=${DEADLINE_S:-540}
export PYTHONUNBUFFERED=1
# Workers started as scripts (tests/gpu_worker.py) import the package from the source tree.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
declare -A RESULT=()

# step_json NAME STATUS SECONDS LIMIT [FIGURES_JSON]: out/gpu/step_NAME.json, written as the step
# ends.
step_json() {
  "$PY" - "$LOGS" "$@" <<'EOF' || echo "{\"step\": \"$1\", \"status\": \"$2\"}" >"$LOGS/step_$1.json"
import json, pathlib, re, sys
logs, name, status, seconds, limit = pathlib.Path(sys.argv[1]), *sys.argv[2:6]
figures = sys.argv[6] if len(sys.argv) > 6 else ""
log = logs / f"{name}.log"
text = log.read_text(errors="replace") if log.exists() else ""
summary = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|error|ERROR SUMMARY)", ln)]
doc = dict(step=name, status=status, seconds=int(seconds), limit_s=int(limit),
           summary=summary[-1] if summary else "",
           failures=[ln for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))][:20],
           tail=text.splitlines()[-12:])
if figures and pathlib.Path(figures).exists():
    doc["figures"] = json.loads(pathlib.Path(figures).read_text())
(logs / f"step_{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
EOF
}

# Packs the logs for the trip back: after every step, and whatever happened at the end.
pack() {
  tar czf "$RESULTS/gpu_check.tgz.part" -C "$LOGS" . 2>/dev/null &&
    mv "$RESULTS/gpu_check.tgz.part" "$RESULTS/gpu_check.tgz"
}
trap pack EXIT

# run NAME LIMIT_S [--json FIGURES] CMD...: logs to $LOGS/NAME.log, records status and seconds;
# the limit is cut to the time left in the budget. With --dry-run the command is only echoed.
run() {
  local name=$1 limit=$2 figures=""
  shift 2
  if [ "${1:-}" = "--json" ]; then figures=$2; shift 2; fi
  case " $STEPS " in *" $name "*) ;; *) RESULT[$name]="skipped"; return ;; esac
  local left=$((DEADLINE_S - SECONDS - 10))
  if [ "$left" -lt 15 ]; then
    RESULT[$name]="skipped (out of time)"
    step_json "$name" "skipped (out of time)" 0 "$limit"
    pack
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS rc
  echo "== $name (<= ${limit}s, t=${SECONDS}s): $*"
  if [ -n "$DRY_RUN" ]; then  # DRY_RUN_FAIL="step ...": those steps fail
    echo "dry run: $*" >"$LOGS/$name.log"
    case " ${DRY_RUN_FAIL:-} " in *" $name "*) rc=1 ;; *) rc=0 ;; esac
  else
    timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
  fi
  RESULT[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") $((SECONDS - start))s"
  step_json "$name" "${RESULT[$name]}" $((SECONDS - start)) "$limit" "$figures"
  pack
  tail -n 3 "$LOGS/$name.log"
}

ok() { [[ "${RESULT[$1]:-}" == ok* ]]; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
  "$PY" -c "import sys, jax, jaxlib; print(sys.version.split()[0], 'jax', jax.__version__)"
  nvcc --version | tail -n 1
  command -v compute-sanitizer || echo "no compute-sanitizer"
} >"$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

# imports_with_cuda LABEL: whether the modules in the source tree import, built with CUDA.
imports_with_cuda() {
  "$PY" -c "from jax_hybridep import _hybridep as m; import _hybridep_testing as t
assert m.with_cuda and t.with_cuda and 'jax_hybridep_cuda_dispatch' in m.cuda_registrations()
print('$1', m.__file__, t.__file__)"
}

# The libraries: the prebuilt ones if they import with CUDA here, else built here.
clear_libraries() {
  rm -f jax_hybridep/_hybridep*.so jax_hybridep/libhybridep_runtime.so _hybridep_testing*.so
}
build() {
  clear_libraries
  if compgen -G ".gpu/jax_hybridep/*.so" >/dev/null; then
    cp .gpu/jax_hybridep/*.so jax_hybridep/ && cp .gpu/_hybridep_testing*.so .
    imports_with_cuda prebuilt && return 0
    echo "prebuilt libraries unusable here; building"
    clear_libraries
  fi
  build_module build/gpu_check . && imports_with_cuda built
}
export PY
export -f build build_module clear_libraries imports_with_cuda # `timeout` runs programs: functions go via bash
run build 200 bash -c build

# One hung test fails alone, not the whole step, where pytest-timeout is installed.
PYTEST=("$PY" -m pytest -q -rfE -p no:cacheprovider)
HAS_PYTEST_TIMEOUT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo 1)
per_test_limit() { [ -n "$HAS_PYTEST_TIMEOUT" ] && echo "--timeout=$1"; }
export JAX_HYBRIDEP_REQUIRE_GPU=1
BENCH_T=(--tokens 4096 --hidden 7168 --k 8 --experts 8 --iters 10 --warmup 2)
run csm 30 --json "$LOGS/gpu_copy_ceiling.json" "$PY" -m lab.gpu_transport_bench \
  --copy_ceiling --sms 1,8 --iters 10 --warmup 2 --json "$LOGS/gpu_copy_ceiling.json"
run transport 60 --json "$LOGS/gpu_transport.json" "$PY" -m lab.gpu_transport_bench \
  "${BENCH_T[@]}" --json "$LOGS/gpu_transport.json"
KERNEL_TESTS=(tests/cuda_transport_test.py tests/cuda_kernels_test.py)
run kernels 90 "${PYTEST[@]}" $(per_test_limit 60) -m gpu --junitxml="$LOGS/kernels.xml" \
  "${KERNEL_TESTS[@]}"
run jax 150 "${PYTEST[@]}" $(per_test_limit 140) -m gpu --junitxml="$LOGS/jax.xml" \
  "tests/gpu_jax_test.py::test_one_gpu"

# The JAX-level bench (4096 tokens, H = 7168, top-8 of 8 experts, one GPU), only once the
# transport verified.
BENCH=("$PY" -m jax_hybridep.bench --preset hybridep --routings uniform --capacities dropless,1.25
  --directions fwd+bwd --topologies flat --variants fusible,barrier
  --wire_dtype native,float8_e4m3fn --repeats 5 --warmup 2)
if ok kernels && ok jax; then
  JAX_PLATFORMS=cuda run bench 150 --json "$LOGS/bench_gpu.json" "${BENCH[@]}" \
    --backends ffi,xla --methods hybridep,gshard,worst_case --json "$LOGS/bench_gpu.json" \
    --png "$LOGS/bench_gpu.png"
else
  RESULT[bench]="skipped (the transport did not verify)"
fi

# Sanitizers last: two ranks, tiny sizes; the harness's both copy paths and window reuse.
SANITIZE=("$PY" -m pytest -q -p no:cacheprovider tests/cuda_transport_test.py
  -k "float32-random-2 or bfloat16-duplicates-2 or (reuses_windows and 5-1)")
run memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 "${SANITIZE[@]}"
run multigpu 240 "${PYTEST[@]}" $(per_test_limit 220) -m "gpu or multigpu" \
  --junitxml="$LOGS/multigpu.xml" tests/gpu_jax_test.py
run racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 9 "${SANITIZE[@]}"

JAX_PLATFORMS=cuda run layer 120 --json "$LOGS/layer_gpu.json" "$PY" -m jax_hybridep.bench.layer \
  --tokens 4096 --hidden 2048 --ffn 1024 --experts_per_device 8 --k 8 --json "$LOGS/layer_gpu.json"
run lowering 60 "${PYTEST[@]}" $(per_test_limit 50) tests/cuda_lowering_test.py
run profile 90 ncu --clock-control none \
  -k "regex:SendKernel|PermuteKernel|UnpermuteKernel|ReduceKernel" \
  -c 6 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy "$PY" -m lab.gpu_transport_bench --sms 8 --iters 1 --warmup 0 \
  --json ''
run sass 60 bash -c "for f in jax_hybridep/libhybridep_runtime.so _hybridep_testing*.so; \
  do echo \"== \$f\"; cuobjdump -sass \$f; done | gzip > $LOGS/sass.txt.gz"

{
  echo
  echo "== summary ($(date -u +%FT%TZ), ${SECONDS}s)"
  for step in $DEFAULT_STEPS $EXTRA_STEPS; do
    printf '%-13s %s\n' "$step" "${RESULT[$step]:-not run}"
  done
  for step in kernels jax multigpu memcheck racecheck lowering; do
    [ -f "$LOGS/$step.log" ] || continue
    printf '%-13s %s\n' "$step" "$(grep -E '(passed|failed|error|ERROR SUMMARY)' "$LOGS/$step.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$LOGS/$step.log" | head -n 8
  done
  for step in csm transport bench layer; do
    if [ -f "$LOGS/$step.log" ]; then
      echo
      tail -n 14 "$LOGS/$step.log"
    fi
  done
} | tee "$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$RESULTS/" 2>/dev/null
"$PY" -c "import json, pathlib, sys
logs = pathlib.Path(sys.argv[1])
steps = [json.loads(p.read_text())
         for p in sorted(logs.glob('step_*.json'), key=lambda p: p.stat().st_mtime)]
(pathlib.Path(sys.argv[2]) / 'steps.json').write_text(json.dumps(steps, indent=1) + '\n')" \
  "$LOGS" "$RESULTS" 2>/dev/null
for step in $STEPS; do
  case "${RESULT[$step]:-}" in FAILED*) exit 1 ;; esac
done
exit 0
