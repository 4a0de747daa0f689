"""Checkpoints (train.checkpoint) and NVFP4 export (jax_nvfp4.export).

One tiny job (widths divisible by 16 x 6, batch divisible by 8, 6, 4 and 1) is trained once
uninterrupted and once stopped after step 3 and resumed from its step-2 checkpoint; the
resumed run's checkpoints then restore onto other meshes and feed the export tests.
"""

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import checkpoint as nvck
from train import checkpoint as ckpt_lib
from train import data as data_lib
from train import loop
from train import programs
from train import optimizer as optimizer_lib
from train.model import from_config

from conftest import JOB, ROOT, job, job_worker, main_here, mesh_of, sets, xla_flags

# One pytest-xdist worker runs this module (its module fixtures are computed once) and the
# other users of the job's programs.
pytestmark = job_worker


def same_bytes(a: dict, b: dict, keys=None):
    keys = sorted(a) if keys is None else keys
    assert sorted(a) == sorted(b)
    bad = [k for k in keys if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()]
    assert not bad, bad[:5]


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def reference(job_run):
    return dict(job_run, host=ckpt_lib.host_arrays(job_run["params"], job_run["opt_state"]))


@pytest.fixture(scope="module")
def resumed(reference, tmp_path_factory):
    base = tmp_path_factory.mktemp("resumed")
    ck, out = base / "ck", base / "out"
    cfg = job(f"checkpoint.dir={ck}", "checkpoint.every=2", "checkpoint.async_save=true")

    def stop_after_3(step, *_):
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        loop.run(cfg, mesh_of(cfg, 8), str(out), progress=False, hooks=loop.StepHooks(after_step=stop_after_3))
    steps_after_stop = sorted(int(d) for d in os.listdir(ck) if d.isdigit())
    r = loop.run(cfg, mesh_of(cfg, 8), str(out), progress=False)
    return {"cfg": cfg, "ck": ck, "out": out, "run": r, "steps_after_stop": steps_after_stop}


# ----------------------------------------------------------------------------- resume
def test_resume_is_bit_identical_and_metrics_continue(reference, resumed):
    assert resumed["steps_after_stop"] == [2]
    r = resumed["run"]
    assert r["start_step"] == 2
    recs = [json.loads(line) for line in (resumed["out"] / "metrics.jsonl").read_text().splitlines()]
    # Step 3 of the stopped run was dropped: the file continues from the checkpoint.
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5, 6]
    assert [x["loss"] for x in recs] == reference["history"]
    assert r["history"] == reference["history"]
    # The Markov corpus's exact entropy rate is the floor the run reports (tiny.yaml's 32 states).
    floor = data_lib.make_source(resumed["cfg"].data, resumed["cfg"].model).entropy_rate()
    assert 1.0 < floor < 2.0 and reference["entropy_floor"] == r["entropy_floor"] == floor
    same_bytes(ckpt_lib.host_arrays(r["params"], r["opt_state"]), reference["host"])
    # keep=3 (the default) of the checkpoints at 2, 4, 6.
    assert ckpt_lib.Checkpointer(str(resumed["ck"])).all_steps() == [2, 4, 6]


def test_rerun_after_the_end_trains_nothing(reference, resumed, tmp_path, capsys):
    capsys.readouterr()
    r = loop.run(resumed["cfg"], mesh_of(resumed["cfg"], 8), str(resumed["out"]), progress=False)
    said = capsys.readouterr().out
    assert "is at step 6 = train.steps: the run is already finished, nothing to train" in said
    assert "resuming" not in said
    assert r["start_step"] == 6 and r["history"] == reference["history"]
    assert len((resumed["out"] / "metrics.jsonl").read_text().splitlines()) == 6


def test_a_finished_checkpoint_reopened_into_a_new_out_says_so(resumed, tmp_path, capsys):
    """Reopening a finished checkpoint into a new --out trains nothing; its summary says that
    instead of a training loss of nan."""
    from train import summary as summary_lib
    from train.__main__ import print_summary

    out = tmp_path / "new"
    r = loop.run(resumed["cfg"], mesh_of(resumed["cfg"], 8), str(out), progress=False)
    assert r["history"] == [] and r["start_step"] == 6
    capsys.readouterr()
    print_summary(summary_lib.summarize([r], str(out)), str(out))
    said = capsys.readouterr().out
    assert "no step trained here (the checkpoint was at train.steps=6 already" in said and "nan" not in said, said


def test_a_torn_last_line_of_the_metrics_is_dropped_on_resume(resumed, tmp_path, capsys):
    # A crash in the middle of writing metrics.jsonl leaves a last line that is not JSON: the
    # resume drops it with a notice and continues.
    import shutil

    ck, out = tmp_path / "ck", tmp_path / "out"
    shutil.copytree(resumed["ck"], ck)
    shutil.copytree(resumed["out"], out)
    good = (out / "metrics.jsonl").read_text()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 5.12')
    capsys.readouterr()
    r = loop.run(dataclasses.replace(resumed["cfg"], checkpoint=dataclasses.replace(resumed["cfg"].checkpoint, dir=str(ck))),
                 mesh_of(resumed["cfg"], 8), str(out), progress=False)
    err = capsys.readouterr().err
    assert "metrics.jsonl: dropped its last line, cut off in the middle (a crash while writing it)" in err
    assert r["start_step"] == 6 and (out / "metrics.jsonl").read_text() == good
    # A bad line before the last is not a torn write: refused in one line, the file untouched.
    lines = good.splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:2] + ["{oops\n"] + lines[2:]))
    with pytest.raises(ckpt_lib.CheckpointError, match="line 3 of 7 is not JSON"):
        loop._resume_metrics(str(out / "metrics.jsonl"), 6)
    # A non-finite loss is written as null: it reads back as NaN (None crashed the resumed run's final mean).
    (out / "metrics.jsonl").write_text(good.replace('"loss": ' + good.splitlines()[-1].split('"loss": ')[1].split(",")[0],
                                                    '"loss": null'))
    assert np.isnan(loop._resume_metrics(str(out / "metrics.jsonl"), 6)[-1]["loss"])


def test_a_changed_data_seed_that_allow_change_names_drives_the_training_stream(resumed, tmp_path):
    # The checkpoint's seed was restored for the training batches while validation took the new one.
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(resumed["ck"], ck)
    cfg = job(f"checkpoint.dir={ck}", "train.steps=7", "optim.schedule_steps=6", "data.seed=1",
              "checkpoint.allow_change=[data.seed]")
    r = loop.run(cfg, mesh_of(cfg, 8), str(tmp_path / "out"), progress=False)
    assert r["start_step"] == 6 and r["data_state"] == {"step": 7, "seed": 1}


# ----------------------------------------------------------------------------- reshard
# A step compiles a new program per mesh: take one on the uneven (6) and the tensor mesh.
RACKS = ("mesh.layout=gb200", "mesh.nvl_domain=4")  # 2 racks of 4 on 8 devices


@pytest.mark.parametrize("data,tensor,step,extra", [
    (4, 1, False, ()), pytest.param(6, 1, True, (), marks=pytest.mark.slow), (1, 1, False, ()), (4, 2, True, ()),
    (8, 1, False, RACKS),
    pytest.param(4, 1, True, (*RACKS, "mesh.sharding=hsdp"), marks=pytest.mark.slow),  # hsdp: 4 shards per rack
])
def test_restore_onto_another_mesh(reference, resumed, data, tensor, step, extra):
    cfg = job(f"mesh.data={-1 if extra else data}", f"mesh.tensor={tensor}", *extra)
    mesh = mesh_of(cfg, 8 if extra else data * tensor)
    trainer, _, _ = programs.build(cfg, mesh, init=False)
    ck = ckpt_lib.Checkpointer(str(resumed["ck"]))
    r = ck.restore(6, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings, trainer.state_shardings)
    ck.close()
    assert r.step == 6 and r.data_state == {"step": 6, "seed": 0}
    # Bit-identical params and logical masters / optimizer state, in this mesh's layout.
    same_bytes(ckpt_lib.host_arrays(r.params, r.opt_state), reference["host"])
    got = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, (r.params, r.opt_state)))
    want = jax.tree.leaves((trainer.param_shardings, trainer.state_shardings))
    assert len(got) == len(want) and all(g == w for g, w in zip(got, want))
    masters = jax.tree.leaves(nv.find_state(r.opt_state).master, is_leaf=nv.layout.is_tiled)
    assert all(m.value.shape[-3] % data == 0 and m.layout.n_data == data for m in masters if nv.layout.is_tiled(m))
    if not step:
        return
    # ... and it trains on.
    it = data_lib.make_data_iterator(cfg)
    batch = programs.global_batch(trainer, it.batch_at(6))
    before = np.asarray(nv.find_state(r.opt_state).master["blocks"]["mlp"]["up"]["kernel"].logical())
    params, opt_state, m = trainer.step_fn(r.params, r.opt_state, batch, jax.random.fold_in(r.base_key, 6))
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0
    after = np.asarray(nv.find_state(opt_state).master["blocks"]["mlp"]["up"]["kernel"].logical())
    assert not np.array_equal(before, after)


# ----------------------------------------------------------------------------- refusals
def test_incompatible_checkpoint_is_refused_by_the_cli(resumed, tmp_path, capfd):
    out = tmp_path / "never"
    listing = sorted(os.listdir(resumed["ck"]))
    rc, _, err = main_here([*sets(JOB), "--set", "model.d_model=64", "--set", f"checkpoint.dir={resumed['ck']}",
                            "--out", str(out)], capfd)
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("checkpoint error:"), err
    assert "was trained with model.d_model=96 but this run has model.d_model=64" in err[0]
    assert not out.exists()
    assert sorted(os.listdir(resumed["ck"])) == listing


def test_checkpoint_of_another_optimizer_is_refused(resumed):
    cfg = job("optim.name=sgd")
    trainer, _, _ = programs.build(cfg, mesh_of(cfg, 8), init=False)
    ck = ckpt_lib.Checkpointer(str(resumed["ck"]))
    with pytest.raises(ckpt_lib.CheckpointError, match="does not match this model/optimizer") as e:
        ck.restore(6, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings, trainer.state_shardings)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["master", "amax"])
def test_nonfinite_checkpoint_is_refused(reference, tmp_path, monkeypatch, where):
    """A non-finite state is not saved (no restore would take it), and one on disk (written
    another way) is not restored; both name the leaf."""
    cfg = job()
    mesh = mesh_of(cfg, 8)
    trainer, _, _ = programs.build(cfg, mesh, init=False)
    params, opt_state = reference["params"], reference["opt_state"]
    mw = nv.find_state(opt_state)
    if where == "master":
        m = mw.master["blocks"]["attn"]["q"]["kernel"]
        poisoned = nv.Tiled(m.value.at[0, 0, 1, 2, 3].set(jnp.nan), m.layout)
        master = {**mw.master, "blocks": {**mw.master["blocks"], "attn": {**mw.master["blocks"]["attn"],
                                                                          "q": {"kernel": poisoned}}}}
        opt_state = _replace_master(opt_state, master)
        needle = "opt_state/"
    else:
        q = params["blocks"]["mlp"]["down"]["kernel"]
        bad = jax.lax.bitcast_convert_type(jnp.full(q.amax_bits.shape, jnp.inf, jnp.float32), jnp.uint32)
        q = dataclasses.replace(q, amax_bits=bad)
        params = {**params, "blocks": {**params["blocks"], "mlp": {**params["blocks"]["mlp"], "down": {"kernel": q}}}}
        needle = "params/blocks/mlp/down/kernel/amax_bits"
    ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(ckpt_lib.CheckpointError, match="checkpoint 6 not written: non-finite") as e:
        ck.save(6, params, opt_state, mesh=mesh, data_state={"step": 6, "seed": 0})
    assert needle in str(e.value) and ck.all_steps() == []
    with monkeypatch.context() as m:
        m.setattr(nvck, "nonfinite", lambda tree: [])
        ck.save(6, params, opt_state, mesh=mesh, data_state={"step": 6, "seed": 0})
    ck.close()
    ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(ckpt_lib.CheckpointError, match="non-finite") as e:
        ck.restore(6, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings, trainer.state_shardings)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _replace_master(state, master):
    def visit(x):
        if isinstance(x, nv.MasterWeightsState):
            return x._replace(master=master)
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(visit(y) for y in x)
        return x

    return visit(state)


# ----------------------------------------------------------------------------- atomic saves
def test_save_failing_at_its_commit_leaves_the_previous_checkpoint(reference, tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    cfg = job()
    mesh = mesh_of(cfg, 8)
    trainer, _, _ = programs.build(cfg, mesh, init=False)
    d = str(tmp_path / "ck")
    ck = ckpt_lib.Checkpointer(d)
    ck.save(1, reference["params"], reference["opt_state"], mesh=mesh, data_state={"step": 1, "seed": 0})
    ck.wait()

    async def crash(*a, **k):
        raise OSError("simulated crash")

    # Every file of step 2 is written, then the process "dies" at the atomic rename.
    monkeypatch.setattr(async_path, "rename", crash)
    with pytest.raises(Exception):
        ck.save(2, reference["params"], reference["opt_state"], mesh=mesh,
                data_state={"step": 2, "seed": 0})
        ck.wait()
    monkeypatch.undo()
    try:
        ck.close()
    except Exception:  # noqa: BLE001 - the failed save may be reported again
        pass
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(d))
    ck2 = ckpt_lib.Checkpointer(d)
    assert ck2.all_steps() == [1]
    assert not any("tmp" in n for n in os.listdir(d))  # the leftover was cleaned up
    r = ck2.restore(1, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings, trainer.state_shardings)
    same_bytes(ckpt_lib.host_arrays(r.params, r.opt_state), reference["host"])


KILL_CHILD = textwrap.dedent("""
    import sys
    import jax, numpy as np, optax
    import jax_nvfp4 as nv
    from jax.sharding import Mesh
    from train.checkpoint import Checkpointer

    @jax.jit  # one program (op by op, each operation compiles its own)
    def _state(fp32):
        params = nv.shard_params(nv.quantize_params(fp32))
        return params, nv.master_weights(optax.adam(1e-3)).init(params)

    def state():
        rng = np.random.default_rng(0)
        return _state({"w": rng.standard_normal((256, 512)).astype(np.float32),
                       "b": rng.standard_normal(512).astype(np.float32)})

    if __name__ == "__main__":
        params, opt_state = state()
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        ck = Checkpointer(sys.argv[1], keep=2)
        for step in range(1, 10_000):
            ck.save(step, params, opt_state, mesh=mesh, data_state={"step": step, "seed": 0})
            print("saved", step, flush=True)
""")


def test_save_killed_at_a_random_point_keeps_the_last_checkpoint(tmp_path):
    d = tmp_path / "ck"
    script = tmp_path / "child.py"
    script.write_text(KILL_CHILD)
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(1))
    child = subprocess.Popen([sys.executable, str(script), str(d)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        for line in child.stdout:
            if line.strip() == "saved 3":
                break
        time.sleep(0.05 + 0.2 * np.random.default_rng(3).random())  # a fixed point inside the save
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    sys.path.insert(0, str(tmp_path))
    try:
        import child as mod
    finally:
        sys.path.pop(0)
    params, opt_state = mod.state()
    abstract = jax.eval_shape(lambda: (params, opt_state))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    ck = ckpt_lib.Checkpointer(str(d))
    steps = ck.all_steps()
    # keep=2; a kill between a commit and the deletion of the oldest may leave one more (which
    # may be half deleted: orbax deletes old steps in place). A kill between the latest's
    # commit and its hash record leaves it unverifiable: the fallback takes the one before.
    assert steps and steps[-1] >= 3 and len(steps) <= 3
    step, _ = ck.restorable_step(fallback=True)
    assert step in steps[-2:]
    r = ck.restore(step, *abstract, nv.shardings(abstract[0], mesh), nv.shardings(abstract[1], mesh))
    assert r.data_state["step"] == step
    same_bytes(ckpt_lib.host_arrays(r.params, r.opt_state), ckpt_lib.host_arrays(params, opt_state))


# ----------------------------------------------------------------------------- export
def test_export_roundtrip_gives_bit_identical_logits(reference, tmp_path):
    cfg = job()
    params = nv.sharding.logical(jax.device_get(reference["params"]))  # one layout for both, so one program
    manifest = nv.export.export_nvfp4(params, str(tmp_path / "export"))
    m = json.loads(open(manifest).read())
    assert m["format"] == "jax_nvfp4.export" and m["version"] == 2 and len(m["sha256"]) == 64
    kinds = {e["path"]: e for e in m["leaves"]}
    q = kinds["blocks/attn/q/kernel"]
    assert q["kind"] == "nvfp4" and q["shape"] == [2, 96, 96] and q["block"] == [16, 1]  # nvfp4.block: 1d
    assert set(q["files"]) == {"data", "scale", "amax"} and all(len(f["sha256"]) == 64 for f in q["files"].values())
    assert kinds["embed"]["dtype"] == "bfloat16"
    loaded = nv.export.load_nvfp4(str(tmp_path / "export"))
    assert jax.tree.structure(loaded, is_leaf=nv.array.is_nvfp4) == jax.tree.structure(params, is_leaf=nv.array.is_nvfp4)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    model = from_config(cfg.model, cfg.nvfp4)
    logits = jax.jit(lambda p, t: model.apply({"params": nv.dequantize_params(p, jnp.bfloat16)}, t))
    tokens = jnp.asarray(data_lib.make_data_iterator(cfg).batch_at(0)[:4, :-1])
    a, b = np.asarray(logits(params, tokens)), np.asarray(logits(loaded, tokens))
    assert a.tobytes() == b.tobytes()
    with pytest.raises(FileExistsError):
        nv.export.export_nvfp4(params, str(tmp_path / "export"))


def test_export_of_any_pytree_and_its_refusals(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 40, 33)).astype(np.float32)
    tree = {"layers": [{"w": nv.quantize(jnp.asarray(w))}, {"v": jnp.asarray(rng.standard_normal(7), jnp.bfloat16)}],
            "step": jnp.asarray(5, jnp.int32), "t": (jnp.ones((2, 2), jnp.float16),)}
    d = str(tmp_path / "e")
    nv.export.export_nvfp4(tree, d)
    back = nv.export.load_nvfp4(d, like=tree)
    assert jax.tree.structure(back, is_leaf=nv.array.is_nvfp4) == jax.tree.structure(tree, is_leaf=nv.array.is_nvfp4)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    plain = nv.export.load_nvfp4(d)  # no `like`: nested dicts and lists
    assert isinstance(plain["layers"], list) and nv.array.is_nvfp4(plain["layers"][0]["w"])
    # A None entry has no bytes: the entries after it keep their indices (they moved up one, silently).
    holes = str(tmp_path / "holes")
    nv.export.export_nvfp4({"layers": [None, jnp.ones(4), jnp.full(4, 2.0)]}, holes)
    assert [None if x is None else float(x[0]) for x in nv.export.load_nvfp4(holes)["layers"]] == [None, 1.0, 2.0]

    # Non-finite weights are not exported, and nothing is written.
    bad = {"w": nv.quantize(jnp.asarray(w).at[0, 0, 0].set(jnp.nan))}
    with pytest.raises(nv.export.ExportError, match="non-finite amax"):
        nv.export.export_nvfp4(bad, str(tmp_path / "bad"))
    assert not os.path.exists(tmp_path / "bad") and not [n for n in os.listdir(tmp_path) if "tmp" in n]

    # An altered file is refused by its hash; a NaN amax with a matching hash by its value.
    m = json.load(open(os.path.join(d, "manifest.json")))
    entry = m["leaves"][0]["files"]["amax"]
    path = os.path.join(d, entry["name"])
    amax = np.load(path)
    np.save(path, np.full_like(amax, 2.0))
    with pytest.raises(nv.export.ExportError, match="sha256"):
        nv.export.load_nvfp4(d)
    np.save(path, np.full_like(amax, np.nan))
    import hashlib

    entry["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    m["sha256"] = nv.export._manifest_digest(m)
    json.dump(m, open(os.path.join(d, "manifest.json"), "w"))
    with pytest.raises(nv.export.ExportError, match="non-finite amax") as e:
        nv.export.load_nvfp4(d)
    assert "layers/0/w" in str(e.value)
    os.remove(path)
    with pytest.raises(nv.export.ExportError, match="missing"):
        nv.export.load_nvfp4(d)
    with pytest.raises(nv.export.ExportError, match="manifest"):
        nv.export.load_nvfp4(str(tmp_path))
    with pytest.raises(TypeError, match="PRNG key"):
        nv.export.export_nvfp4({"k": jax.random.key(0)}, str(tmp_path / "k"))
    # Two leaves the manifest would name alike: refused before writing, not at load.
    with pytest.raises(nv.export.ExportError, match="two leaves have the path 'a/b'.*nothing written"):
        nv.export.export_nvfp4({"a/b": jnp.ones(2), "a": {"b": jnp.ones(3)}}, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c")


def test_load_checks_the_values_and_what_like_says(tmp_path):
    """A re-hashed file with a negative amax or a NaN scale byte is refused (each would decode
    to plausible wrong weights under isfinite() True); ``like`` refuses another shape, dtype or
    block than the export holds."""
    import hashlib

    rng = np.random.default_rng(2)
    tree = {"w": nv.quantize(jnp.asarray(rng.standard_normal((32, 48)), jnp.float32), block=(1, 16)),
            "b": jnp.zeros(4, jnp.float32)}
    for field, poison, needle in (("amax", lambda a: -a, "negative amax"),
                                  ("scale", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, 0x7F, a)
                                   .astype(np.uint8), "scale byte of a matrix with a finite amax is negative or NaN")):
        d = str(tmp_path / field)
        nv.export.export_nvfp4(tree, d)
        m = json.load(open(os.path.join(d, "manifest.json")))
        entry = next(x for x in m["leaves"] if x["kind"] == "nvfp4")["files"][field]
        path = os.path.join(d, entry["name"])
        np.save(path, poison(np.load(path)))
        entry["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        m["sha256"] = nv.export._manifest_digest(m)
        json.dump(m, open(os.path.join(d, "manifest.json"), "w"))
        with pytest.raises(nv.export.ExportError, match=f"leaf 'w': NVFP4Array: a {needle}"):
            nv.export.load_nvfp4(d)
    w = tree["w"]  # the constructor checks no values (tracers, tree utilities): export does, before writing
    flipped = nv.NVFP4Array(w.data, w.scale_bits, jax.lax.bitcast_convert_type(-w.amax, jnp.uint32), w.matrix_shape,
                            w.block)
    with pytest.raises(nv.export.ExportError, match="leaf 'w': NVFP4Array: a negative amax .*; nothing written"):
        nv.export.export_nvfp4({"w": flipped}, str(tmp_path / "flipped"))
    assert not os.path.exists(tmp_path / "flipped")
    d = str(tmp_path / "ok")
    nv.export.export_nvfp4(tree, d)
    for like, needle in (({**tree, "b": jnp.zeros(5, jnp.float32)}, "leaf 'b' is float32 \\[4\\], but `like` has "
                                                                     "float32 \\[5\\]"),
                         ({**tree, "b": jnp.zeros(4, jnp.int32)}, "but `like` has int32 \\[4\\]"),
                         ({**tree, "w": nv.NVFP4Array.abstract((32, 48))}, "leaf 'w' is NVFP4 \\[32, 48\\] block "
                                                                            "\\[1, 16\\], but `like` has NVFP4 "
                                                                            "\\[32, 48\\] block \\[16, 16\\]")):
        with pytest.raises(nv.export.ExportError, match=needle):
            nv.export.load_nvfp4(d, like=like)
    assert nv.export.load_nvfp4(d, like=jax.eval_shape(lambda: tree))["w"].block == (1, 16)


def test_load_refuses_a_malformed_or_edited_manifest(tmp_path):
    from jax_nvfp4.export import _manifest_digest

    d = str(tmp_path / "e")
    nv.export.export_nvfp4({"w": nv.quantize(jnp.ones((3, 32, 48)))}, d)
    path = os.path.join(d, "manifest.json")
    good = json.load(open(path))

    def load_with(m, rehash):
        m = json.loads(json.dumps(m))
        if rehash:
            m["sha256"] = _manifest_digest(m)
        json.dump(m, open(path, "w"))
        with pytest.raises(nv.export.ExportError) as e:
            nv.export.load_nvfp4(d)
        assert "\n" not in str(e.value)
        return str(e.value)

    # An edited shape (data files untouched) fails the manifest's hash; a malformed manifest is
    # named in one line.
    edited = json.loads(json.dumps(good))
    edited["leaves"][0]["shape"] = [3, 48, 32]
    assert "does not match its own sha256" in load_with(edited, rehash=False)
    assert "malformed manifest: leaves: expected a list, got dict" in load_with({**good, "leaves": {"w": 1}}, rehash=True)
    for key, value, needle in [("shape", [3, -1, 48], "shape"), ("block", [16.9, 16], "block"), ("kind", "x", "kind"),
                               ("files", {"data": {}}, "files"), ("keys", [["dict"]], "keys")]:
        bad = json.loads(json.dumps(good))
        bad["leaves"][0][key] = value
        assert needle in load_with(bad, rehash=True)
    bad = json.loads(json.dumps(good))
    bad["leaves"][0]["files"]["amax"]["sha256"] = "z" * 64
    assert "leaves[0].files.amax" in load_with(bad, rehash=True)
    json.dump(good, open(path, "w"))
    assert nv.export.load_nvfp4(d)["w"].shape == (3, 32, 48)


# ----------------------------------------------------------------------------- resume rules
@pytest.mark.parametrize("override,needle", [
    ("model.heads=1", "was trained with model.heads=2 but this run has model.heads=1"),
    ("data.seed=1", "was trained with data.seed=0 but this run has data.seed=1"),
    ("optim.name=sgd", "optim.name=\"adamw\" but this run has optim.name=\"sgd\""),
    ("train.steps=8", "optim.schedule_steps=6 but this run has optim.schedule_steps=8; to extend the run on its "
                      "schedule set optim.schedule_steps=6"),
    ("train.steps=5", "is at step 6, past train.steps=5"),
    ("nvfp4.block=2d", "was trained with nvfp4.block=\"1d\" but this run has nvfp4.block=\"2d\""),
])
def test_resume_refuses_a_different_trajectory(resumed, tmp_path, override, needle):
    cfg = job(f"checkpoint.dir={resumed['ck']}", override)
    listing = sorted(os.listdir(resumed["ck"]))
    with pytest.raises(ckpt_lib.CheckpointError) as e:
        loop.run(cfg, mesh_of(cfg, 8), str(tmp_path / "never"), progress=False)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "never").exists() and sorted(os.listdir(resumed["ck"])) == listing
    # The named key can be allowed to change explicitly (here only checked, not trained).
    key = override.split("=")[0] if override != "train.steps=8" else "optim.schedule_steps"
    if not override.startswith("train.steps=5"):
        ckpt_lib.check_resume("x", ckpt_lib.Checkpointer(str(resumed["ck"])).read_meta(6),
                              job(override, f"checkpoint.dir={resumed['ck']}", f"checkpoint.allow_change=[{key}]"))


def test_resume_refuses_changed_training_data(resumed, tmp_path):
    # The checkpoint records the validation split and the data files' content: a resume with
    # another split, or after data.path's content changed, is refused.
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    base = ("data.source=file", f"data.path={corpus}", "data.val_fraction=0.1", f"checkpoint.dir={tmp_path / 'ck'}")
    meta = ckpt_lib.Checkpointer(str(resumed["ck"])).read_meta(6)
    meta["run"] = ckpt_lib.run_identity(job(*base))
    assert meta["run"]["data.path:content"] == {"bytes": 10240, "sha256": meta["run"]["data.path:content"]["sha256"],
                                                "hashed": "whole file"}
    ckpt_lib.check_resume("ck/6", meta, job(*base))  # the same data: accepted
    with pytest.raises(ckpt_lib.CheckpointError, match="data.val_fraction=0.1 but this run has data.val_fraction=0.9"):
        ckpt_lib.check_resume("ck/6", meta, job(*base, "data.val_fraction=0.9"))
    corpus.write_bytes(bytes(range(256)) * 39 + bytes(reversed(range(256))))  # same size, other bytes
    with pytest.raises(ckpt_lib.CheckpointError) as e:
        ckpt_lib.check_resume("ck/6", meta, job(*base))
    msg = str(e.value)
    assert msg.startswith("checkpoint ck/6 was trained on other data: data.path=") and "\n" not in msg
    assert "set checkpoint.allow_change=[data.path]" in msg
    ckpt_lib.check_resume("ck/6", meta, job(*base, "checkpoint.allow_change=[data.path]"))
    # A checkpoint written before the content was recorded cannot be checked for it: accepted.
    for key in ("data.path:content", "data.val_path:content", "data.val_fraction", "data.val_path"):
        del meta["run"][key]
    ckpt_lib.check_resume("ck/6", meta, job(*base))


def test_fallback_renames_nothing_when_the_resume_is_then_refused(resumed, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(resumed["ck"], ck)
    from jax_nvfp4 import integrity

    victim = next(p for p in (ck / "6").rglob("*") if p.is_file() and p.name != ckpt_lib.HASHES
                  and p.name not in integrity.BOOKKEEPING)
    victim.write_bytes(victim.read_bytes() + b"x")
    listing = sorted(os.listdir(ck))
    cfg = job(f"checkpoint.dir={ck}", "checkpoint.fallback=true", "model.heads=1")
    with pytest.raises(ckpt_lib.CheckpointError, match="model.heads=2 but this run has model.heads=1"):
        loop.run(cfg, mesh_of(cfg, 8), str(tmp_path / "never"), progress=False)
    # Refused: nothing moved aside (exit 2 promises nothing written).
    assert sorted(os.listdir(ck)) == listing and not (tmp_path / "never").exists()
    # Accepted, the fallback moves the corrupt step aside.
    c = ckpt_lib.Checkpointer(str(ck))
    step, corrupt = c.restorable_step(fallback=True)
    assert step == 4 and [s for s, _ in corrupt] == [6]
    c.set_aside(corrupt, step, log=lambda m: None)
    assert "corrupt-6" in os.listdir(ck) and c.all_steps() == [2, 4]


def test_a_step_folder_copied_over_another_is_refused(resumed, tmp_path):
    """Step 4's folder under the name 6 verifies (its hashes are relative): the step its meta
    records refuses it, so a resume never continues step 4's state as step 6."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(resumed["ck"], ck)
    shutil.rmtree(ck / "6")
    shutil.copytree(ck / "4", ck / "6")
    with pytest.raises(ckpt_lib.CheckpointError, match=r"ck/6: holds step 4, not 6 \(its folder was renamed"):
        ckpt_lib.Checkpointer(str(ck)).restorable_step()


def test_hidden_files_in_a_checkpoint_do_not_make_it_corrupt(two_checkpoints, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(two_checkpoints["dir"], d)
    (d / "2" / ".DS_Store").write_bytes(b"\0\1")  # a file browser's: hidden, not part of the content
    (d / "2" / "state" / "._meta").write_bytes(b"x")
    ck = ckpt_lib.Checkpointer(str(d))
    assert ck.restorable_step() == (2, [])
    (d / "2" / "notes.txt").write_text("not hidden")
    with pytest.raises(ckpt_lib.CheckpointError, match="file notes.txt was not part of the saved checkpoint"):
        ck.verify(2)


def test_a_checkpoint_older_than_the_block_key_resumes_as_2d(resumed):
    # Checkpoints written before nvfp4.block existed stored 16x16 tiles and do not record it.
    meta = ckpt_lib.Checkpointer(str(resumed["ck"])).read_meta(6)
    del meta["run"]["nvfp4.block"]
    ckpt_lib.check_resume("x", meta, job("nvfp4.block=2d"))
    with pytest.raises(ckpt_lib.CheckpointError, match='nvfp4.block="2d" but this run has nvfp4.block="1d"'):
        ckpt_lib.check_resume("x", meta, job())


def test_extending_a_run_keeps_its_schedule(reference, resumed, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(resumed["ck"], ck)
    cfg = job(f"checkpoint.dir={ck}", "train.steps=8", "optim.schedule_steps=6")
    capsys.readouterr()
    r = loop.run(cfg, mesh_of(cfg, 8), str(tmp_path / "out"), progress=False)
    said = capsys.readouterr().out
    assert "resuming from step 6 of 8" in said
    # Something is said before the (silent) compilation, and how long it took after it.
    assert said.index("compiling the train step...") < said.index("compiled in ")
    assert r["start_step"] == 6 and len(r["history"]) == 2 and all(np.isfinite(r["history"]))
    # The schedule is the stored one: past its end the learning rate stays at its final value.
    sched = optimizer_lib.schedule_for(cfg)
    assert float(sched(7)) == float(sched(6)) == float(optimizer_lib.schedule_for(job())(6))
    assert ckpt_lib.Checkpointer(str(ck)).read_meta(8)["run"]["optim.schedule_steps"] == 6


# ----------------------------------------------------------------------------- corruption
@functools.partial(jax.jit, static_argnums=1)
def stored_state(fp32, tx):
    """The stored NVFP4 params of the float32 tree ``fp32`` and ``tx``'s state, as one program
    (op by op, each of their operations compiles a program of its own)."""
    params = nv.shard_params(nv.quantize_params(fp32))
    return params, tx.init(params)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Checkpoints 1 and 2 of a small state (different values), saved on one device."""
    import optax

    rng = np.random.default_rng(0)
    tx = nv.master_weights(optax.adam(1e-3))
    fp32 = {"w": rng.standard_normal((64, 96)).astype(np.float32), "b": rng.standard_normal(96).astype(np.float32)}
    states = {1: stored_state(fp32, tx)}
    updates, opt2 = jax.jit(tx.update)(jax.tree.map(np.ones_like, fp32), states[1][1], states[1][0])
    states[2] = (jax.jit(optax.apply_updates)(states[1][0], updates), opt2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    d = tmp_path_factory.mktemp("two") / "ck"
    ck = ckpt_lib.Checkpointer(str(d))
    for step, (p, o) in states.items():
        ck.save(step, p, o, mesh=mesh, data_state={"step": step, "seed": 0})
    ck.close()
    abstract = jax.eval_shape(lambda: states[1])
    shard = (nv.shardings(abstract[0], mesh), nv.shardings(abstract[1], mesh))
    host = {s: ckpt_lib.host_arrays(*st) for s, st in states.items()}
    return {"dir": d, "abstract": abstract, "shard": shard, "host": host}


from hypothesis import given, strategies as st  # noqa: E402


@given(which=st.integers(0, 10_000), offset=st.integers(0, 1 << 30), bit=st.integers(0, 7),
       fallback=st.booleans())
def test_a_flipped_byte_is_refused_or_falls_back_never_restored(two_checkpoints, tmp_path_factory, which, offset, bit,
                                                                fallback):
    import shutil

    d = tmp_path_factory.mktemp("flip") / "ck"
    shutil.copytree(two_checkpoints["dir"], d)
    files = sorted(p for p in d.rglob("*") if p.is_file())
    victim = files[which % len(files)]
    raw = bytearray(victim.read_bytes())
    if not raw:
        return
    raw[offset % len(raw)] ^= 1 << bit
    victim.write_bytes(bytes(raw))
    ck = ckpt_lib.Checkpointer(str(d))
    try:
        step, corrupt = ck.restorable_step(fallback=fallback)
        ck.set_aside(corrupt, step)
        r = ck.restore(step, *two_checkpoints["abstract"], *two_checkpoints["shard"])
    except ckpt_lib.CheckpointError as e:
        assert "\n" not in str(e)
        assert not fallback or "no intact checkpoint" in str(e)
        return
    finally:
        ck.close()
    # Restored: then it is bit for bit what was saved at that step, and the newest intact one.
    same_bytes(ckpt_lib.host_arrays(r.params, r.opt_state), two_checkpoints["host"][step])
    assert step == 2 or (fallback and "/2/" in str(victim))


def test_checkpoint_of_the_previous_format_is_refused_in_one_line(tmp_path):
    """A checkpoint written before the tile layout (format 1: logical masters, no content
    hashes) is refused with one line that says so, not restored into the wrong layout."""
    import optax
    from jax.sharding import Mesh

    params, state = stored_state({"w": np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)},
                                 nv.master_weights(optax.adam(1e-3)))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    d = tmp_path / "ck"
    ck = ckpt_lib.Checkpointer(str(d))
    ck.save(1, params, state, mesh=mesh, data_state={"step": 1, "seed": 0})
    ck.close()
    meta_file = d / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["version"] = 1
    meta_file.write_text(json.dumps(meta))
    (d / "1" / ckpt_lib.HASHES).unlink()  # format 1 had no content hashes
    ck = ckpt_lib.Checkpointer(str(d))
    with pytest.raises(ckpt_lib.CheckpointError, match="format version 1") as e:
        ck.restore(1, params, state, nv.shardings(params, mesh), nv.shardings(state, mesh))
    ck.close()
    assert "\n" not in str(e.value) and "before the tile layout" in str(e.value)


def test_each_process_hashes_only_the_files_it_wrote_and_its_share_at_resume(tmp_path, monkeypatch):
    """Process p records the files orbax has it write (``ocdbt.process_<p>``,
    ``array_metadatas/process_<p>``; process 0 the shared ones) and, verifying, hashes only its
    share of the records; a bad file another process found is refused here too, named."""
    import types

    from jax_nvfp4 import integrity

    d = tmp_path / "7"
    owners = {"_CHECKPOINT_METADATA": 0, "meta/metadata": 0, "state/_METADATA": 0, "state/manifest.ocdbt": 0,
              "state/ocdbt.process_0/d/a0": 0, "state/array_metadatas/process_0": 0,
              "state/ocdbt.process_1/d/b1": 1, "state/ocdbt.process_1/manifest.ocdbt": 1,
              "state/array_metadatas/process_1": 1}
    for rel in owners:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(rel.encode() * 3)
    hashed, real = [], integrity.hash_file
    monkeypatch.setattr(integrity, "hash_file", lambda path: hashed.append(os.path.relpath(path, d)) or real(path))
    gathered = {}  # what the other process found: the index of its first bad file (none: len)
    monkeypatch.setattr(integrity, "_first", lambda i: min(i, gathered.get("other", i)))
    for p in (0, 1):
        monkeypatch.setattr(integrity, "jax", types.SimpleNamespace(process_index=lambda p=p: p, process_count=lambda: 2))
        hashed.clear()
        integrity.record(str(d))  # orbax's commit bookkeeping aside: it writes it after the content
        assert sorted(hashed) == sorted(rel for rel, o in owners.items() if o == p and rel not in integrity.BOOKKEEPING)
    assert (d / ckpt_lib.HASHES).exists() and (d / "jax_nvfp4.sha256.process_1.json").exists()
    hashed.clear()
    integrity.verify(str(d))  # as process 1 of 2
    assert sorted(hashed) == sorted(rel for rel, o in owners.items() if o == 1)
    # A flipped byte in process 0's file: process 1 does not read it, process 0's verdict names it.
    victim = "state/ocdbt.process_0/d/a0"
    raw = bytearray((d / victim).read_bytes())
    raw[1] ^= 4
    (d / victim).write_bytes(bytes(raw))
    integrity.verify(str(d))
    gathered["other"] = sorted(r for r in owners if r not in integrity.BOOKKEEPING).index(victim)
    with pytest.raises(integrity.IntegrityError, match=f"corrupt: file {victim} does not match its sha256"):
        integrity.verify(str(d))
    # One process resuming a two-process checkpoint hashes both shares, and finds it itself.
    monkeypatch.setattr(integrity, "jax", types.SimpleNamespace(process_index=lambda: 0, process_count=lambda: 1))
    gathered.clear()
    hashed.clear()
    with pytest.raises(integrity.IntegrityError, match=f"file {victim} does not match"):
        integrity.verify(str(d))
    assert victim in hashed
