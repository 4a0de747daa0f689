"""Faults and bad input: non-finite gradients (skip or stop), bad configs, data and checkpoints.

Non-finite gradients come from fault injection (:mod:`train.faults`: ``TRAIN_FAULT_NONFINITE``
for the CLI, ``Faults(nonfinite={step: value}).hooks()`` in ``loop.run``), which multiplies
that step's loss by NaN or Inf: tokens are integers, so there is no other way in.

CLI rows that need no separate process run ``train.__main__.main`` in this process (its exit
status and stderr are the CLI's), sharing the compiled tiny job through the compile cache.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from train import checkpoint as ckpt_lib
from train import faults
from train import loop
from train import programs

from conftest import JOB, ROOT, TINY, job, job_worker, main_here, mesh_of, sets

# The job's programs: on the worker that compiles them for the checkpoint tests.
pytestmark = job_worker


def strict_json_lines(path):
    """Records of a JSONL file, refusing NaN/Infinity (not JSON) like a strict reader."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_training_continues(tmp_path, capsys):
    cfg = job()
    snaps = {}

    def on_step(step, params, opt_state, it):
        snaps[step] = ckpt_lib.host_arrays(params, opt_state)

    hooks = dataclasses.replace(faults.Faults(nonfinite={3: float("nan"), 5: float("inf")}).hooks(), after_step=on_step)
    r = loop.run(cfg, mesh_of(cfg, 8), str(tmp_path), progress=True, hooks=hooks)
    for bad in (3, 5):
        before, after = snaps[bad - 1], snaps[bad]
        changed = [k for k in before if before[k].tobytes() != after[k].tobytes()]
        # Params, masters, optimizer moments and counts are bit-identical; only the count moves.
        assert changed == ["opt_state/skipped"], changed
        assert int(after["opt_state/skipped"]) == int(before["opt_state/skipped"]) + 1
    for good in (2, 4, 6):
        assert snaps[good]["opt_state/master/blocks/mlp/up/kernel"].tobytes() != \
            snaps[good - 1]["opt_state/master/blocks/mlp/up/kernel"].tobytes()
    # Strict JSON: the non-finite losses of the skipped steps are null (they were bare NaN).
    recs = strict_json_lines(tmp_path / "metrics.jsonl")
    assert [x["skipped"] for x in recs] == [0, 0, 1, 1, 2, 2]
    assert recs[2]["loss"] is None and recs[4]["loss"] is None
    assert math.isnan(r["history"][2]) and not math.isfinite(r["history"][4])
    assert all(math.isfinite(recs[i]["loss"]) for i in (0, 1, 3, 5))
    assert recs[5]["loss"] < recs[0]["loss"]
    assert r["skipped_steps"] == 2
    assert "skipped=2" in capsys.readouterr().err  # the progress bar's postfix


def test_nonfinite_error_stops_the_cli_and_keeps_the_last_checkpoint(tmp_path, capfd, monkeypatch):
    ck, out = tmp_path / "ck", tmp_path / "out"
    monkeypatch.setenv("TRAIN_FAULT_NONFINITE", "3:nan")
    rc, _, err = main_here([*sets(JOB), "--set", "nvfp4.nonfinite=error", "--set", f"checkpoint.dir={ck}",
                            "--set", "checkpoint.every=2", "--out", str(out)], capfd)
    assert rc == 3, err
    # The line names the step.
    assert len(err) == 1 and err[0].startswith("error: step 3: master_weights: non-finite gradients"), err
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2]
    # Only the checkpoint before the bad step exists, and it restores (finite, step 2).
    cfg = job()
    trainer, _, _ = programs.build(cfg, mesh_of(cfg, 8), init=False)
    c = ckpt_lib.Checkpointer(str(ck))
    assert c.all_steps() == [2]
    r = c.restore(2, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings, trainer.state_shardings)
    assert r.step == 2 and r.data_state["step"] == 2
    # A damaged checkpoint is refused with one line.
    meta = next(p for p in (ck / "2" / "meta").iterdir() if p.is_file())
    meta.write_text("{not json")
    with pytest.raises(ckpt_lib.CheckpointError, match="corrupt: file meta/metadata does not match its sha256") as e:
        ckpt_lib.Checkpointer(str(ck)).restore(2, trainer.abstract_params, trainer.abstract_state,
                                               trainer.param_shardings, trainer.state_shardings)
    assert "\n" not in str(e.value)


def test_bad_inputs_are_one_line_errors_that_write_nothing(tmp_path, capfd):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dup = tmp_path / "dup.yaml"
    dup.write_text(f"base: {TINY}\ntrain:\n  steps: 6\n  steps: 60\n")
    cases = [
        # A path that the (default, markov) source would ignore; a key given twice.
        (["--set", f"data.path={a_file}"], "config error:", "does not read a file"),
        (["--config", str(dup)], "config error:", "duplicate key 'steps' on line 4 (first on line 3)"),
        (["--set", "mesh.tensor=3"], "config error:", "mesh.tensor=3"),
        (["--set", "mesh.data=16"], "config error:", "mesh.data=16"),
        (["--set", "data.source=file", "--set", f"data.path={tmp_path}"], "config error:", "not a regular file"),
        (["--set", "data.source=file", "--set", f"data.path={empty}"], "config error:", "file is empty"),
        (["--set", "checkpoint.keep=0"], "config error:", "checkpoint.keep"),
        (["--set", f"checkpoint.dir={a_file}"], "error:", "checkpoint.dir"),
    ]
    for i, (args, prefix, needle) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, _, err = main_here([*sets(JOB), *args, "--out", str(out)], capfd)
        assert rc == 2, (args, err)
        assert len(err) == 1 and err[0].startswith(prefix) and needle in err[0], (args, err)
        assert not out.exists(), args
    assert a_file.read_text() == "x"


def test_fault_hook_env_is_validated(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("TRAIN_FAULT_NONFINITE", "three")
    rc, _, err = main_here([*sets(JOB), "--out", str(tmp_path / "o")], capfd)
    assert rc == 2 and len(err) == 1 and "TRAIN_FAULT_NONFINITE" in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_run_without_faults_does_not_load_the_fault_module(tmp_path, capfd, monkeypatch):
    # Fault injection is not part of a normal run: the CLI imports train.faults only when a
    # TRAIN_FAULT_* variable is set (its step with a loss multiplier is never built either).
    import train

    for name in [n for n in os.environ if n.startswith("TRAIN_FAULT_")]:
        monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, "train.faults")
    monkeypatch.delattr(train, "faults")
    rc, _, err = main_here([*sets(JOB), "--out", str(tmp_path / "o")], capfd)
    assert rc == 0, err
    assert "train.faults" not in sys.modules


def test_divergence_stops_with_exit_3_naming_the_step(tmp_path, capfd, monkeypatch):
    # Diverged: every step from 2 on has non-finite gradients (optim.lr=1e6 does the same,
    # in a program of its own). Unchecked, such a run goes to the end with exit 0.
    monkeypatch.setenv("TRAIN_FAULT_NONFINITE", "2:nan,3:inf,4:nan,5:nan,6:nan")
    out = tmp_path / "out"
    rc, _, err = main_here([*sets(JOB), "--set", "nvfp4.max_skipped_in_a_row=3", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                            "--set", "checkpoint.every=1", "--out", str(out)], capfd)
    assert rc == 3, err
    assert len(err) == 1 and err[0].startswith("error: step 4: 3 steps in a row non-finite (gradients skipped or loss nan)"), err
    recs = strict_json_lines(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and [x["loss"] is None for x in recs] == [False, True, True, True]
    # The diverged step is not checkpointed.
    assert ckpt_lib.Checkpointer(str(tmp_path / "ck")).all_steps() == [1, 2, 3]


@pytest.mark.slow
def test_a_resumed_run_counts_non_finite_steps_in_a_row_from_its_checkpoint(tmp_path, capfd, monkeypatch):
    # The count restarted at 0 on resume: a run stopped inside a non-finite streak went on past the limit, and
    # one stopped just before a short streak at its end was taken for "every step non-finite" (exit 3).
    for nonfinite, limit, want in (("3:nan,4:nan,5:nan", "3", 3), ("5:nan,6:nan", "10", 0)):
        monkeypatch.setenv("TRAIN_FAULT_NONFINITE", nonfinite)
        ck = tmp_path / f"ck{want}"
        args = [*sets(JOB), "--set", f"nvfp4.max_skipped_in_a_row={limit}", "--set", f"checkpoint.dir={ck}",
                "--set", "checkpoint.every=2", "--out", str(tmp_path / f"out{want}")]
        monkeypatch.setenv("TRAIN_FAULT_SIGTERM", "3")  # stopped at step 4
        assert main_here(args, capfd)[0] == 143
        monkeypatch.delenv("TRAIN_FAULT_SIGTERM")
        rc, _, err = main_here(args, capfd)
        assert rc == want, err  # as the run would end unstopped
    assert err == []


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_dir_becoming_read_only_is_one_line_exit_5(tmp_path, async_save, capfd, monkeypatch):
    # Unhandled, it ends in a 56-line orbax traceback and exit 1, and a failed asynchronous save
    # leaves orbax threads waiting for a directory-creation signal that never comes (5 minutes at
    # the process's exit). The fault refuses new checkpoints in this run's directory only, so
    # the CLI runs in this process; its checkpointer leaves no thread behind either way.
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = [*sets(JOB), "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2", "--set",
            f"checkpoint.async_save={str(async_save).lower()}", "--out", str(out)]
    before = set(threading.enumerate())
    t0 = time.monotonic()
    monkeypatch.setenv("TRAIN_FAULT_READONLY", "2")
    rc, _, err = main_here(args, capfd)
    assert rc == 5, err
    assert len(err) == 1 and err[0].startswith("checkpoint error: cannot write checkpoint 4 to"), err
    assert "Permission denied" in err[0] and "the checkpoints before it are intact" in err[0]
    assert time.monotonic() - t0 < 120
    # orbax's background threads of this save (its _SignalingThread: wait for a signal, then
    # write) have ended, or end within seconds; a thread still waiting for a signal would hold
    # the process for minutes at its exit. (Threads of an earlier test's asynchronous save may
    # finish during this one: hence the grace period.)
    waiting = [t for t in set(threading.enumerate()) - before if type(t).__name__ == "_SignalingThread"]
    deadline = time.monotonic() + 10
    for t in waiting:
        threading.Thread.join(t, max(0.0, deadline - time.monotonic()))  # not its join(): that re-raises
    assert not [t.name for t in waiting if t.is_alive()]
    # Nothing lost: the step-2 checkpoint is whole and verified, the metrics reach step 4.
    c = ckpt_lib.Checkpointer(str(ck))
    assert c.all_steps() == [2]
    c.verify(2)
    assert [x["step"] for x in strict_json_lines(out / "metrics.jsonl")][:4] == [1, 2, 3, 4]


def test_export_refuses_folders_it_did_not_write(tmp_path, capfd):
    import jax.numpy as jnp

    import jax_nvfp4 as nv

    ck, out, other = tmp_path / "ck", tmp_path / "out", tmp_path / "photos"
    for d, name in ((ck, "2"), (out, "metrics.jsonl"), (other, "cat.jpg")):
        d.mkdir()
        (d / name).write_text("precious")
    before = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [(ck, "checkpoint.dir"), (out, "output directory"), (other, "not a previous NVFP4 export"),
             (ck / "sub", "checkpoint.dir"), (tmp_path, "output directory")]
    for target, needle in cases:
        rc, _, err = main_here([*sets(JOB), "--set", f"checkpoint.dir={ck}", "--out", str(out), "--export", str(target)], capfd)
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: --export {target}:") and needle in err[0], err
    assert {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == before
    # The library refuses too, even with overwrite=True; a previous export is replaced.
    tree = {"w": nv.quantize(jnp.ones((16, 32)))}
    with pytest.raises(FileExistsError, match="not an NVFP4 export"):
        nv.export.export_nvfp4(tree, str(other), overwrite=True)
    assert (other / "cat.jpg").read_text() == "precious"
    nv.export.export_nvfp4(tree, str(tmp_path / "exp"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        nv.export.export_nvfp4(tree, str(tmp_path / "exp"))
    nv.export.export_nvfp4({"v": nv.quantize(jnp.ones((32, 32)))}, str(tmp_path / "exp"), overwrite=True)
    assert list(nv.export.load_nvfp4(str(tmp_path / "exp"))) == ["v"]


# ----------------------------------------------------------------------------- non-finite losses
@pytest.mark.parametrize("bad,overrides,needle", [
    ({2, 3, 4}, ("nvfp4.max_skipped_in_a_row=3",), "step 4: 3 steps in a row non-finite (gradients skipped or loss nan)"),
    # A run shorter than the limit whose every step was non-finite has diverged too.
    ({1, 2, 3, 4, 5, 6}, (), "step 6: 6 steps in a row non-finite"),
    ({2}, ("nvfp4.nonfinite=error",), "step 2: non-finite loss (nan) (nvfp4.nonfinite=error)"),
])
def test_a_nonfinite_loss_counts_as_a_nonfinite_step(tmp_path, bad, overrides, needle):
    # Out-of-vocabulary tokens gave a NaN loss whose update went through (finite gradients):
    # 0 skipped steps and exit 0. The host loop counts a non-finite loss as a non-finite step
    # whatever the step did with it; here the step's loss is replaced after the fact.
    import numpy as np

    def nan_loss_step(trainer, step, *args):
        params, opt_state, m = trainer.step_fn(*args)
        return params, opt_state, (dict(m, loss=np.float32("nan")) if step in bad else m)

    cfg = job(*overrides)
    with pytest.raises(FloatingPointError) as e:
        loop.run(cfg, mesh_of(cfg, 8), str(tmp_path), progress=False, hooks=loop.StepHooks(run_step=nan_loss_step))
    assert str(e.value).startswith(needle), str(e.value)
    recs = strict_json_lines(tmp_path / "metrics.jsonl")
    assert [x["skipped"] for x in recs] == [0] * len(recs)  # the updates went through


# ----------------------------------------------------------------------------- signals
def test_sigterm_saves_the_step_and_the_resume_is_bitwise_equal(tmp_path, capfd, monkeypatch, job_run):
    # SIGTERM (what SLURM sends at preemption or its time limit) killed the run silently (exit
    # -15), losing every step since the last periodic checkpoint.
    import threading

    assert threading.current_thread() is threading.main_thread()  # the CLI's handlers need it
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = [*sets(JOB), "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2", "--set", "train.eval_every=2",
            "--out", str(out)]
    monkeypatch.setenv("TRAIN_FAULT_SIGTERM", "3")  # a real SIGTERM to this process after step 3
    rc, _, err = main_here(args, capfd)
    assert rc == 143, err
    assert err == ["stopped at step 4 by SIGTERM; checkpoint saved; rerun the same command to resume"]
    assert ckpt_lib.Checkpointer(str(ck)).all_steps() == [2, 4]
    assert [x["step"] for x in strict_json_lines(out / "metrics.jsonl")] == [1, 2, 3, 4]
    monkeypatch.delenv("TRAIN_FAULT_SIGTERM")
    rc, said, err = main_here(args, capfd)
    assert rc == 0 and "resuming from step 4 of 6" in said, err
    # Bit for bit the uninterrupted run: every loss, every evaluation (the one due at the stop was taken before the
    # save: a resume does not take it) and the final state.
    recs = strict_json_lines(out / "metrics.jsonl")
    assert [x["loss"] for x in recs] == job_run["history"]
    assert [x["step"] for x in recs if "val_loss" in x] == [2, 4, 6]
    cfg = job()
    trainer = programs.build(cfg, mesh_of(cfg, 8), init=False)[0]
    c = ckpt_lib.Checkpointer(str(ck))
    r = c.restore(6, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings, trainer.state_shardings)
    c.close()
    got, want = ckpt_lib.host_arrays(r.params, r.opt_state), ckpt_lib.host_arrays(job_run["params"], job_run["opt_state"])
    assert not [k for k in want if got[k].tobytes() != want[k].tobytes()]
    assert not list(out.glob(".*")) and not list(ck.glob(".*"))  # the locks are gone


def test_ctrl_c_during_an_async_save_saves_and_leaves_no_temporary_folder(tmp_path, capfd, monkeypatch):
    # Ctrl-C during training or a save: a 34-52-line traceback, nothing saved, a tmp folder left.
    ck, out = tmp_path / "ck", tmp_path / "out"
    monkeypatch.setenv("TRAIN_FAULT_SIGINT", "2")  # while the asynchronous save of step 2 is written
    rc, _, err = main_here([*sets(JOB), "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2",
                            "--set", "checkpoint.async_save=true", "--out", str(out)], capfd)
    assert rc == 130, err
    assert err == ["stopped at step 3 by SIGINT; checkpoint saved; rerun the same command to resume"]
    c = ckpt_lib.Checkpointer(str(ck))
    assert c.all_steps() == [2, 3] and sorted(os.listdir(ck)) == ["2", "3"]
    c.verify(2)
    c.verify(3)


SECOND_SIGNAL = """
import os, signal, sys, time
from train.preemption import Preemption
p = Preemption().install()
os.kill(os.getpid(), signal.SIGTERM)
print("first:", p.signum == signal.SIGTERM, p.should_stop(1), flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("still running", flush=True)
"""


def test_a_second_signal_exits_at_once():
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert time.monotonic() - t0 < 20 and p.returncode == 130, (p.returncode, p.stderr)
    assert p.stdout == "first: True True\n"
    assert p.stderr.strip() == ("second SIGINT: exiting at once; the checkpoint being written, if any, is abandoned "
                                "(the earlier ones are intact)")


# ----------------------------------------------------------------------------- output folders
@pytest.mark.slow
def test_two_runs_on_the_same_folders_one_trains_the_other_exits_2(tmp_path):
    # Unlocked, both run: one exits 5, the other 0, and the folder mixes the config of one
    # seed, the metrics of both and checkpoints of both.
    import signal

    out, ck = tmp_path / "out", tmp_path / "ck"
    args = [sys.executable, "-m", "train", "--config", TINY, "--no-progress", *sets(JOB), "--out", str(out),
            "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2"]
    t0 = time.monotonic()
    procs = {seed: subprocess.Popen([*args, "--set", f"data.seed={seed}"], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for seed in (0, 1)}
    try:
        while all(p.poll() is None for p in procs.values()) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        t_loser = time.monotonic() - t0
        loser = next(seed for seed, p in procs.items() if p.poll() is not None)
        winner = 1 - loser
        # The winner trains; once it is, a SIGTERM from outside ends it early (its step saved).
        said = []
        while not said or not said[-1].startswith("nvfp4 weights: compiled"):
            said.append(procs[winner].stdout.readline())
            assert said[-1], (said, procs[winner].stderr.read())
        procs[winner].send_signal(signal.SIGTERM)
        outs = {seed: p.communicate(timeout=120) for seed, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert procs[loser].returncode == 2 and t_loser < 60, outs[loser]
    err = outs[loser][1].strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {out} is in use by another run (pid "
                                               f"{procs[winner].pid} on "), err
    assert err[0].endswith("refusing to share it (nothing written)") and "compiling" not in outs[loser][0]
    assert procs[winner].returncode == 143, outs[winner]
    stop = outs[winner][1].strip().splitlines()[-1]
    assert stop.startswith("stopped at step ") and stop.endswith(" by SIGTERM; checkpoint saved; rerun the same "
                                                                 "command to resume"), stop
    n = int(stop.split()[3])
    # One run's files only: the winner's config, metrics and checkpoints.
    assert f"seed: {winner}" in (out / "config.yaml").read_text().split("data:")[1].split("mesh:")[0]
    assert [x["step"] for x in strict_json_lines(out / "metrics.jsonl")] == list(range(1, n + 1))
    c = ckpt_lib.Checkpointer(str(ck))
    assert c.all_steps()[-1] == n and all(c.read_meta(s)["run"]["data.seed"] == winner for s in c.all_steps())
    assert sorted(os.listdir(out)) == ["config.yaml", "metrics.jsonl"]


def test_output_collisions_and_bad_locations_are_refused_before_training(tmp_path, capfd):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    x, out = tmp_path / "x", tmp_path / "out"
    cases = [
        # Trained fully, then a traceback, exit 1, no summary (the last left a half-written export).
        (["--compare", "bf16", "--export-hf", str(x), "--out", str(x)],
         f"error: --export-hf {x}: would replace or sit in the run's output directory (--out) {x}"),
        (["--export", str(x / "bf16"), "--export-hf", str(x), "--out", str(out)],
         f"error: --export {x / 'bf16'} and --export-hf {x}: one would hold the other"),
        (["--compare", "bf16", "--export", str(out / "bf16" / "w"), "--out", str(out)],
         "would replace or sit in the bf16 run's output directory (--out/bf16)"),
        (["--export-hf", str(x), "--set", "model.d_model=40", "--out", str(out)],
         "config error: --export-hf (nvfp4): export_hf: blocks/attn/"),
        # Accepted: the export inside the run's folder, against what the README says.
        (["--export-hf", str(out / "hf"), "--out", str(out)],
         f"error: --export-hf {out / 'hf'}: would replace or sit in the run's output directory (--out)"),
        # A traceback after compiling.
        (["--out", str(a_file)], f"error: --out {a_file}: exists and is not a folder"),
        (["--out", str(a_file / "run")], f"error: --out {a_file / 'run'}: cannot create it: Not a directory"),
        # Found only after training (exit 5, the weights lost): an export folder that cannot be made.
        (["--export-hf", str(a_file / "hf"), "--out", str(out)],
         f"error: --export-hf {a_file / 'hf'}: cannot create it: {a_file} is not a folder; nothing written"),
        (["--export", str(a_file / "w"), "--out", str(out)], f"error: --export {a_file / 'w'}: cannot create it"),
        # Trained bf16 twice and reported a 0.0000 NVFP4-bf16 gap.
        (["--compare", "bf16", "--set", "nvfp4.weights=bf16", "--out", str(out)],
         "config error: --compare bf16 trains a bf16 run beside the NVFP4 one, but nvfp4.weights=bf16"),
        (["--export-hf", str(x), "--calibrate", "2", "--set", "nvfp4.weights=bf16", "--out", str(out)],
         "config error: --calibrate and --hf-format shape the NVFP4 export of --export-hf, but nvfp4.weights=bf16"),
    ]
    for args, needle in cases:
        rc, said, err = main_here([*sets(JOB), *args], capfd)
        assert rc == 2 and len(err) == 1 and needle in err[0], (args, err)
        assert "compiling" not in said
    rc, _, err = main_here([*sets(JOB), "--export-hf", str(x), "--set", "model.d_model=40", "--out", str(out)], capfd)
    assert "a kernel with 40 input features: compressed-tensors NVFP4 needs a multiple of 16" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["a_file"] and a_file.read_text() == "x"


def test_a_full_file_system_mid_run_is_one_line_exit_5(tmp_path, capfd):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every write: "No space left on device"
    rc, _, err = main_here([*sets(JOB), "--out", str(out)], capfd)
    assert rc == 5, err
    assert err == [f"error: cannot write {out / 'metrics.jsonl'}: No space left on device; the checkpoints written "
                   "before are intact"]


@pytest.mark.slow
def test_a_rerun_into_a_used_out_refuses_unless_it_resumes(tmp_path, capfd):
    """An --out holding an earlier run's files is refused when the run would not resume it (its
    old summary.json and loss.png would stay beside the new run's config and metrics); with
    a checkpoint to resume from, the run goes on in its own folder."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.json", "loss.png", "metrics.jsonl"):
        (out / name).write_text("earlier")
    rc, said, err = main_here([*sets(JOB), "--out", str(out)], capfd)
    assert rc == 2 and len(err) == 1 and "holds an earlier run's files (metrics.jsonl, loss.png, summary.json)" in err[0], err
    assert sorted(os.listdir(out)) == ["loss.png", "metrics.jsonl", "summary.json"]
    assert all((out / n).read_text() == "earlier" for n in os.listdir(out)) and "compiling" not in said
    # The compare run's folder too.
    (out / "bf16").mkdir()
    rc, _, err = main_here([*sets(JOB), "--out", str(tmp_path / "new"), "--compare", "bf16"], capfd)
    assert rc == 0, err
    rc, _, err = main_here([*sets(JOB), "--out", str(tmp_path / "new"), "--compare", "bf16"], capfd)
    assert rc == 2 and "holds an earlier run's files" in err[0], err



def test_a_token_file_with_ids_past_its_sidecars_vocabulary_is_named(tmp_path, capfd):
    """A sidecar that claims too small a vocabulary: the first batch holding an id past it is a
    one-line error naming the id (unchecked, it trains on NaN losses and stops as diverged, exit 3)."""
    import numpy as np

    tokens = np.arange(4000, dtype=np.uint16) % 200
    path = tmp_path / "toks.bin"
    tokens.tofile(path)
    (tmp_path / "toks.bin.json").write_text(json.dumps(
        {"format": "jax_nvfp4.tokens", "version": 2, "dtype": "uint16", "vocab": 150, "tokens": len(tokens)}))
    rc, _, err = main_here([*sets(JOB), "--set", "data.source=tokens", "--set", f"data.path={path}",
                            "--out", str(tmp_path / "out")], capfd)
    assert rc == 2 and len(err) == 1 and "is past the vocabulary of 150 its sidecar declares" in err[0], err
    assert "token id 1" in err[0]
    # It stopped before its first step: the same --out takes the corrected file's run.
    assert (tmp_path / "out" / "metrics.jsonl").stat().st_size == 0
    (tmp_path / "toks.bin.json").write_text(json.dumps(
        {"format": "jax_nvfp4.tokens", "version": 2, "dtype": "uint16", "vocab": 200, "tokens": len(tokens)}))
    # Its validation split (1%: 40 tokens) holds one window: the evaluation's rows repeat it, said once.
    rc, _, err = main_here([*sets(JOB), "--set", "data.source=tokens", "--set", f"data.path={path}",
                            "--set", "data.val_fraction=0.01", "--set", "train.eval_every=6",
                            "--out", str(tmp_path / "out")], capfd)
    assert rc == 0, err
    assert err.count("notice: the val tokens hold 1 window(s) of model.seq_len + 1 tokens; an evaluation reads 96 "
                     "rows, so they repeat") == 1, err
