#!/usr/bin/env bash
# Start N cooperating JAX processes on this machine: python -m train, one per process, CPU
# devices, gloo collectives, coordinated over 127.0.0.1. The same multi-controller code path as a
# multi-node GPU run, minus the GPUs.
#
#   scripts/launch_local.sh N [train args...]
#   scripts/launch_local.sh 2 --config train/configs/tiny.yaml --set mesh.simulate_devices=4
#
# Environment: PYTHON (default: python), LAUNCH_MODULE (default: train; tests swap in a probe),
# LAUNCH_PORT (default: a free port). Exits with the first non-zero status of any process, after
# killing the others: a process left alone would otherwise block forever in a collective.
set -u

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [args for python -m ${LAUNCH_MODULE:-train}...]" >&2
  exit 2
fi
n=$1
shift
python=${PYTHON:-python}
module=${LAUNCH_MODULE:-train}

# Ask the OS for a free port rather than hard-coding one: parallel launches (CI, tests) collide.
port=${LAUNCH_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# jax.distributed.initialize() reads JAX_COORDINATOR_ADDRESS itself; the train CLI passes
# JAX_NUM_PROCESSES / JAX_PROCESS_ID on (initialize() does not read those two).
export JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}"
export JAX_NUM_PROCESSES="$n"
# CPU collectives across processes need gloo; JAX reads its config flags from the environment.
export JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}

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
trap 'cleanup; exit 130' INT TERM

for ((i = 0; i < n; i++)); do
  JAX_PROCESS_ID=$i "$python" -m "$module" "$@" &
  pids+=($!)
done

# Poll rather than `wait -n`: it tells which process ended (bash < 5.1 cannot), and a pid is
# only signalled while it is still our unreaped child.
status=0
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 && $status -eq 0 ]]; do
  still=()
  for pid in "${running[@]}"; do
    if alive "$pid"; then
      still+=("$pid")
    else
      wait "$pid"
      rc=$?
      if [[ $rc -ne 0 && $status -eq 0 ]]; then
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
fi
exit $status
