"""Property tests: random shapes, dtypes and values (NaN, Inf, huge, tiny, -0) fed to the public
API. Each call either returns a correct result or raises a clear ``TypeError``/``ValueError``;
never a crash, never a silently wrong value.

Every new shape compiles, so the example counts are small.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jax_nvfp4 as nv

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int32, np.uint8, np.bool_]
SPECIAL = [np.nan, np.inf, -np.inf, 3.0e38, -3.0e38, 1e-30, 1e-40, -0.0, 0.0, 6.0, 448.0, 65504.0]

shapes = st.one_of(
    st.tuples(st.integers(0, 40)),
    st.tuples(st.integers(0, 40), st.integers(0, 40)),
    st.tuples(st.integers(1, 3), st.integers(1, 33), st.integers(1, 33)),
    st.sampled_from([(1, 4099), (2049, 1), (1, 1), (0, 5), (3, 0, 4)]),  # long, thin, empty
)


@st.composite
def arrays(draw, dtype=None, shape=None, special=True):
    """An array of ``dtype``/``shape`` (drawn when None): scaled normals, with a few special
    values (NaN, +-Inf, huge, tiny, -0) dropped in when ``special``."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)) if dtype is None else dtype)
    shape = draw(shapes) if shape is None else shape
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = 10.0 ** draw(st.integers(-35, 35))
    x = rng.standard_normal(shape) * scale
    if special and x.size and draw(st.booleans()):
        k = draw(st.integers(1, min(4, x.size)))
        idx = rng.choice(x.size, size=k, replace=False)
        x.reshape(-1)[idx] = [draw(st.sampled_from(SPECIAL)) for _ in range(k)]
    if dtype == np.bool_:
        return x > 0
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.nan_to_num(x), info.min, info.max).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype)


def is_float(dtype) -> bool:
    return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


def tiles(x, block):
    """``[..., R/br, C/bc]`` max |x| of each tile (zero-padded)."""
    *b, r, c = x.shape
    br, bc = block
    rp, cp = -(-r // br) * br, -(-c // bc) * bc
    p = np.zeros((*b, rp, cp), np.float32)
    p[..., :r, :c] = np.abs(x)
    return p.reshape(*b, rp // br, br, cp // bc, bc).max(axis=(-3, -1))


def check_quantized(x32, q):
    """``q`` is a correct NVFP4 encoding of the float32 array ``x32``."""
    assert q.shape == x32.shape
    want = nv.array.packed_shapes(x32.shape, q.block)
    assert (q.data.shape, q.scale_bits.shape, q.amax_bits.shape) == tuple(tuple(s) for s in want)
    dq = np.asarray(nv.dequantize(q, jnp.float32))
    assert dq.shape == x32.shape and dq.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(nv.dequantize(q, jnp.bfloat16)).astype(np.float32),
                                  dq.astype(ml_dtypes.bfloat16).astype(np.float32))
    flat_x = x32.reshape(-1, *x32.shape[-2:])
    flat_d = dq.reshape(-1, *x32.shape[-2:])
    amaxes = np.asarray(q.amax).reshape(-1)
    finite = np.asarray(q.isfinite()).reshape(-1)
    for m, d, amax, ok in zip(flat_x, flat_d, amaxes, finite):
        if not np.all(np.isfinite(m)):
            # A poisoned matrix is flagged and decodes to NaN: never passes for a weight.
            assert not ok and np.all(np.isnan(d))
            continue
        assert ok
        assert amax == np.max(np.abs(m))  # exact, subnormals included
        t = tiles(m, q.block)
        bound = np.repeat(np.repeat(t, q.block[0], 0), q.block[1], 1)[: m.shape[0], : m.shape[1]]
        # Element error <= half the widest E2M1 gap (2, between 4 and 6) in units of the block
        # scale ~ tile_amax/6, with E4M3 scale rounding: < 0.25 * tile_amax. Tiles far below
        # the global amax (E4M3 scale subnormal or zero) lose up to their own amax, < 4e-5 * amax.
        # Below ~3e-35 XLA:CPU flushes the float32 decode scale to zero (numerics docstring).
        limit = 0.25 * bound + 4e-5 * amax + (amax if amax < 1e-30 else 0.0)
        assert np.all(np.abs(d - m) <= limit), float(np.max(np.abs(d - m) - limit))
        assert np.all(np.sign(d) * np.sign(m) >= 0)  # never flips a sign


@FUZZ
@given(x=arrays(), block=st.sampled_from([nv.BLOCK_2D, nv.BLOCK_1D]))
def test_quantize_dequantize(x, block):
    if not is_float(x.dtype):
        with pytest.raises(TypeError, match="floating-point"):
            nv.quantize(jax.device_put(x), block=block)
        return
    if x.ndim < 2 or x.size == 0:
        with pytest.raises(ValueError, match=r"axes|non-empty"):
            nv.quantize(jax.device_put(x), block=block)
        return
    xj = jax.device_put(x)  # float64 becomes float32 here (x64 off); beyond its range: Inf
    q = nv.quantize(xj, block=block)
    check_quantized(np.asarray(xj).astype(np.float32), q)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([None, 3, "x", np.ones((4, 4), np.float32), (16, 16)]))
def test_dequantize_rejects_non_nvfp4(x):
    with pytest.raises(TypeError, match="NVFP4Array"):
        nv.dequantize(x)


@settings(max_examples=10, deadline=None)
@given(block=st.one_of(st.tuples(st.integers(0, 32), st.integers(0, 32)), st.just((16,))),
       rounding=st.sampled_from(["nearest", "stochastic", "up", ""]))
def test_bad_block_and_rounding_are_value_errors(block, rounding):
    x = jnp.ones((16, 16), jnp.float32)
    good_block = tuple(block) in (nv.BLOCK_2D, nv.BLOCK_1D)
    if good_block and rounding == "nearest":
        nv.quantize(x, block=block, rounding=rounding)
        return
    with pytest.raises(ValueError, match=r"block|rounding|key"):
        nv.quantize(x, block=block, rounding=rounding)  # stochastic without a key is an error too


@st.composite
def param_trees(draw):
    n = draw(st.integers(1, 4))
    leaves = [draw(arrays(shape=draw(st.sampled_from([(16, 16), (17, 40), (2, 16, 33), (8, 64), (40,), ()]))))
              for _ in range(n)]
    return {"a": leaves[0], "b": leaves[1:]}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=param_trees())
def test_quantize_params(tree):
    tree = jax.tree.map(jax.device_put, tree)
    q = nv.quantize_params(tree)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(q, is_leaf=nv.array.is_nvfp4)):
        if is_float(x.dtype) and x.ndim >= 2 and min(x.shape[-2:]) >= 16:
            assert nv.array.is_nvfp4(y)
            ref = nv.quantize(x)
            for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(ref)):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
            check_quantized(np.asarray(x).astype(np.float32), y)
        else:
            assert not nv.array.is_nvfp4(y) and y.dtype == x.dtype and np.asarray(y).tobytes() == np.asarray(x).tobytes()
    d = nv.dequantize_params(q, jnp.float32)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(d)):
        assert y.shape == x.shape


@st.composite
def update_cases(draw):
    rows, cols = draw(st.integers(16, 40)), draw(st.integers(16, 40))
    w = draw(arrays(dtype=np.float32, shape=(rows, cols), special=False))
    w = w / max(float(np.max(np.abs(w))), 1e-30)  # weights are O(1); their grads are not
    b = draw(arrays(dtype=np.float32, shape=(cols,), special=False))
    gw = draw(arrays(dtype=np.float32, shape=(rows, cols)))
    gb = draw(arrays(dtype=np.float32, shape=(cols,)))
    return {"w": w, "b": b}, {"w": gw, "b": gb}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=update_cases())
def test_master_weights_update(case):
    params, grads = case

    @jax.jit  # one program per case (each shape compiles; op by op, a few dozen of them)
    def update(params, grads):
        tx = nv.master_weights(optax.sgd(0.125))
        state = tx.init(params)
        qp = nv.quantize_params(params)
        updates, new = tx.update(grads, state, qp)
        logical = {k: (nv.sharding.logical(state.master[k]), nv.sharding.logical(new.master[k])) for k in ("w", "b")}
        return state, qp, new, optax.apply_updates(qp, updates), logical, nv.quantize(logical["w"][1])

    state, qp, new, new_params, logical, ref = update(params, grads)
    finite = all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    before = state.master
    if finite:
        assert int(new.skipped) == 0
        for k in ("w", "b"):
            want = np.asarray(logical[k][0]) + np.asarray(grads[k], np.float32) * np.float32(-0.125)
            np.testing.assert_allclose(np.asarray(logical[k][1]), want, rtol=1e-6, atol=1e-37)
        # The stored weight is exactly the quantized master, bit for bit.
        for a, b in zip(jax.tree.leaves(new_params["w"]), jax.tree.leaves(ref)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert np.asarray(new_params["b"]).tobytes() == np.asarray(logical["b"][1]).tobytes()
    else:
        # Skipped: nothing moves but the count.
        assert int(new.skipped) == 1
        for a, b in zip(jax.tree.leaves((new.master, new_params)), jax.tree.leaves((before, qp))):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from([(16, 17), (17, 16), (16,), (1, 16, 16)]), drop=st.booleans())
def test_master_weights_update_rejects_mismatched_grads(shape, drop):
    params = {"w": jnp.ones((16, 16), jnp.float32), "b": jnp.ones((16,), jnp.float32)}
    tx = nv.master_weights(optax.sgd(0.1))
    state, qp = tx.init(params), nv.quantize_params(params)
    grads = {"w": jnp.ones(shape, jnp.float32)} if drop else {"w": jnp.ones(shape, jnp.float32), "b": jnp.ones(16)}
    with pytest.raises(ValueError, match=re.compile(r"gradient|do not match", re.I)):
        tx.update(grads, state, qp)
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update(grads, state)
