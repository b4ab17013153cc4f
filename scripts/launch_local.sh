#!/usr/bin/env bash
# Runs N processes of a job (`python -m examples.train_moe`, the main job, or MODULE's) on this
# machine as one jax.distributed job (fake CPU devices, gloo collectives): multi-host without a
# cluster. docs/multihost.md has the details.
#
#   bash scripts/launch_local.sh N [flags...]       # e.g. 2 --mesh=node=2,local=4 --steps=30
#   MODULE=examples.cross_dc bash scripts/launch_local.sh 2 --steps=30
#
# Every process runs `$PYTHON -m $MODULE` (the repository root first on PYTHONPATH, so from any
# directory) with the same flags plus --coordinator_address (a free port on 127.0.0.1),
# --num_processes and --process_id. Each one's output goes to <output_dir>/logs/process_<i>.log
# (output_dir: the last --output_dir= given, else /tmp/<MODULE's last part>, e.g. /tmp/cross_dc);
# process 0's is also shown here. Exits with the first non-zero status of a process, after
# stopping the others (SIGTERM, then SIGKILL after 10 s), naming that process and its log; 0 when
# every process exits 0. PYTHON (default: the repository's .venv) and JAX_PLATFORMS (default:
# cpu) may be set.
set -uo pipefail

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [flags...]  (N: processes, a whole number >= 1)" >&2
  exit 2
fi
num=$1
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
module="${MODULE:-examples.train_moe}"
python="${PYTHON:-$root/.venv/bin/python}"
out="/tmp/${module##*.}"
for flag in "$@"; do
  case "$flag" in --output_dir=*) out="${flag#--output_dir=}" ;; esac
done
logs="$out/logs"
if ! mkdir -p "$logs"; then
  echo "launch_local.sh: cannot create $logs (from --output_dir=$out)" >&2
  exit 2
fi
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" || exit 2

export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# gRPC honours proxy variables: the coordinator on 127.0.0.1 must be reached directly.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY

pids=()
for ((i = 0; i < num; i++)); do
  : >"$logs/process_$i.log" # here, before the follower below opens it
  "$python" -m "$module" "$@" --coordinator_address="127.0.0.1:$port" --num_processes="$num" \
    --process_id="$i" >>"$logs/process_$i.log" 2>&1 &
  pids+=($!)
done
tail -n +1 -f "$logs/process_0.log" --pid="${pids[0]}" &
follower=$!

stop_all() {  # SIGTERM to every process still running, SIGKILL to those left after 10 s
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 100); do
    kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
}
trap 'stop_all; kill "$follower" 2>/dev/null; exit 130' INT TERM

declare -A running  # pid -> process index
for ((i = 0; i < num; i++)); do running[${pids[$i]}]=$i; done
while [ "${#running[@]}" -gt 0 ]; do
  wait -n -p done_pid "${!running[@]}"
  status=$?
  failed=${running[$done_pid]}
  unset "running[$done_pid]"
  if [ "$status" -ne 0 ]; then
    stop_all
    wait "$follower" 2>/dev/null
    echo "launch_local.sh: process $failed exited with status $status; stopped the others" \
      "(its log: $logs/process_$failed.log)" >&2
    if [ "$failed" -ne 0 ]; then tail -n 5 "$logs/process_$failed.log" >&2; fi
    exit "$status"
  fi
done
wait "$follower" 2>/dev/null
exit 0
