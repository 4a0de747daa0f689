"""jax_nvfp4.checkpoint on a state that is not the training stack's: a user's params (a stacked
q/k/v + MLP block), sharded with tensor rules, saved by orbax on one mesh and restored onto meshes
with another data axis and another tensor split, bit for bit; the refusals name the leaf."""

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
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


def _state(data: int, tensor: int, init: bool = True):
    """``(state or its abstract value, shardings, mesh)`` of the user's model on a data x tensor mesh."""
    mesh = jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * tensor])
    policy = nv.Policy()
    tx = nv.master_weights(optax.adam(1e-2), policy=policy, rules=RULES)

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
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave({"leaves": nvck.describe(state)})))
        mngr.wait_until_finished()
    return directory, nvck.host_arrays(state)


@pytest.mark.parametrize("data,tensor", [(3, 1), (4, 2), (1, 1)])
def test_restore_onto_another_data_axis_and_tensor_split_is_bit_identical(saved, data, tensor):
    directory, want = saved
    abstract, shardings, mesh = _state(data, tensor, init=False)
    with ocp.CheckpointManager(directory) as mngr:
        meta = mngr.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta["leaves"]
        assert nvck.mismatch(meta, nvck.describe(abstract)) == ""
        moved = {k for k, e in meta.items() if "tensor_split" in e} if tensor != 2 else set()
        assert len(moved) == (0 if tensor == 2 else 20)  # 5 params, their masters and adam's two moments
        targets = nvck.restore_targets(abstract, shardings, meta)
        raw = mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(targets, strict=False))).state
    with jax.set_mesh(mesh):
        state = nvck.relayout(raw, abstract, shardings, meta)
    got = nvck.host_arrays(state)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(shardings)
    assert nvck.nonfinite(state) == []


def test_mismatch_names_the_leaf_and_nonfinite_finds_a_nan(saved):
    directory, _ = saved
    with ocp.CheckpointManager(directory) as mngr:
        meta = mngr.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta["leaves"]
    other = dict(meta, **{"params/norm/scale": {"kind": "array", "shape": [128], "dtype": "float32"}})
    assert nvck.mismatch(other, meta) == ("params/norm/scale: shape [128] in the checkpoint but [64] here")
    fewer = {k: v for k, v in meta.items() if not k.startswith("params/blocks/mlp/down")}
    assert nvck.mismatch(fewer, meta).startswith("1 leaves of this run are not in it (e.g. params/blocks/mlp/down")
    tree = {"a": np.ones(3, np.float32), "b": np.array([1.0, np.nan], np.float32), "c": np.arange(3)}
    assert nvck.nonfinite(tree) == ["b"]
