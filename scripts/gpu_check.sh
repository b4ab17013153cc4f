#!/usr/bin/env bash
# The one prepared GPU check (docs/design.md §5), for a lent NVIDIA GPU machine without network:
# the CUDA transports v1 and v2 measured side by side in one lease (docs/gpu.md "What a lease
# measures").
# Default steps, in order:
#   build       the native libraries (_hybridep, the test module _hybridep_testing and their
#               libhybridep_runtime.so): those scripts/gpu_check.sh --prebuild made in .gpu/ (for
#               this Python and jaxlib) if they import with CUDA, else built here (sm_90a SASS
#               only), and if transport v2 fails to build, built without it so v1's figures still
#               come; failing all that, the verified set in .gpu_fallback/
#   csm         C_sm: what 1 and 8 SMs copy by 16-byte LSU accesses and by bulk copies
#   transport_v2, transport
#               each transport alone on one rank through HBM at 1..24 SMs against the device-to-
#               device copy: v2's send, combine and wide permute/unpermute/reduce; v1's phases
#   v2kernels   v2's kernels against the §2.1 model: virtual-rank harness R = 2, 4, 8, window
#               reuse, FP8 of every bf16 pattern, flag mismatch and timeout, layout kernels
#   v2jax       JAX-level dispatch/combine and VJPs through the v2 handlers (FP8 of every bf16
#               pattern included) against the xla backend
#   bench       JAX-level bench: ffi-v1, xla and the baselines (rows fusible and behind a barrier,
#               dropless and f = 1.25, 16-bit and FP8)
#   bench_v2    the same for ffi-v2, only once v2kernels and v2jax passed (never time a wrong v2)
#   memcheck    compute-sanitizer memcheck on both harnesses (R = 2, tiny sizes)
# On request (STEPS=...): kernels and jaxgpu (v1's correctness), racecheck, layer, lowering,
# profile (Nsight Compute at 8 SMs), sass (the runtime's and the test module's SASS, to read
# sanitizer offsets against).
# GPU tests run with JAX_HYBRIDEP_REQUIRE_GPU=1 (a skip for want of a GPU fails). Steps run in that
# order inside one time budget (DEADLINE_S, default 540 s, under the device tool's 600 s per call):
# a step gets what is left, and steps that no longer fit are reported as skipped. A failing step
# never stops the next. Each step writes out/gpu/step_<step>.json as it ends (status, seconds, the
# tests' summary, and the JSON of its figures), and the logs are re-packed into
# $OUT/gpu_check.tgz after every step, so a call cut short still brings back what finished; the
# table printed last is also $OUT/summary.txt.
#
#   bash scripts/gpu_check.sh                          # the default steps
#   STEPS="build csm transport_v2" bash scripts/gpu_check.sh    # a subset
#   bash scripts/gpu_check.sh --prebuild               # here: build .gpu/ for the GPU machine
#   bash scripts/gpu_check.sh --dry-run                # here: the steps' logic, commands echoed
#                                                      # (DRY_RUN_FAIL="step ..." fails those)
# Libraries already verified on a GPU may ride along in .gpu_fallback/ (carry both folders; all
# three files, built together): if nothing imports or builds, or v1's kernel tests fail (the
# `kernels` step, run when STEPS names it), the remaining steps run on them.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# build_module DIR DEST [CMAKE_DEFINES...]: builds the wheel with CUDA (sm_90a) offline in DIR and
# puts its native libraries (the two modules and the runtime they share) into DEST.
build_module() {
  local dir=$1 dest=$2
  shift 2
  local defines=()
  for d in "$@"; do defines+=(-C "cmake.define.$d"); done
  rm -rf "$dir" && mkdir -p "$dest"
  JAX_HYBRIDEP_CUDA=ON JAX_HYBRIDEP_CUDA_ARCHITECTURES=90a-real CMAKE_BUILD_PARALLEL_LEVEL=16 \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index -C build-dir="$dir" \
    "${defines[@]}" -w "$dir" . || return 1
  "$PY" -c "import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0])
names = [n for n in z.namelist() if n.startswith('jax_hybridep/') and n.endswith('.so')]
assert len(names) == 3, names  # _hybridep, _hybridep_testing, libhybridep_runtime
for n in names:
    open(sys.argv[2] + '/' + n.split('/')[-1], 'wb').write(z.read(n))" "$dir" "$dest"
}

DRY_RUN=
case "${1:-}" in
  --prebuild)
    # The GPU machine's Python (3.12) and jaxlib (0.11.2) must match the interpreter given here.
    PY=${PYTHON:-python3}
    rm -rf .gpu
    build_module build/gpu_prebuild .gpu && ls -l .gpu &&
      "$PY" -c "import sys; sys.path.insert(0, '.gpu'); import _hybridep as m, _hybridep_testing as t
handlers = m.cuda_registrations()
assert m.with_cuda and 'jax_hybridep_cuda_v2_dispatch' in handlers and t.cuda_v2_plan_send, m
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
DEFAULT_STEPS="build csm transport_v2 transport v2kernels v2jax bench bench_v2 memcheck"
EXTRA_STEPS="kernels jaxgpu racecheck layer lowering profile sass"
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

# imports_with_cuda LABEL: whether the modules in the source tree import, built with CUDA; it
# prints whether transport v2 is in them.
imports_with_cuda() {
  "$PY" -c "from jax_hybridep import _hybridep as m, _hybridep_testing as t
assert m.with_cuda and t.with_cuda
print('$1', m.__file__, t.__file__, 'transport v2:',
      'jax_hybridep_cuda_v2_dispatch' in m.cuda_registrations())"
}

# The libraries: the prebuilt ones if they import with CUDA here, else built here with v2, else
# built here without v2 (v1's figures must come whatever v2 does), else the verified fallback.
clear_libraries() { rm -f jax_hybridep/_hybridep*.so jax_hybridep/libhybridep_runtime.so; }
build() {
  clear_libraries
  if compgen -G ".gpu/*.so" >/dev/null; then
    cp .gpu/*.so jax_hybridep/
    imports_with_cuda prebuilt && return 0
    echo "prebuilt libraries unusable here; building"
    clear_libraries
  fi
  # Time left for the v1-only build when the v2 one hangs (the step has 200 s in all).
  timeout 110 bash -c "build_module build/gpu_check jax_hybridep" &&
    imports_with_cuda built && return 0
  echo "building with transport v2 failed or took over 110 s; building v1 alone"
  clear_libraries
  build_module build/gpu_check_v1 jax_hybridep JAX_HYBRIDEP_CUDA_V2=OFF &&
    imports_with_cuda "built (v1 alone)" && return 0
  compgen -G ".gpu_fallback/*.so" >/dev/null || return 1
  echo "nothing built: the verified fallback"
  clear_libraries
  cp .gpu_fallback/*.so jax_hybridep/ && imports_with_cuda fallback
}
export PY
export -f build build_module clear_libraries imports_with_cuda # `timeout` runs programs: functions go via bash
run build 200 bash -c build

# One hung test fails alone, not the whole step, where pytest-timeout is installed.
PYTEST=("$PY" -m pytest -q -rfE -p no:cacheprovider)
HAS_PYTEST_TIMEOUT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo 1)
per_test_limit() { [ -n "$HAS_PYTEST_TIMEOUT" ] && echo "--timeout=$1"; }
export JAX_HYBRIDEP_REQUIRE_GPU=1
has_v2() {
  [ -n "$DRY_RUN" ] && echo 1 || "$PY" -c "from jax_hybridep import _hybridep as m
print(1 if m.with_cuda and 'jax_hybridep_cuda_v2_dispatch' in m.cuda_registrations() else '')" \
    2>/dev/null
}
HAS_V2=$(has_v2)
[ -z "$HAS_V2" ] && echo "the module has no transport v2: its steps are skipped"
v2() {
  if [ -n "$HAS_V2" ]; then run "$@"; else RESULT[$1]="skipped (no transport v2)"; fi
}

BENCH_T=(--tokens 4096 --hidden 7168 --k 8 --experts 8 --iters 10 --warmup 2)
run csm 30 --json "$LOGS/gpu_copy_ceiling.json" "$PY" -m jax_hybridep.bench.gpu_transport \
  --transport csm --sms 1,8 --iters 10 --warmup 2 --json "$LOGS/gpu_copy_ceiling.json"
v2 transport_v2 60 --json "$LOGS/gpu_transport_v2.json" "$PY" -m jax_hybridep.bench.gpu_transport \
  --transport v2 "${BENCH_T[@]}" --json "$LOGS/gpu_transport_v2.json"
run transport 60 --json "$LOGS/gpu_transport.json" "$PY" -m jax_hybridep.bench.gpu_transport \
  --transport v1 "${BENCH_T[@]}" --json "$LOGS/gpu_transport.json"
v2 v2kernels 90 "${PYTEST[@]}" $(per_test_limit 60) -m gpu --junitxml="$LOGS/v2kernels.xml" \
  tests/cuda_v2_transport_test.py
v2 v2jax 150 "${PYTEST[@]}" $(per_test_limit 140) -m gpu --junitxml="$LOGS/v2jax.xml" \
  "tests/gpu_jax_test.py::test_one_gpu_transport_v2"

# The JAX-level bench (4096 tokens, H = 7168, top-8 of 8 experts, one GPU): v1 and xla first, v2
# apart (a failing v2 must not take v1's figures with it) and only once it verified.
BENCH=("$PY" -m jax_hybridep.bench --preset hybridep --routings uniform --capacities dropless,1.25
  --directions fwd+bwd --topologies flat --variants fusible,barrier
  --wire_dtype native,float8_e4m3fn --repeats 5 --warmup 2)
JAX_PLATFORMS=cuda run bench 150 --json "$LOGS/bench_gpu.json" "${BENCH[@]}" \
  --backends ffi-v1,xla --methods hybridep,gshard,worst_case --json "$LOGS/bench_gpu.json" \
  --png "$LOGS/bench_gpu.png"
if ok v2kernels && ok v2jax; then
  JAX_PLATFORMS=cuda v2 bench_v2 120 --json "$LOGS/bench_gpu_v2.json" "${BENCH[@]}" \
    --backends ffi-v2 --methods hybridep --json "$LOGS/bench_gpu_v2.json" \
    --png "$LOGS/bench_gpu_v2.png"
else
  RESULT[bench_v2]="skipped (v2 did not verify)"
fi

# On request: v1's correctness (proven on the H200 on 2026-11-29; rerun when v1 changes).
KERNEL_TESTS=(tests/cuda_kernels_test.py tests/cuda_transport_test.py)
run kernels 60 "${PYTEST[@]}" $(per_test_limit 60) -m gpu --junitxml="$LOGS/kernels.xml" \
  "${KERNEL_TESTS[@]}"
MODULE="the module of the build step"
if [[ "${RESULT[kernels]:-}" == FAILED* ]] && compgen -G ".gpu_fallback/*.so" >/dev/null; then
  clear_libraries
  cp .gpu_fallback/*.so jax_hybridep/
  HAS_V2=$(has_v2) # the later steps (memcheck) pick v2's tests only if the fallback has v2
  MODULE=".gpu_fallback"
  STEPS="$STEPS kernels_fallback"
  run kernels_fallback 60 "${PYTEST[@]}" $(per_test_limit 60) -m gpu \
    --junitxml="$LOGS/kernels_fallback.xml" "${KERNEL_TESTS[@]}"
fi
run jaxgpu 240 "${PYTEST[@]}" $(per_test_limit 220) -m "gpu or multigpu" \
  --junitxml="$LOGS/jaxgpu.xml" tests/gpu_jax_test.py tests/cuda_ipc_test.py

# Sanitizers last: two ranks, tiny sizes; v2's harness (both copy paths, window reuse) and v1's.
# (v1's per-rank-stream mode needs kernels of several streams running at once, which the
# sanitizers do not give.)
PICK="float32-random-2 or bfloat16-duplicates-2 or (reuses_windows and 5-1-False)"
PICK+=" or (v2_transport_reuses_windows and 5-1)"
SANITIZE=("$PY" -m pytest -q -p no:cacheprovider tests/cuda_v2_transport_test.py
  tests/cuda_transport_test.py -k "$PICK")
run memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 "${SANITIZE[@]}"
run racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 9 "${SANITIZE[@]}"

JAX_PLATFORMS=cuda run layer 120 --json "$LOGS/layer_gpu.json" "$PY" -m jax_hybridep.bench.layer \
  --tokens 4096 --hidden 2048 --ffn 1024 --experts_per_device 8 --k 8 --json "$LOGS/layer_gpu.json"
run lowering 60 "${PYTEST[@]}" $(per_test_limit 50) tests/cuda_lowering_test.py \
  tests/cuda_v2_lowering_test.py
run profile 90 ncu --clock-control none \
  -k "regex:SendTokens|ReceiveRows|SendPartials|ReducePartials|SendKernel|PermuteKernel" \
  -c 6 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy "$PY" -m jax_hybridep.bench.gpu_transport --sms 8 --iters 1 --warmup 0 \
  --json ''
run sass 60 bash -c "for f in jax_hybridep/libhybridep_runtime.so jax_hybridep/_hybridep_testing*.so; \
  do echo \"== \$f\"; cuobjdump -sass \$f; done | gzip > $LOGS/sass.txt.gz"

{
  echo
  echo "== summary ($(date -u +%FT%TZ), ${SECONDS}s; v1's kernel tests, when run, ran on $MODULE)"
  for step in $DEFAULT_STEPS $EXTRA_STEPS kernels_fallback; do
    printf '%-13s %s\n' "$step" "${RESULT[$step]:-not run}"
  done
  for step in v2kernels v2jax kernels kernels_fallback jaxgpu memcheck racecheck lowering; do
    [ -f "$LOGS/$step.log" ] || continue
    printf '%-13s %s\n' "$step" "$(grep -E '(passed|failed|error|ERROR SUMMARY)' "$LOGS/$step.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$LOGS/$step.log" | head -n 8
  done
  for step in csm transport_v2 transport bench bench_v2 layer; do
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
