#!/usr/bin/env bash
# Start N cooperating JAX processes on this machine: python -m train, one per process, CPU
# devices, gloo collectives, coordinated over 127.0.0.1. The same multi-controller code path as a
# multi-node GPU run, minus the GPUs.
#
#   scripts/launch_local.sh N [--devices-per-process K] [--check-against DIR] [train args...]
#   scripts/launch_local.sh 2 --config train/configs/tiny.yaml --out runs/tiny-2x4 \
#       --check-against runs/tiny      # after: python -m train --config train/configs/tiny.yaml
#
# The 8 simulated CPU devices of one process are split over the N processes: N x (8/N) devices,
# the same mesh as `python -m train` alone (N must divide 8; otherwise give
# --devices-per-process K, or mesh.simulate_devices=K among the train args, for N x K devices).
# --check-against DIR: once every process has finished, compare this run's per-step losses
# (metrics.jsonl) with DIR/metrics.jsonl bit for bit and say so (python -m train.runs); the
# exit status is then the comparison's (0 same, 1 different, 2 a file missing).
# gloo's connection lines ("[Gloo] Rank 0 is connected to 1 peer ranks...") are filtered out.
#
# Environment: PYTHON (default: python), LAUNCH_MODULE (default: train; tests swap in a probe),
# LAUNCH_PORT (default: a free port). Exits with the first non-zero status of any process, after
# killing the others: a process left alone would otherwise block forever in a collective.
#
# Stopping: SIGINT (Ctrl-C) or SIGTERM to this script is passed on to every process as SIGTERM:
# they agree on a step, save it and exit with 143 (python -m train's "stopped by a signal");
# the script waits for all of them and exits with that status. A second SIGINT or SIGTERM
# kills them at once. A process that exits with 130 or 143 by itself (it was signalled
# directly) does not stop the others either: they stop at the same step.
set -u

usage() {
  echo "usage: $0 N [--devices-per-process K] [--check-against DIR] [args for python -m ${LAUNCH_MODULE:-train}...]" >&2
  exit 2
}
if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  usage
fi
n=$1
shift
python=${PYTHON:-python}
module=${LAUNCH_MODULE:-train}

# The launcher's own options, wherever they are among the train args.
per_process="" check_against="" rest=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --devices-per-process) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || usage; per_process=$2; shift 2 ;;
    --devices-per-process=*) per_process=${1#*=}; [[ "$per_process" =~ ^[1-9][0-9]*$ ]] || usage; shift ;;
    --check-against) [[ $# -ge 2 ]] || usage; check_against=$2; shift 2 ;;
    --check-against=*) check_against=${1#*=}; shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
set -- "${rest[@]+"${rest[@]}"}"
if [[ -n "$check_against" && ! -f "$check_against/metrics.jsonl" ]]; then
  echo "launch_local: --check-against $check_against: no metrics.jsonl there; nothing started" >&2
  exit 2
fi

export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# Simulated CPU devices per process: K, else 8/N, unless the train args or XLA_FLAGS say.
device_args=()
if [[ "$JAX_PLATFORMS" == cpu && "${XLA_FLAGS:-}" != *xla_force_host_platform_device_count* \
      && " $* " != *mesh.simulate_devices=* ]]; then
  if [[ -z "$per_process" ]]; then
    if (( 8 % n != 0 )); then
      echo "launch_local: $n processes cannot split 8 simulated devices evenly; pass --devices-per-process K" \
           "(N x K devices in all)" >&2
      exit 2
    fi
    per_process=$((8 / n))
  fi
  device_args=(--set "mesh.simulate_devices=$per_process")
  echo "launch_local: $n processes x $per_process simulated CPU devices = $((n * per_process)) devices"
fi

# Ask the OS for a free port rather than hard-coding one: parallel launches (CI, tests) collide.
port=${LAUNCH_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# jax.distributed.initialize() reads JAX_COORDINATOR_ADDRESS itself; the train CLI passes
# JAX_NUM_PROCESSES / JAX_PROCESS_ID on (initialize() does not read those two).
export JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}"
export JAX_NUM_PROCESSES="$n"
# CPU collectives across processes need gloo; JAX reads its config flags from the environment.
export JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
# Output goes through a filter (below): keep it line by line.
export PYTHONUNBUFFERED=1

# Every line but gloo's connection reports, as it comes. Its threads write them to stderr
# concurrently, piece by piece, so one report can be cut into several lines ("[Gloo] Rank 0 is
# connected to 3", "peer ranks. Expected number of connected peer ranks is : 3", "7"): drop
# any line holding a piece of one, and bare numbers.
quiet_gloo() {
  grep --line-buffered -v -E '\[Gloo\]|Rank [0-9]+ is connected|is connected to|peer ranks|^[[:space:]]*[0-9]+[[:space:]]*$'
  return 0
}

# True while $1 runs: kill -0 also succeeds for an exited child not yet reaped (a zombie).
alive() {
  kill -0 "$1" 2>/dev/null || return 1
  if [[ -r /proc/$1/status ]]; then
    ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"
  else
    [[ "$(ps -o stat= -p "$1" 2>/dev/null)" != Z* ]]
  fi
}

pids=()
stopping=0
# First signal: ask every process to save and stop; second: kill them now.
on_signal() {
  local pid
  if [[ $stopping -eq 0 ]]; then
    stopping=$1
    echo "launch_local: $2: asking the processes to save their step and stop (again: kill them now)" >&2
    for pid in "${pids[@]}"; do alive "$pid" && kill -TERM "$pid" 2>/dev/null; done
  else
    echo "launch_local: $2 again: killing the processes" >&2
    for pid in "${pids[@]}"; do alive "$pid" && kill -9 "$pid" 2>/dev/null; done
    wait 2>/dev/null
    exit "$stopping"
  fi
}
cleanup() {
  local pid t
  for pid in "${pids[@]}"; do alive "$pid" && kill "$pid" 2>/dev/null; done
  # A process stuck in a collective may not die on TERM; give them 10 s, then KILL.
  for ((t = 0; t < 100; t++)); do
    local alive=0
    for pid in "${pids[@]}"; do alive "$pid" && alive=1; done
    [[ $alive -eq 0 ]] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do alive "$pid" && kill -9 "$pid" 2>/dev/null; done
  wait 2>/dev/null
}
trap 'on_signal 130 SIGINT' INT
trap 'on_signal 143 SIGTERM' TERM

for ((i = 0; i < n; i++)); do
  JAX_PROCESS_ID=$i "$python" -m "$module" "${device_args[@]+"${device_args[@]}"}" "$@" \
    > >(quiet_gloo) 2> >(quiet_gloo >&2) &
  pids+=($!)
done

# Poll rather than `wait -n`: it tells which process ended (bash < 5.1 cannot), and a pid is
# only signalled while it is still our unreaped child.
status=0 stopped=0
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 && $status -eq 0 ]]; do
  still=()
  for pid in "${running[@]}"; do
    if alive "$pid"; then
      still+=("$pid")
    else
      wait "$pid"
      rc=$?
      if [[ ($rc -eq 130 || $rc -eq 143) && $stopped -eq 0 ]]; then
        stopped=$rc  # stopped by a signal, its step saved: the others stop at the same step
      elif [[ $rc -ne 0 && $rc -ne 130 && $rc -ne 143 && $status -eq 0 ]]; then
        echo "launch_local: process $pid exited with status $rc; stopping the others" >&2
        status=$rc
      fi
    fi
  done
  running=("${still[@]+"${still[@]}"}")
  [[ ${#running[@]} -gt 0 && $status -eq 0 ]] && sleep 0.2
done
if [[ $status -ne 0 ]]; then
  pids=("${running[@]+"${running[@]}"}")
  cleanup
  exit $status
fi
wait 2>/dev/null  # the output filters
if [[ $stopped -ne 0 ]]; then
  echo "launch_local: the $n processes stopped on a signal (status $stopped); rerun the same command to resume" >&2
  exit $stopped
fi
if [[ -n "$check_against" ]]; then
  "$python" -m train.runs --against "$check_against" -- "${device_args[@]+"${device_args[@]}"}" "$@"
  exit $?
fi
exit 0
