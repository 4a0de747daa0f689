"""Multi-controller training: 2 processes x 4 CPU devices (gloo over 127.0.0.1) against 1 x 8.

The job runs on the two-level GB200 layout with a tensor axis (``mesh.layout=gb200``, 2 racks
of data 2 x tensor 2: one rack per process), so the cross-rack level of every weight gather
and gradient sum crosses processes, and each process runs two tensor groups (Megatron tensor
and sequence parallelism): 2 processes x (2 x 2) against 1 process x (4 x 2).

One sequence, shared by the tests: two processes start the tiny job with checkpoints every 2
steps; process 1 dies abruptly after step 3 (``TRAIN_FAULT_EXIT``); process 0 must stop with
a clear error instead of hanging in a collective. Then both are restarted with the same
command (through ``scripts/launch_local.sh``) and continue from the step-2 checkpoint, until
process 1 alone gets a SIGTERM after step 3 (``TRAIN_FAULT_SIGTERM``, as a preempted host
would): both agree on a step, save it and stop. The same command once more finishes the run.
The losses of the whole run, its final checkpoint and its export are bit-identical to one
process with 8 devices: every cross-device float sum in the step is a data movement followed
by a sum in a fixed order (``jax_nvfp4.collectives``), so the collective implementation
(in-process vs gloo) cannot change a bit.
"""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jax_nvfp4 as nv
from train import checkpoint as ckpt_lib
from train import loop
from train import programs

import conftest
from conftest import ROOT, TINY, mesh_of, sets, xla_flags

# One pytest-xdist worker runs this module: its module fixtures are computed once.
pytestmark = pytest.mark.xdist_group("multiprocess")

JOB = (*conftest.JOB, "mesh.layout=gb200", "mesh.nvl_domain=4", "mesh.tensor=2",
       "optim.clip_norm=1")  # the norm sums across processes
HEARTBEAT_S = 10  # the peer watch ends a survivor after 0.3 of it
SURVIVOR_DEADLINE_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_args(ck, out, export=None):
    args = ["--config", TINY, "--no-progress", "--out", str(out), "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2"]
    return args + sets(JOB) + (["--export", str(export)] if export else [])


def proc_env(**extra):
    """The environment of one of the two processes (the run's compile cache included)."""
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu", JAX_NUM_PROCESSES="2",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S),
        JAX_INIT_TIMEOUT="120", JAX_SHUTDOWN_TIMEOUT="30", PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def sequence(tmp_path_factory, reference):
    base = tmp_path_factory.mktemp("mp")
    ck, out, export = base / "ck", base / "out", base / "export"
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(2):
            log = open(base / f"p{i}.log", "w+")
            env = proc_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(i),
                           TRAIN_FAULT_EXIT="3:1")
            procs.append(subprocess.Popen([sys.executable, "-m", "train", *job_args(ck, out)], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        t_start = time.monotonic()
        died_at = survivor_at = None
        while time.monotonic() - t_start < 240 and (died_at is None or survivor_at is None):
            if died_at is None and procs[1].poll() is not None:
                died_at = time.monotonic()
            if survivor_at is None and procs[0].poll() is not None:
                survivor_at = time.monotonic()
            if died_at is not None and survivor_at is None and time.monotonic() - died_at > SURVIVOR_DEADLINE_S:
                break
            time.sleep(0.1)
        rcs = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    faulted = {"rcs": rcs, "died_at": died_at, "survivor_at": survivor_at, "logs": texts,
               "steps_on_disk": sorted(int(d) for d in os.listdir(ck) if d.isdigit()) if ck.exists() else []}

    # The launcher's own split this time (2 x 8/2 devices, not XLA_FLAGS); SIGTERM to process 1.
    launch = ["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "2"]
    env = proc_env(LAUNCH_PORT=str(free_port()), PYTHON=sys.executable, XLA_FLAGS=xla_flags(), TRAIN_FAULT_SIGTERM="3:1")
    stopped = subprocess.run([*launch, *job_args(ck, out, export)], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    stopped_at = {"steps_on_disk": sorted(int(d) for d in os.listdir(ck) if d.isdigit()),
                  "metrics": [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]}
    # The same command again, and its comparison with the single-process run.
    env = proc_env(LAUNCH_PORT=str(free_port()), PYTHON=sys.executable, XLA_FLAGS=xla_flags())
    restarted = subprocess.run([*launch, "--check-against", reference["out_dir"], *job_args(ck, out, export)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return {"faulted": faulted, "stopped": stopped, "stopped_at": stopped_at, "restarted": restarted, "ck": ck,
            "out": out, "export": export}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = conftest.tiny(*JOB)
    mesh = mesh_of(cfg, 8)
    out = tmp_path_factory.mktemp("ref")
    r = loop.run(cfg, mesh, str(out), progress=False)
    r["out_dir"] = str(out)
    r["host"] = ckpt_lib.host_arrays(r["params"], r["opt_state"])
    r["trainer"] = programs.build(cfg, mesh, init=False)[0]
    return r


@pytest.mark.slow
def test_survivor_of_a_dead_peer_stops_with_a_clear_error(sequence):
    f = sequence["faulted"]
    assert f["rcs"][1] == 17, f["logs"][1][-2000:]  # TRAIN_FAULT_EXIT's status
    assert "process 1 exits after step 3" in f["logs"][1]
    assert f["survivor_at"] is not None, "process 0 still running 60 s after its peer died:\n" + f["logs"][0][-3000:]
    assert f["rcs"][0] not in (0, None)
    assert f["survivor_at"] - f["died_at"] < SURVIVOR_DEADLINE_S
    # Either gloo reports the closed connection (exit 4, one line from the CLI) or the
    # coordination service's heartbeat check ends the process.
    assert ("error: process 0:" in f["logs"][0]) or ("another task died" in f["logs"][0]), f["logs"][0][-3000:]
    # The checkpoint of step 2 is on disk; nothing of the failed step 4.
    assert f["steps_on_disk"] == [2]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_saved_step(sequence):
    # SIGTERM to one process: both stop at the same step, save it, and exit 143 (not -15 with
    # nothing saved and the other blocked in a collective).
    r = sequence["stopped"]
    assert r.returncode == 143, (r.stdout[-2000:], r.stderr[-3000:])
    lines = [line for line in r.stderr.splitlines() if "preemption_notifier" not in line]  # the runtime's own log
    assert lines == ["stopped at step 5 by SIGTERM; checkpoint saved; rerun the same command to resume",
                     "launch_local: the 2 processes stopped on a signal (status 143); rerun the same command to resume"], \
        r.stderr[-3000:]
    # Process 1 was signalled after step 3, process 0 was then at step 4: both saved step 5,
    # the next after the furthest (orbax writes one step's shards from both or none).
    assert sequence["stopped_at"] == {"steps_on_disk": [2, 4, 5], "metrics": [1, 2, 3, 4, 5]}


@pytest.mark.slow
def test_restart_continues_and_two_processes_match_one(sequence, reference):
    r = sequence["restarted"]
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "launch_local: 2 processes x 4 simulated CPU devices = 8 devices" in r.stdout
    assert r.stdout.strip().splitlines()[-1].endswith("losses match bit for bit (6 steps)"), r.stdout[-2000:]
    assert "[Gloo]" not in r.stdout + r.stderr and "peer ranks" not in r.stdout + r.stderr
    recs = [json.loads(line) for line in (sequence["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5, 6]
    assert [x["loss"] for x in recs] == reference["history"]
    # The final checkpoint of the two processes holds exactly the single-process state.
    t = reference["trainer"]
    ck = ckpt_lib.Checkpointer(str(sequence["ck"]))
    assert ck.all_steps() == [4, 5, 6]
    got = ck.restore(6, t.abstract_params, t.abstract_state, t.param_shardings, t.state_shardings)
    ck.close()
    host = ckpt_lib.host_arrays(got.params, got.opt_state)
    bad = [k for k in reference["host"] if host[k].tobytes() != reference["host"][k].tobytes()]
    assert not bad, bad[:5]
    # Each process recorded the hashes of the files it wrote, and only those.
    from jax_nvfp4 import integrity

    recs = [json.loads((sequence["ck"] / "6" / n).read_text()) for n in (ckpt_lib.HASHES, "jax_nvfp4.sha256.process_1.json")]
    assert [r["process_count"] for r in recs] == [2, 2]
    assert all(integrity.owner(f) == p for p, r in enumerate(recs) for f in r["files"])
    assert any("ocdbt.process_1/" in f for f in recs[1]["files"]) and not set(recs[0]["files"]) & set(recs[1]["files"])
    # --export from two processes: process 0 writes the gathered weights.
    loaded = nv.export.load_nvfp4(str(sequence["export"]))
    want = nv.sharding.logical(jax.device_get(reference["params"]))
    assert jax.tree.structure(loaded, is_leaf=nv.array.is_nvfp4) == jax.tree.structure(want, is_leaf=nv.array.is_nvfp4)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.slow
def test_a_frozen_peer_ends_the_survivor_with_one_line(tmp_path):
    # Process 1 freezes (SIGSTOP) after step 3, as a hung host would. The survivor ends with
    # one line and exit 4 once the heartbeat timeout passes, not SIGABRT and a C++ stack dump.
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(2):
            logs.append(open(tmp_path / f"p{i}.log", "w+"))
            env = proc_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(i),
                           TRAIN_FAULT_STOP="3:1")
            procs.append(subprocess.Popen([sys.executable, "-m", "train", *job_args(tmp_path / "ck", tmp_path / "out")],
                                          cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.PIPE, text=True))
        _, err = procs[0].communicate(timeout=240)
        rc = procs[0].returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[Gloo]")]
    assert rc == 4, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: process 0: lost a peer: process 1"), err[-3000:]
    assert "frozen" in lines[0] and "SIGABRT" not in err and "Fatal" not in err
    # Nothing lost: the step-2 checkpoint is whole.
    ckpt_lib.Checkpointer(str(tmp_path / "ck")).verify(2)


@pytest.mark.slow
def test_processes_started_with_different_settings_stop_before_training(tmp_path):
    # Another data.seed on process 1 trained a mixture of two streams silently (the checkpoint and
    # config.yaml recording process 0's); another checkpoint.dir hung the first save. Each process
    # compares its settings with the others' and stops, exit 2, before anything is built.
    port = free_port()
    procs = []
    try:
        for i in range(2):
            env = proc_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(i))
            extra = ["--set", "data.seed=7"] if i == 1 else []
            procs.append(subprocess.Popen([sys.executable, "-m", "train", *job_args(tmp_path / "ck", tmp_path / "out"),
                                           *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[Gloo]")]
        assert p.returncode == 2 and len(lines) == 1, (i, err[-2000:])
        mine, theirs = ("data.seed=0", "data.seed=7") if i == 0 else ("data.seed=7", "data.seed=0")
        assert lines[0] == (f"error: the processes were started with different settings ({mine} in process {i}, "
                            f"{theirs} in process {1 - i}); start every process with the same command"), lines
    assert not (tmp_path / "ck").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()
