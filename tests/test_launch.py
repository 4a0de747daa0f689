"""``scripts/launch_local.sh``'s own logic (device split, gloo filter, --check-against) with a
probe that imports no JAX, and the loss comparison it runs (``train.runs``)."""

import json
import os
import subprocess
import sys
import textwrap


from train import runs

from conftest import ROOT


PROBE = textwrap.dedent("""
    import json, os, sys
    args = sys.argv[1:]
    rank = os.environ["JAX_PROCESS_ID"]
    print(f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    print(f"[Gloo] Rank {rank} on stderr", file=sys.stderr)
    # Two gloo threads writing at once: one line loses its prefix to the other.
    print("[Gloo] Rank [Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
    print("2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
    print(f"probe {rank} argv " + json.dumps(args))
    if os.environ.get("PROBE_SIGNALS"):
        # As python -m train does: the first SIGTERM saves and exits 143 (after a moment);
        # PROBE_SIGNALS=ignore: it does not stop at all.
        import signal, time
        def term(signum, frame):
            print(f"probe {rank} got SIGTERM", flush=True)
            if os.environ["PROBE_SIGNALS"] != "ignore":
                time.sleep(0.5)
                sys.exit(143)
        signal.signal(signal.SIGTERM, term)
        print(f"probe {rank} ready", flush=True)
        for _ in range(600):
            time.sleep(0.1)
    if rank == "0" and "--out" in args:
        out = args[args.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            for i, loss in enumerate(json.loads(os.environ["PROBE_LOSSES"])):
                f.write(json.dumps({"step": i + 1, "loss": loss}) + "\\n")
""")


def launch(tmp_path, *args, losses=(), xla_flags=None, start=False, **env_extra):
    """Run the launcher with the probe (``start``: return the running ``Popen``)."""
    pkg = tmp_path / "probe"
    pkg.mkdir(exist_ok=True)
    (pkg / "__main__.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHON=sys.executable, LAUNCH_MODULE="probe", LAUNCH_PORT="1", PROBE_LOSSES=json.dumps(list(losses)),
               PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", **env_extra)
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    cmd = ["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), *map(str, args)]
    if start:
        return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def argv_of(proc, rank):
    line = next(l for l in proc.stdout.splitlines() if l.startswith(f"probe {rank} argv "))
    return json.loads(line.split(" argv ", 1)[1])


def test_devices_are_split_so_n_processes_make_one_8_device_mesh(tmp_path):
    p = launch(tmp_path, 2, "--config", "c.yaml")
    assert p.returncode == 0, p.stderr
    assert "launch_local: 2 processes x 4 simulated CPU devices = 8 devices" in p.stdout
    assert argv_of(p, 0) == argv_of(p, 1) == ["--set", "mesh.simulate_devices=4", "--config", "c.yaml"]
    # gloo's connection lines are gone from both streams; everything else comes through.
    assert "[Gloo]" not in p.stdout + p.stderr and "peer ranks" not in p.stdout + p.stderr
    assert argv_of(launch(tmp_path, 8), 7)[:2] == ["--set", "mesh.simulate_devices=1"]


def test_uneven_split_is_refused_unless_the_count_is_given(tmp_path):
    p = launch(tmp_path, 3)
    assert p.returncode == 2 and "--devices-per-process" in p.stderr and "probe" not in p.stdout
    p = launch(tmp_path, 3, "--devices-per-process", 2, "x=1")
    assert p.returncode == 0 and argv_of(p, 2) == ["--set", "mesh.simulate_devices=2", "x=1"]
    # The user's own count wins (train args or XLA_FLAGS): nothing added.
    assert argv_of(launch(tmp_path, 3, "--set", "mesh.simulate_devices=2"), 0) == ["--set", "mesh.simulate_devices=2"]
    p = launch(tmp_path, 3, xla_flags="--xla_force_host_platform_device_count=2")
    assert p.returncode == 0 and argv_of(p, 0) == []


def test_check_against_reports_match_and_first_difference(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                               for i, x in enumerate([5.5, 3.25, 2.0625])))
    p = launch(tmp_path, 2, "--out", tmp_path / "a", "--check-against", ref, losses=[5.5, 3.25, 2.0625])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == f"check against {ref}: losses match bit for bit (3 steps)"
    p = launch(tmp_path, 2, "--check-against", ref, "--out", tmp_path / "b", losses=[5.5, 3.2500000000000004, 2.0])
    assert p.returncode == 1
    assert "losses differ first at step 2: 3.2500000000000004 here, 3.25 in" in p.stdout
    p = launch(tmp_path, 2, "--check-against", tmp_path / "nowhere", "--out", tmp_path / "c")
    assert p.returncode == 2 and "no metrics.jsonl" in p.stderr and "probe" not in p.stdout


def _when_ready(p, n):
    """Wait until the ``n`` probes of the launcher ``p`` say they are ready."""
    ready = 0
    while ready < n:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        ready += line.startswith("probe ") and line.strip().endswith("ready")


def test_a_signal_to_the_launcher_reaches_every_process_and_it_waits_for_them(tmp_path):
    import signal
    import time

    # The first SIGTERM (or SIGINT): passed on to the processes as SIGTERM; they save and exit
    # 143, and the launcher waits for them instead of killing them 10 s later.
    p = launch(tmp_path, 2, start=True, PROBE_SIGNALS="save")
    _when_ready(p, 2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert sorted(line for line in out.splitlines() if "SIGTERM" in line) == ["probe 0 got SIGTERM", "probe 1 got SIGTERM"]
    assert err.strip().splitlines() == [
        "launch_local: SIGTERM: asking the processes to save their step and stop (again: kill them now)",
        "launch_local: the 2 processes stopped on a signal (status 143); rerun the same command to resume"]
    # A second one kills processes that do not stop, at once.
    p = launch(tmp_path, 2, start=True, PROBE_SIGNALS="ignore")
    _when_ready(p, 2)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and time.monotonic() - t0 < 5, err
    assert err.strip().splitlines()[-1] == "launch_local: SIGINT again: killing the processes"


def test_compare_losses(tmp_path):
    def write(name, recs):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return str(path)

    a = write("a", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": None}, {"step": 3, "loss": 0.1 + 0.2}])
    assert runs.compare_losses(a, write("b", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": None},
                                              {"step": 3, "loss": 0.30000000000000004}])) == (
        True, "losses match bit for bit (3 steps)")
    same, msg = runs.compare_losses(a, write("c", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": None},
                                                   {"step": 3, "loss": 0.3}]))
    assert not same and msg.startswith("losses differ first at step 3: 0.30000000000000004 here, 0.3 in")
    same, msg = runs.compare_losses(a, write("d", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]))
    assert not same and "this run has 3 steps (1..3)" in msg and "has 2 steps (1..2)" in msg
    same, msg = runs.compare_losses(a, write("e", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
                                                   {"step": 3, "loss": 0.1 + 0.2}]))
    assert not same and "step 2: None here, 2.0" in msg


def test_metrics_path_follows_out_and_config(tmp_path):
    assert runs.metrics_path(["--out", "x/y"]) == os.path.join("x/y", "metrics.jsonl")
    assert runs.metrics_path(["--config", os.path.join(ROOT, "train", "configs", "tiny.yaml")]) == os.path.join(
        "runs/tiny", "metrics.jsonl")
    assert runs.metrics_path(["--set", "train.out_dir=z"]) == os.path.join("z", "metrics.jsonl")


def test_the_slurm_script_passes_the_config_once_and_the_overrides_after_its_own(tmp_path):
    """``sbatch scripts/slurm_gb200.sbatch [--config FILE] [--set k=v ...]`` as its header says,
    run with stand-ins for SLURM's commands and Python: ``python -m train`` gets one
    ``--config`` (the argument's, else ``$CONFIG``, else the default) and the user's overrides
    after the script's mesh ones."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {
        "scontrol": "echo node1",
        # srun: drop its options, run the command (the GPU check passes).
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n[ "$1 $3" = "python --check-gpu" ] && exit 0\nexec "$@"',
        "python": f'if [ "$2" = train ]; then shift 2; exec {sys.executable} -c '
                  '"import json, sys; print(json.dumps(sys.argv[1:]))" "$@"; fi\necho --xla_flag=1',
    }
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_NNODES": "36", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node[1-36]", "SLURM_NTASKS": "144", "SLURM_PROCID": "0"}
    env.pop("CONFIG", None)

    def train_argv(*args, **extra):
        out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_gb200.sbatch"), *args], cwd=ROOT,
                             env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    argv = train_argv("--config", "train/configs/small.yaml", "--set", "train.steps=5")
    assert argv.count("--config") == 1 and argv[argv.index("--config") + 1] == "train/configs/small.yaml"
    assert argv[-2:] == ["--set", "train.steps=5"] and "mesh.racks=2" in argv
    assert train_argv("--config=a.yaml")[:2] == ["--config", "a.yaml"]
    assert train_argv(CONFIG="b.yaml")[:2] == ["--config", "b.yaml"]
    assert train_argv()[:2] == ["--config", "train/configs/default.yaml"]
