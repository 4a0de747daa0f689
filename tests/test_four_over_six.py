"""``four_over_six``: each block's scale maps its amax to 6 (the recipe) or to 4, whichever has the
smaller squared error; the result is plain NVFP4, checked against the NumPy reference, sharded,
through the optimizer's re-quantization and from the stack's config."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding

import jax_nvfp4 as nv
import reference as ref


def _matrices(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 64, 80)).astype(np.float32)
    x[1] = rng.standard_t(3, (64, 80)).astype(np.float32)  # heavy tails: blocks with one large value
    x[2, :, :40] *= np.float32(1e-3)  # blocks far below the global amax
    return x


def _block_sse(x, q, block):
    err = (np.asarray(nv.dequantize(q, jnp.float32), np.float64) - x) ** 2
    *b, r, c = err.shape
    return err.reshape(*b, r // block[0], block[0], c // block[1], block[1]).sum(axis=(-3, -1))


@pytest.mark.parametrize("block", [nv.BLOCK_2D, nv.array.BLOCK_COLUMN, nv.array.BLOCK_1D])
def test_equals_the_reference_and_lowers_every_block_error(block):
    x = _matrices()
    q6 = nv.quantize(x, block=block)
    q46 = nv.quantize(x, block=block, four_over_six=True)
    for i in range(x.shape[0]):
        d, s, a = ref.quantize_matrix(x[i], block=block, four_over_six=True)
        np.testing.assert_array_equal(np.asarray(q46.data[i]), d)
        np.testing.assert_array_equal(np.asarray(q46.scale[i]).view(np.uint8), s)
        assert np.asarray(q46.amax[i]).tobytes() == np.float32(a).tobytes()
    # The global amax (hence what every reader decodes with) is the recipe's.
    np.testing.assert_array_equal(np.asarray(q46.amax), np.asarray(q6.amax))
    e6, e46 = _block_sse(x, q6, block), _block_sse(x, q46, block)
    changed = np.asarray(q46.scale).view(np.uint8) != np.asarray(q6.scale).view(np.uint8)
    assert np.all(e46[changed] < e6[changed]) and np.array_equal(e46[~changed], e6[~changed])
    # Blocks switch; with 16-element blocks (about a third of them switch) the total error drops by
    # more than 5% (16x16 tiles rarely gain: one element in 256 sits near the top).
    assert changed.any()
    if block != nv.BLOCK_2D:
        assert e46.sum() < 0.95 * e6.sum(), (e46.sum(), e6.sum())
    # A switched block's scale is the one mapping its amax to 4.
    S = np.float32(2688.0) / np.abs(x).max(axis=(-2, -1))
    *_, r, c = x.shape
    bam = np.abs(x).reshape(3, r // block[0], block[0], c // block[1], block[1]).max(axis=(-3, -1))
    s4 = np.clip(bam * (S[:, None, None] * np.float32(0.25)), 0, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q46.scale).view(np.uint8)[changed], s4.view(np.uint8)[changed])


def test_off_is_the_recipe_and_special_values_keep_theirs():
    x = _matrices(1)
    q = nv.quantize(x, four_over_six=False)
    d, s, a = ref.quantize(x)
    np.testing.assert_array_equal(np.asarray(q.data), d)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), s)
    z = np.zeros((32, 32), np.float32)
    z[0, 0] = np.nan
    z[20, 20] = 1.0
    qz = nv.quantize(z, four_over_six=True)
    assert not bool(qz.isfinite())
    zero = nv.quantize(np.zeros((16, 32), np.float32), four_over_six=True)
    assert not np.asarray(zero.data).any() and not np.asarray(zero.scale).view(np.uint8).any()


@pytest.mark.parametrize("n,tensor,block", [(3, 1, nv.BLOCK_2D), (2, 2, nv.array.BLOCK_COLUMN)])
def test_sharded_requantize_is_the_unsharded_quantization(n, tensor, block):
    mesh = jax.make_mesh((n, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: n * tensor])
    x = _matrices(2)[:2, :48, :64]
    lay = nv.rules.layout_for("w", x.shape, True, mesh, nv.Rules(tensor=((r"w", -1),)))
    m = nv.Tiled.from_logical(x, lay)
    m = nv.Tiled(jax.device_put(m.value, NamedSharding(mesh, m.spec())), lay)
    got = jax.jit(lambda m: nv.sharding.requantize(m, mesh, block=block, four_over_six=True))(m)
    want = nv.quantize(x, block=block, four_over_six=True)
    for a, b in zip(jax.tree.leaves(got.to_array()), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_master_weights_requantize_with_the_policys_choice():
    """An update re-quantizes every NVFP4 param from its master with ``Policy.four_over_six``."""
    rng = np.random.default_rng(4)
    fp32 = {"w": rng.standard_t(3, (64, 96)).astype(np.float32), "b": np.zeros(96, np.float32)}
    policy = nv.Policy(block=nv.array.BLOCK_COLUMN, four_over_six=True)
    params = nv.quantize_params(fp32, policy)
    np.testing.assert_array_equal(np.asarray(params["w"].scale),
                                  np.asarray(nv.quantize(fp32["w"], block=policy.block, four_over_six=True).scale))
    tx = nv.master_weights(optax.sgd(0.1), policy=policy)
    state = jax.jit(tx.init)(fp32)
    grads = {"w": rng.standard_normal((64, 96)).astype(np.float32), "b": np.ones(96, np.float32)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = jax.jit(optax.apply_updates)(params, updates)
    master = np.asarray(nv.sharding.logical(state.master)["w"])
    np.testing.assert_array_equal(master, fp32["w"] - np.float32(0.1) * grads["w"])
    d, s, _ = ref.quantize_matrix(master, block=policy.block, four_over_six=True)
    np.testing.assert_array_equal(np.asarray(new["w"].data), d)
    np.testing.assert_array_equal(np.asarray(new["w"].scale).view(np.uint8), s)
    d6, _, _ = ref.quantize_matrix(master, block=policy.block)
    assert not np.array_equal(d, d6)  # the choice changed some codes: the test sees which quantizer ran


def test_the_stack_key_reaches_the_policy():
    from train.config import load_config
    from train.plan import policy_for

    assert policy_for(load_config(None, ["nvfp4.four_over_six=true"])).four_over_six
    assert not policy_for(load_config(None, [])).four_over_six
