"""jax_nvfp4.checkpoint on a state that is not the training stack's: a user's params (a stacked
q/k/v + MLP block), sharded with tensor rules, saved by its Checkpointer on one mesh and restored onto
meshes with another data axis and another tensor split, bit for bit; the refusals name the leaf or file."""

import os
import shutil

import jax
import numpy as np
import optax
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import checkpoint as nvck

RULES = nv.Rules(stacked=(r"^blocks",), tensor=((r"attn/(q|k|v)/kernel$", -1), (r"mlp/up/kernel$", -1),
                                                (r"mlp/down/kernel$", -2)))
SHAPES = {"q": (2, 64, 64), "k": (2, 64, 32), "v": (2, 64, 32), "up": (2, 64, 128), "down": (2, 128, 64)}


def _fp32():
    rng = np.random.default_rng(0)
    sec = lambda n: "attn" if n in "qkv" else "mlp"
    out = {"blocks": {"attn": {}, "mlp": {}}, "norm": {"scale": np.ones(64, np.float32)}}
    for n, shape in SHAPES.items():
        out["blocks"][sec(n)][n] = {"kernel": (rng.standard_normal(shape) * 0.05).astype(np.float32)}
    return out


def _state(data: int, tensor: int, init: bool = True, inner=None):
    """``(state or its abstract value, shardings, mesh)`` of the user's model on a data x tensor mesh
    (``inner``: the optax optimizer, default adam)."""
    mesh = jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * tensor])
    policy = nv.Policy()
    tx = nv.master_weights(inner or optax.adam(1e-2), policy=policy, rules=RULES)

    def build():
        params = nv.shard_params(_fp32(), mesh, RULES, policy)
        opt_state = tx.init(params)
        # One update, so that the optimizer's moments and the masters are not their init values.
        grads = jax.tree.map(lambda m: m * 0.5, opt_state.master)  # a Tiled is a pytree of its tiles
        updates, opt_state = tx.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}

    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(build)
        shardings = nv.shardings(abstract, mesh)
        state = jax.jit(build, out_shardings=shardings)() if init else abstract
    return state, shardings, mesh


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    state, _, _ = _state(2, 2)
    directory = tmp_path_factory.mktemp("nvck")
    ckpt = nvck.Checkpointer(str(directory), keep=2)
    for step in (1, 2):
        ckpt.save(step, state, meta={"data_position": 10 * step, "step": 1000 * step})  # the caller's own "step"
    ckpt.close()
    return directory, nvck.host_arrays(state)


@pytest.mark.parametrize("data,tensor", [(3, 1), (4, 2), (1, 1)])
def test_restore_onto_another_data_axis_and_tensor_split_is_bit_identical(saved, data, tensor):
    directory, want = saved
    abstract, shardings, mesh = _state(data, tensor, init=False)
    ckpt = nvck.Checkpointer(str(directory))
    assert ckpt.restorable_step() == (2, [])
    meta = ckpt.read_meta(2)
    assert meta["data_position"] == 20 and nvck.mismatch(meta["leaves"], nvck.describe(abstract)) == ""
    moved = {k for k, e in meta["leaves"].items() if "tensor_split" in e} if tensor != 2 else set()
    assert len(moved) == (0 if tensor == 2 else 20)  # 5 params, their masters and adam's two moments
    with jax.set_mesh(mesh):
        state, meta = ckpt.restore(2, abstract, shardings)
    ckpt.close()
    assert meta["data_position"] == 20
    got = nvck.host_arrays(state)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(shardings)
    assert nvck.nonfinite(state) == []


@pytest.mark.parametrize("data,tensor", [(3, 1), (4, 2)])
def test_the_params_alone_restore_with_partial_onto_another_mesh(saved, data, tensor):
    """An evaluation or serving job reads the params of a training state and nothing else: with
    ``partial=True`` onto another data axis and tensor split, bit for bit; without it, refused with the hint."""
    directory, want = saved
    abstract, shardings, mesh = _state(data, tensor, init=False)
    ckpt = nvck.Checkpointer(str(directory))
    with pytest.raises(nvck.CheckpointError, match=r"20 of its leaves are not in this run \(e.g. opt_state/.*\) "
                                                   r"\(restore\(\.\.\., partial=True\) reads part of a state\)"):
        ckpt.restore(2, {"params": abstract["params"]}, {"params": shardings["params"]})
    with jax.set_mesh(mesh):
        state, meta = ckpt.restore(2, {"params": abstract["params"]}, {"params": shardings["params"]}, partial=True)
    got = nvck.host_arrays(state)
    assert meta["data_position"] == 20 and got.keys() == {k for k in want if k.startswith("params/")}
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(shardings["params"])
    # Part of a state still matches leaf by leaf.
    other = jax.tree.map(lambda x: x, abstract["params"])
    other["norm"]["scale"] = jax.ShapeDtypeStruct((32,), np.float32)
    with pytest.raises(nvck.CheckpointError, match="params/norm/scale: shape"):
        ckpt.restore(2, {"params": other}, {"params": shardings["params"]}, partial=True)
    ckpt.close()


def test_mismatch_names_the_leaf_and_nonfinite_finds_a_nan(saved):
    directory, _ = saved
    meta = nvck.Checkpointer(str(directory)).read_meta(1)["leaves"]
    other = dict(meta, **{"params/norm/scale": {"kind": "array", "shape": [128], "dtype": "float32"}})
    assert nvck.mismatch(other, meta) == ("params/norm/scale: shape [128] in the checkpoint but [64] here")
    fewer = {k: v for k, v in meta.items() if not k.startswith("params/blocks/mlp/down")}
    assert nvck.mismatch(fewer, meta).startswith("1 leaves of this run are not in it (e.g. params/blocks/mlp/down")
    tree = {"a": np.ones(3, np.float32), "b": np.array([1.0, np.nan], np.float32), "c": np.arange(3)}
    assert nvck.nonfinite(tree) == ["b"]


def test_a_corrupt_step_is_refused_or_set_aside_and_another_model_is_refused(saved, tmp_path):
    directory, want = saved
    d = tmp_path / "copy"
    shutil.copytree(directory, d)
    victim = next(os.path.join(root, f) for root, _, files in os.walk(d / "2") for f in sorted(files)
                  if "ocdbt.process_0/d/" in os.path.join(root, f))
    with open(victim, "r+b") as f:  # one bit of the array data, the size unchanged
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 1]))
    ckpt = nvck.Checkpointer(str(d))
    rel = os.path.relpath(victim, d / "2")
    with pytest.raises(nvck.CheckpointError, match=f"corrupt: file {rel} does not match its sha256.*"
                                                   r"restorable_step\(fallback=True\)"):
        ckpt.restorable_step()
    step, corrupt = ckpt.restorable_step(fallback=True)
    assert step == 1 and [s for s, _ in corrupt] == [2]
    said = []
    ckpt.set_aside(corrupt, step, log=said.append)
    assert ckpt.all_steps() == [1] and os.path.isdir(d / "corrupt-2") and "moved to" in said[0]
    abstract, shardings, mesh = _state(2, 2, init=False)
    with jax.set_mesh(mesh):
        state, _ = ckpt.restore(1, abstract, shardings)
    assert all(np.array_equal(nvck.host_arrays(state)[k], want[k]) for k in want)  # step 1 holds the same state
    other = jax.tree.map(lambda x: x, abstract)
    other["params"]["norm"]["scale"] = jax.ShapeDtypeStruct((32,), np.float32)
    with pytest.raises(nvck.CheckpointError, match="does not match this model/optimizer: params/norm/scale: shape"):
        ckpt.restore(1, other, shardings)
    # adamw's state holds adam's arrays and one more (empty) state: named, not orbax's "tree structures do not match".
    abstract, shardings, mesh = _state(2, 2, init=False, inner=optax.adamw(1e-2))
    for part in (abstract, {"opt_state": abstract["opt_state"]}):  # the whole state, or its part (partial=True)
        with pytest.raises(nvck.CheckpointError, match="does not match this model/optimizer: opt_state/inner_state: "
                                                       "a sequence of 2 in the checkpoint but a sequence of 3 here"):
            ckpt.restore(1, part, {k: shardings[k] for k in part}, partial=len(part) == 1)
    # Orbax's other failures stand as they are; the state's own structure (adam's EmptyState too) matches.
    abstract, shardings, mesh = _state(2, 2, init=False)
    real = ckpt.manager.restore
    for error in (OSError("[Errno 5] Input/output error"), ValueError("tree structures do not match (as named)")):
        def fail(step, args, error=error):
            if "state" in args.keys():
                raise error
            return real(step, args=args)

        ckpt.manager.restore = fail
        with pytest.raises(nvck.CheckpointError, match=f"cannot read its arrays: {type(error).__name__}"):
            ckpt.restore(1, abstract, shardings)
    ckpt.close()


def test_a_step_folder_renamed_over_another_is_refused_or_set_aside(saved, tmp_path):
    """Each step's hashes are relative to its folder, so a copy verifies: the step its metadata
    records is what tells step 1's state under the name 2 from step 2."""
    directory, _ = saved
    d = tmp_path / "copy"
    shutil.copytree(directory, d)
    shutil.rmtree(d / "2")
    shutil.copytree(d / "1", d / "2")
    ckpt = nvck.Checkpointer(str(d))
    with pytest.raises(nvck.CheckpointError, match=r"2: holds step 1, not 2 \(its folder was renamed or copied\)"):
        ckpt.restorable_step()
    step, corrupt = ckpt.restorable_step(fallback=True)
    assert step == 1 and [s for s, _ in corrupt] == [2]
    ckpt.close()


def test_what_a_checkpointer_refuses_before_writing(saved, tmp_path):
    directory, _ = saved
    state, _, _ = _state(2, 2)
    with pytest.raises(ValueError, match="keep=0: must be a positive number"):
        nvck.Checkpointer(str(tmp_path / "k"), keep=0)
    ckpt = nvck.Checkpointer(str(tmp_path / "c"))
    for meta, match in (({"lr": np.float32(1)}, "meta: not JSON-serializable"), ({"leaves": 1}, "with 'leaves'"),
                        ([1, 2], "expected a mapping"), ({"saved_step": 2}, "without the keys 'saved_step', 'leaves'")):
        with pytest.raises(TypeError, match=match):
            ckpt.save(1, state, meta=meta)
    poisoned = jax.tree.map(lambda x: x, state)
    poisoned["params"]["norm"]["scale"] = poisoned["params"]["norm"]["scale"].at[3].set(np.inf)
    with pytest.raises(nvck.CheckpointError, match=r"checkpoint 1 not written: non-finite values \(NaN or Inf\) "
                                                   "in params/norm/scale"):
        ckpt.save(1, poisoned)  # restore would refuse it: the newest step could never be restored
    with pytest.raises(nvck.CheckpointError, match=r"checkpoint 1 not written: extra has shape \(0, 4\), no "):
        ckpt.save(1, {**state, "extra": np.zeros((0, 4), np.float32)})  # orbax's refusal read as a failed write
    assert ckpt.all_steps() == [] and os.listdir(tmp_path / "c") == []  # nothing written
    with pytest.raises(nvck.CheckpointError, match="no checkpoint to restore in"):
        ckpt.restore(ckpt.restorable_step()[0], state, None)
    ckpt.save(3, state)
    with pytest.raises(nvck.CheckpointError, match="checkpoint 3 not written: .* holds step 3, and a save must be newer"):
        ckpt.save(3, state)  # orbax would skip it silently
    # Another Checkpointer of the folder wrote step 4 since: this one's step 4 would have replaced it, silently.
    other = nvck.Checkpointer(str(tmp_path / "c"))
    other.save(4, state)
    with pytest.raises(nvck.CheckpointError, match="checkpoint 4 not written: .* holds step 4, and a save must be "):
        ckpt.save(4, state)
    other.close()
    ckpt.close()


def test_an_asynchronous_save_under_way_is_not_taken_for_a_corrupt_one(tmp_path):
    state, shardings, mesh = _state(2, 2)
    ckpt = nvck.Checkpointer(str(tmp_path / "a"), async_save=True)
    ckpt.save(1, state)
    ckpt.save(2, state)  # still being written, its hashes not recorded
    assert ckpt.restorable_step(fallback=True) == (2, [])  # waited for, then verified
    with jax.set_mesh(mesh):
        ckpt.restore(2, state, shardings)
    ckpt.close()


def test_an_asynchronous_save_is_recorded_as_it_commits(tmp_path):
    # Its hashes were written only by the next save or close: a process ending between the commit and then left
    # a checkpoint every resume refused ("no content hashes"), or set aside as corrupt with fallback.
    state, shardings, mesh = _state(2, 2)
    ckpt = nvck.Checkpointer(str(tmp_path / "a"), async_save=True)
    ckpt.save(1, state)
    ckpt.manager.wait_until_finished()  # orbax's commit alone, as when the process ends right after it
    other = nvck.Checkpointer(str(tmp_path / "a"))
    assert other.restorable_step() == (1, [])
    with jax.set_mesh(mesh):
        other.restore(1, state, shardings)
    other.close()
    ckpt.close()


def test_python_scalar_leaves_restore_as_jax_types_them(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32), "step": 100, "lr": 1e-3}  # a training loop's counters
    ckpt = nvck.Checkpointer(str(tmp_path / "s"))
    ckpt.save(1, state)
    abstract = jax.eval_shape(lambda: state)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    whole = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), abstract)
    got, meta = ckpt.restore(1, abstract, whole)
    ckpt.close()
    assert meta["leaves"]["step"] == {"kind": "array", "shape": [], "dtype": "int32"}
    assert int(got["step"]) == 100 and float(got["lr"]) == np.float32(1e-3) and got["w"].tolist() == [0, 1, 2, 3]
