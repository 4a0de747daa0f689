"""Faults and bad input: non-finite gradients (skip or stop), bad configs, data and checkpoints.

Non-finite gradients come from the loop's fault-injection hook (``loop.run(...,
inject_nonfinite={step: value})``, ``TRAIN_FAULT_NONFINITE`` for the CLI), which multiplies
that step's loss by NaN or Inf: tokens are integers, so there is no other way in.

CLI rows that need no separate process run ``train.__main__.main`` in this process (its exit
status and stderr are the CLI's), sharing the compiled tiny job through the compile cache.
"""

import json
import math
import threading
import time

import pytest

from train import checkpoint as ckpt_lib
from train import loop
from train import step as step_lib

from conftest import JOB, TINY, job, job_worker, main_here, mesh_of, sets

# The job's programs: on the worker that compiles them for the checkpoint tests.
pytestmark = job_worker


def strict_json_lines(path):
    """Records of a JSONL file, refusing NaN/Infinity (not JSON) like a strict reader."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_nonfinite_steps_are_skipped_and_training_continues(tmp_path, capsys):
    cfg = job()
    snaps = {}

    def on_step(step, params, opt_state, it):
        snaps[step] = ckpt_lib.host_arrays(params, opt_state)

    r = loop.run(cfg, mesh_of(cfg, 8), str(tmp_path), progress=True,
                 on_step=on_step, inject_nonfinite={3: float("nan"), 5: float("inf")})
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
    trainer, _, _ = step_lib.build(cfg, mesh_of(cfg, 8), init=False)
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
        (["--set", f"checkpoint.dir={a_file}"], "checkpoint error:", "checkpoint.dir"),
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


def test_divergence_stops_with_exit_3_naming_the_step(tmp_path, capfd, monkeypatch):
    # Diverged: every step from 2 on has non-finite gradients (optim.lr=1e6 does the same,
    # in a program of its own). It used to run to the end with exit 0.
    monkeypatch.setenv("TRAIN_FAULT_NONFINITE", "2:nan,3:inf,4:nan,5:nan,6:nan")
    out = tmp_path / "out"
    rc, _, err = main_here([*sets(JOB), "--set", "nvfp4.max_skipped_in_a_row=3", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                            "--set", "checkpoint.every=1", "--out", str(out)], capfd)
    assert rc == 3, err
    assert len(err) == 1 and err[0].startswith("error: step 4: 3 steps in a row skipped for non-finite gradients"), err
    recs = strict_json_lines(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and [x["loss"] is None for x in recs] == [False, True, True, True]
    # The diverged step is not checkpointed.
    assert ckpt_lib.Checkpointer(str(tmp_path / "ck")).all_steps() == [1, 2, 3]


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_dir_becoming_read_only_is_one_line_exit_5(tmp_path, async_save, capfd, monkeypatch):
    # It used to end in a 56-line orbax traceback and exit 1, and a failed asynchronous save
    # left orbax threads waiting for a directory-creation signal that never came (5 minutes at
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
        nv.export_nvfp4(tree, str(other), overwrite=True)
    assert (other / "cat.jpg").read_text() == "precious"
    nv.export_nvfp4(tree, str(tmp_path / "exp"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        nv.export_nvfp4(tree, str(tmp_path / "exp"))
    nv.export_nvfp4({"v": nv.quantize(jnp.ones((32, 32)))}, str(tmp_path / "exp"), overwrite=True)
    assert list(nv.load_nvfp4(str(tmp_path / "exp"))) == ["v"]
