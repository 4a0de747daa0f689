import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

import jax_nvfp4 as nv
import reference as ref


def as_bytes(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)

quantize_jit = jax.jit(nv.quantize, static_argnames=("block", "rounding"))


def assert_matches_reference(x, block):
    q = quantize_jit(jax.device_put(x), block=block)
    d, s, a = ref.quantize(np.asarray(x), block)
    np.testing.assert_array_equal(np.asarray(q.data), d)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), s)
    np.testing.assert_array_equal(np.asarray(q.amax), a)
    return q


BLOCKS = [(16, 16), (1, 16), (16, 1)]


@pytest.mark.parametrize("block", BLOCKS)
def test_layout_and_fields(block):
    x = jnp.ones((3, 50, 72), jnp.float32)
    q = nv.quantize(x, block=block)
    assert q.data.dtype == jnp.uint8 and q.data.shape == (3, 50, 36)
    assert q.scale.dtype == jnp.float8_e4m3fn
    assert q.scale.shape == {(16, 16): (3, 4, 5), (1, 16): (3, 50, 5), (16, 1): (3, 4, 72)}[block]
    assert q.amax.dtype == jnp.float32 and q.amax.shape == (3,)
    assert q.shape == (3, 50, 72) and q.block == block
    assert q.nbytes == 3 * 50 * 36 + int(np.prod(q.scale.shape)) + 12


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_bit_exact_random(block, dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 96)) * 0.02).astype(dtype)
    assert_matches_reference(x, block)


@pytest.mark.parametrize("block", BLOCKS)
def test_bit_exact_on_shapes_no_block_divides(block):
    # Odd columns: a (16, 1) block pads none, so the last byte takes one zero code.
    x = np.random.default_rng(5).standard_normal((2, 33, 17)).astype(np.float32)
    q = assert_matches_reference(x, block)
    assert q.data.shape == (2, 33, 9)


@pytest.mark.parametrize("block", BLOCKS)
def test_bit_exact_edge_cases(block):
    rng = np.random.default_rng(2)
    zeros = np.zeros((32, 48), np.float32)
    q = assert_matches_reference(zeros, block)
    assert not np.asarray(q.data).any() and not np.asarray(q.scale).view(np.uint8).any()
    np.testing.assert_array_equal(np.asarray(nv.dequantize(q, jnp.float32)), zeros)
    # All-zero blocks inside a non-zero tensor.
    x = rng.standard_normal((32, 48)).astype(np.float32)
    x[:16, :16] = 0
    x[20] = 0
    assert_matches_reference(x, block)
    # Values exactly on the E2M1 rounding ties after scaling: amax 6 -> S*D == 1, s == 448/448.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    t = np.tile(np.concatenate([ties, -ties]), (16, 3))
    assert_matches_reference(t, block)
    # Huge and tiny magnitudes, together and alone.
    unit = x / np.abs(x).max()
    for scale in (1e30, 1e-30, 3e38, 1e-33):
        assert_matches_reference(unit * np.float32(scale), block)
    mixed = x.copy()
    mixed[::2] *= np.float32(1e30)
    mixed[1::2] *= np.float32(1e-30)
    assert_matches_reference(mixed, block)
    # Rows whose ranges differ by 2^40: E4M3 subnormal and zero block scales.
    ranged = x * np.exp2(-np.arange(32, dtype=np.float32) * 40 / 31)[:, None]
    q = assert_matches_reference(ranged, block)
    sc = np.asarray(q.scale).view(np.uint8)
    assert ((sc & 0x78) == 0).any(), "expected E4M3 subnormal or zero block scales"


@pytest.mark.parametrize("block", BLOCKS)
def test_bf16_input_equals_its_float32_value(block):
    rng = np.random.default_rng(3)
    xb = jnp.asarray(rng.standard_normal((33, 40)), jnp.bfloat16)
    qa, qb = nv.quantize(xb, block=block), nv.quantize(xb.astype(jnp.float32), block=block)
    for a, b in zip(jax.tree.leaves(qa), jax.tree.leaves(qb)):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    assert_matches_reference(np.asarray(xb), block)


def test_non_finite_input_is_flagged_and_decodes_to_nan():
    x = np.ones((32, 32), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[5, 7] = bad
        q = nv.quantize(jax.device_put(y))
        assert not bool(q.isfinite()) and not bool(nv.array.isfinite(q))
        assert np.isnan(np.asarray(nv.dequantize(q, jnp.float32))).all()
    # Batched: only the poisoned matrix is flagged.
    xs = np.ones((3, 16, 16), np.float32)
    xs[1, 0, 0] = np.nan
    q = nv.quantize(jax.device_put(xs))
    np.testing.assert_array_equal(np.asarray(q.isfinite()), [True, False, True])
    dq = np.asarray(nv.dequantize(q, jnp.float32))
    assert np.isfinite(dq[0]).all() and np.isnan(dq[1]).all()


def test_explicit_amax_is_used():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 32)).astype(np.float32)
    q = nv.quantize(jax.device_put(x), amax=8.0)
    d, s, a = ref.quantize_matrix(x, amax=np.float32(8.0))
    np.testing.assert_array_equal(np.asarray(q.data), d)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), s)
    assert float(q.amax) == 8.0


def test_batch_axes_have_their_own_amax():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 20, 40)).astype(np.float32) * np.float32([1, 100, 1e-3])[None, :, None, None]
    q = assert_matches_reference(x, (16, 16))
    assert q.amax.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            qi = nv.quantize(jax.device_put(x[i, j]))
            np.testing.assert_array_equal(np.asarray(q.data[i, j]), np.asarray(qi.data))


def test_errors_are_clear():
    with pytest.raises(ValueError, match="block"):
        nv.quantize(jnp.ones((16, 16)), block=(8, 8))
    with pytest.raises(ValueError, match="key"):
        nv.quantize(jnp.ones((16, 16)), rounding="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        nv.quantize(jnp.ones((16, 16)), rounding="up")
    with pytest.raises(TypeError, match="floating"):
        nv.quantize(jnp.ones((16, 16), jnp.int32))
    with pytest.raises(ValueError, match="2 axes"):
        nv.quantize(jnp.ones((16,)))
    with pytest.raises(TypeError):
        nv.dequantize(jnp.ones((16, 16)))


def test_pytree_jit_vmap_eval_shape():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 32, 48)), jnp.float32)
    q = nv.quantize(x)
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 3
    q2 = jax.tree.unflatten(treedef, leaves)
    assert q2.shape == q.shape
    # vmap over the batch axis equals the batched quantize.
    qv = jax.vmap(nv.quantize)(x)
    assert qv.shape == (4, 32, 48)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(qv)):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    # vmap of dequantize too.
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda t: nv.dequantize(t, jnp.float32))(q)), np.asarray(nv.dequantize(q, jnp.float32))
    )
    # eval_shape gives ShapeDtypeStructs matching NVFP4Array.abstract.
    abs_q = jax.eval_shape(nv.quantize, x)
    ref_abs = nv.NVFP4Array.abstract((4, 32, 48))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abs_q) == jax.tree.map(lambda a: (a.shape, a.dtype), ref_abs)
    # tree_map keeps the type; jit round trip through arguments and outputs.
    mapped = jax.tree.map(lambda a: a, q)
    assert isinstance(mapped, nv.NVFP4Array)
    out = jax.jit(lambda t: nv.dequantize(t, jnp.float32))(q)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(nv.dequantize(q, jnp.float32)))


def test_with_sharding_constraint_on_leaves():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.ones((128, 64), jnp.float32)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    @jax.jit
    def f(x):
        q = nv.quantize(x)
        return jax.lax.with_sharding_constraint(q, nv.NVFP4Array(spec, spec, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), q.matrix_shape, q.block))

    q = f(x)
    assert q.data.sharding.spec == jax.sharding.PartitionSpec("data")


# ---------------------------------------------------------------- property tests
shapes = st.tuples(st.integers(1, 3), st.integers(1, 70), st.integers(1, 70))


def _arrays(draw, shape):
    seed = draw(st.integers(0, 2**31 - 1))
    log_range = draw(st.floats(-10, 10))
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp2(log_range)).astype(np.float32)


@settings(max_examples=6)  # each new shape compiles anew
@given(st.data(), shapes, st.sampled_from(BLOCKS))
def test_roundtrip_error_bound_and_padding(data, shape, block):
    x = _arrays(data.draw, shape)
    q = nv.quantize(jax.device_put(x), block=block)
    assert q.shape == shape
    dq = np.asarray(nv.dequantize(q, jnp.float32))
    # Per-element bound: half the largest E2M1 gap (1 step of 2 at the top, relative to the
    # scaled range 6) times the block's E4M3 decode scale, plus the E4M3 resolution floor.
    br, bc = block
    rp, cp = -(-shape[1] // br) * br, -(-shape[2] // bc) * bc
    xp = np.zeros((shape[0], rp, cp), np.float32)
    xp[:, : shape[1], : shape[2]] = np.abs(x)
    bam = xp.reshape(shape[0], rp // br, br, cp // bc, bc).max(axis=(2, 4))
    bam = np.repeat(np.repeat(bam, br, 1), bc, 2)[:, : shape[1], : shape[2]]
    amax = np.abs(x).max(axis=(1, 2))[:, None, None]
    bound = bam * (1.0 / 6.0) * (17.0 / 16.0) + 6 * 2.0**-10 * amax / 2688 * 2
    assert (np.abs(dq - x) <= bound * (1 + 1e-6)).all()
    assert_matches_reference(x, block)


@settings(max_examples=6)
@given(st.data(), st.integers(1, 50), st.integers(1, 50), st.sampled_from(BLOCKS))
def test_transpose_equals_quantizing_the_transpose(data, rows, cols, block):
    # The block turns with the matrix: (16, 16) stays, (1, 16) and (16, 1) swap.
    x = _arrays(data.draw, (rows, cols))
    qt = nv.array.transpose(nv.quantize(jax.device_put(x), block=block))
    q2 = nv.quantize(jax.device_put(x.T), block=block[::-1])
    assert qt.shape == (cols, rows) and qt.block == block[::-1]
    for a, b in zip(jax.tree.leaves(qt), jax.tree.leaves(q2)):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    np.testing.assert_array_equal(np.asarray(nv.dequantize(qt, jnp.float32)), np.asarray(nv.dequantize(q2, jnp.float32)))


@given(st.data(), st.sampled_from(BLOCKS))
def test_stochastic_rounding_unbiased_and_reproducible(data, block):
    x = _arrays(data.draw, (16, 32))
    key = jax.random.key(data.draw(st.integers(0, 1000)))
    qs = jax.vmap(lambda k: nv.quantize(jax.device_put(x), block=block, rounding="stochastic", key=k))(
        jax.random.split(key, 1000)
    )
    dq = np.asarray(jax.vmap(lambda t: nv.dequantize(t, jnp.float32))(qs), np.float64)
    mean = dq.mean(0)
    # Elementwise standard error <= gap/2/sqrt(n); the gap is at most 2 * decode scale.
    q_near = nv.quantize(jax.device_put(x), block=block)
    step = np.abs(np.asarray(nv.dequantize(q_near, jnp.float32), np.float64)).max() / 3
    assert np.abs(mean - x).max() <= 6 * step / np.sqrt(1000) + 1e-12 * np.abs(x).max()
    # Reproducible from the key.
    a = nv.quantize(jax.device_put(x), block=block, rounding="stochastic", key=key)
    b = nv.quantize(jax.device_put(x), block=block, rounding="stochastic", key=key)
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_boundary_inputs_are_refused():
    """Inputs that would quantize or decode to wrong values are clear errors."""
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 32, 32)), jnp.float32)
    for amax in (-1.0, float("-inf"), jnp.asarray([1.0, -2.0]), np.float32(-1.0), np.float64(-2.0)):
        with pytest.raises(ValueError, match="amax must be >= 0"):
            nv.quantize(x, amax=amax)
    with pytest.raises(ValueError, match="batch shape"):
        nv.quantize(x, amax=jnp.ones((3,)))
    with pytest.raises(TypeError, match="amax"):
        nv.quantize(x, amax=jnp.ones((2,), jnp.int32))
    with pytest.raises(TypeError, match="amax"):
        nv.quantize(x, amax="1.0")
    # NaN / +Inf amax are the documented "non-finite matrix" marker; 0 and positives pass.
    assert not bool(nv.quantize(x, amax=float("nan")).isfinite().any())
    assert bool(nv.quantize(x, amax=jnp.full((2,), 8.0)).isfinite().all())
    for block in ((16.9, 16), (16.0, 16), (True, 16), "16", 16):
        with pytest.raises(ValueError, match="block"):
            nv.quantize(x, block=block)
    assert nv.quantize(x, block=(np.int64(1), 16)).block == (1, 16)
    q = nv.quantize(x)
    for dtype in (jnp.int8, jnp.uint8, jnp.bool_, jnp.int32):
        with pytest.raises(TypeError, match="floating-point dtype"):
            nv.dequantize(q, dtype)
    assert nv.dequantize(q, jnp.float16).dtype == jnp.float16


def test_create_refuses_values_no_quantization_writes():
    """Bytes from outside (a loader, a conversion) that would decode to plausible but wrong
    weights under isfinite() True: a negative amax (every weight negated), an amax of 0 over
    non-zero codes (zeros), a negative or NaN scale byte; integer scale values other than the
    bytes themselves; a float matrix_shape."""
    q = nv.quantize(jnp.asarray(np.random.default_rng(12).standard_normal((2, 32, 32)), jnp.float32))
    create = lambda data=q.data, scale=q.scale_bits, amax=q.amax: nv.NVFP4Array.create(data, scale, amax, (32, 32))
    assert np.array_equal(np.asarray(create().data), np.asarray(q.data))
    for kw, needle in (({"amax": -q.amax}, "negative amax"), ({"amax": q.amax.at[1].set(-jnp.inf)}, "negative amax"),
                       ({"amax": q.amax.at[0].set(0.0)}, "amax 0 over non-zero codes"),
                       ({"scale": q.scale_bits.at[0, 0, 0].set(0x7F)}, "negative or NaN"),
                       ({"scale": q.scale_bits.at[1, 1, 1].set(0x81)}, "negative or NaN")):
        with pytest.raises(ValueError, match=needle):
            create(**kw)
    poisoned = nv.quantize(q.dequantize(jnp.float32).at[1, 0, 0].set(jnp.nan))  # NaN scales, by design
    assert not bool(create(scale=poisoned.scale_bits, amax=poisoned.amax).isfinite()[1])
    zero = nv.quantize(jnp.zeros((16, 16)))  # amax 0 over zero codes: an all-zero matrix
    assert float(nv.NVFP4Array.create(zero.data, zero.scale_bits, zero.amax, (16, 16)).amax) == 0.0
    with pytest.raises(TypeError, match="E4M3 values .* or their bytes"):
        create(scale=q.scale_bits.astype(jnp.int32))
    with pytest.raises(ValueError, match="matrix_shape must be two positive ints"):
        nv.NVFP4Array(q.data, q.scale_bits, q.amax_bits, (32.0, 32.0))


def test_quantize_params_reads_stacked_layers_as_shard_params_does():
    # A scanned [32, 64] norm scale is a vector per layer: quantized as a matrix it kept 4 distinct values.
    rng = np.random.default_rng(9)
    params = {"blocks": {"norm": {"scale": jnp.asarray(1 + 0.05 * rng.standard_normal((32, 64)), jnp.float32)},
                         "mlp": {"kernel": jnp.asarray(rng.standard_normal((32, 64, 64)), jnp.float32)}}}
    rules = nv.Rules(stacked=("^blocks/",))
    q = nv.quantize_params(params, rules=rules)
    assert q["blocks"]["norm"]["scale"] is params["blocks"]["norm"]["scale"]
    assert nv.array.is_nvfp4(q["blocks"]["mlp"]["kernel"])
    assert nv.array.is_nvfp4(nv.quantize_params(params)["blocks"]["norm"]["scale"])  # without the rule: a matrix


def test_a_kept_python_scalar_leaf_takes_the_keep_dtype():
    policy = nv.Policy(keep=("temperature",), keep_dtype=jnp.bfloat16)
    params = {"temperature": 0.7, "w": jnp.ones((16, 16))}
    assert nv.quantize_params(params, policy)["temperature"].dtype == jnp.bfloat16


def test_quantize_refuses_a_zero_amax_for_a_nonzero_matrix():
    # It quantized every value to zero with isfinite() True.
    x = jnp.asarray(np.random.default_rng(10).standard_normal((2, 16, 32)), jnp.float32)
    for amax in (0.0, np.asarray([3.0, 0.0], np.float32), np.float32(0.0)):  # a NumPy scalar is a known value too
        with pytest.raises(ValueError, match="amax=0 for a matrix holding non-zero values"):
            nv.quantize(x, amax=amax)
    # 0 is the amax of an all-zero matrix, and only of it.
    x0 = x.at[1].set(0.0)
    q = nv.quantize(x0, amax=np.asarray([float(jnp.abs(x0[0]).max()), 0.0], np.float32))
    assert np.array_equal(np.asarray(q.amax)[1], 0.0) and not np.asarray(nv.dequantize(q, jnp.float32)[1]).any()


def test_quantize_under_grad_raises_and_the_straight_through_rule_is_the_identity():
    # jax.grad through dequantize(quantize(x)) raises instead of returning zeros without a word.
    x = jnp.asarray(np.random.default_rng(11).standard_normal((16, 32)), jnp.float32)
    with pytest.raises(TypeError, match="quantize is not differentiable"):
        jax.grad(lambda v: nv.dequantize(nv.quantize(v), jnp.float32).sum())(x)
    with pytest.raises(TypeError, match="straight-through"):
        jax.jvp(lambda v: nv.quantize(v).data, (x,), (x,))
    # The documented straight-through estimator: the quantized value, the identity gradient.
    ste = lambda v: v + jax.lax.stop_gradient(nv.dequantize(nv.quantize(jax.lax.stop_gradient(v)), v.dtype) - v)
    y, vjp = jax.vjp(ste, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nv.dequantize(nv.quantize(x), jnp.float32)))
    g = jnp.asarray(np.random.default_rng(12).standard_normal((16, 32)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(vjp(g)[0]), np.asarray(g))
    # A stopped input quantizes inside a differentiated function as before.
    got = jax.grad(lambda v: (v * nv.dequantize(nv.quantize(jax.lax.stop_gradient(v)), jnp.float32)).sum())(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(y))


def test_hand_built_arrays_must_fit_together():
    q = nv.quantize(jnp.asarray(np.random.default_rng(8).standard_normal((2, 32, 48)), jnp.float32))
    bad = [
        (q.data, q.scale_bits[..., :1], q.amax_bits, q.matrix_shape, "scale has shape"),   # would broadcast
        (q.data[..., :8], q.scale_bits, q.amax_bits, q.matrix_shape, "data has shape"),
        (q.data, q.scale_bits, q.amax_bits[:1], q.matrix_shape, "amax has shape"),
        (q.data, q.scale_bits, q.amax_bits, (32, 64), "shape"),
    ]
    for data, scale, amax, ms, needle in bad:
        with pytest.raises(ValueError, match=needle):
            nv.NVFP4Array(data, scale, amax, ms, q.block)
        with pytest.raises(ValueError, match=needle):
            nv.NVFP4Array.create(data, jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn), q.amax[: amax.shape[0]], ms)
    with pytest.raises(ValueError, match="matrix_shape"):
        nv.NVFP4Array.create(q.data, q.scale_bits, q.amax, (32,))
    with pytest.raises(TypeError, match="uint8"):
        nv.NVFP4Array.create(q.data.astype(jnp.int32), q.scale_bits, q.amax, q.matrix_shape)
    # The constructor checks the dtypes as create() does: int32 codes would decode wrong.
    for data, scale, amax, needle in ((q.data.astype(jnp.int32), q.scale_bits, q.amax_bits, "data must be packed uint8"),
                                      (q.data, q.scale_bits.astype(jnp.int8), q.amax_bits, "scale_bits must be uint8"),
                                      (q.data, q.scale_bits, q.amax, "amax_bits must be the uint32 bits")):
        with pytest.raises(TypeError, match=needle):
            nv.NVFP4Array(data, scale, amax, q.matrix_shape, q.block)
    same = nv.NVFP4Array.create(q.data, q.scale, q.amax, q.matrix_shape, q.block)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(q)))
    # Under jit the leaves are tracers: construction stays free (checked on concrete arrays).
    assert jax.jit(lambda t: nv.dequantize(t, jnp.float32))(q).shape == (2, 32, 48)


def test_numpy_inputs_are_transferred_not_staged():
    """A NumPy array given to quantize or NVFP4Array.create is transferred as it is (float64
    becoming float32, as jnp.asarray makes it): quantizing a new shape compiles the quantizer
    only, not also a program that stages the input (jnp.asarray of a NumPy array does)."""
    import jax.monitoring

    from jax_nvfp4.array import as_array

    x = np.random.default_rng(9).standard_normal((3, 37, 53))  # float64, a shape no other test uses
    compiled = []
    listener = lambda event, _duration, **kw: compiled.append(kw.get("fun_name")) if event.endswith(
        "backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        q = nv.quantize(x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == ["jit(_quantize)"], compiled
    want = nv.quantize(jnp.asarray(x))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(want)))
    host = jax.device_get(q)
    same = nv.NVFP4Array.create(host.data, host.scale, np.asarray(host.amax), q.matrix_shape, q.block)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(q)))
    assert as_array(np.float64(1.5)).dtype == jnp.float32 and as_array([1, 2]).shape == (2,)


def test_an_invalid_traced_amax_marks_the_matrix_non_finite():
    """Under jit the amax's value is not known when quantize runs its checks: an amax they would
    refuse (0 for a non-zero matrix, negative, -Inf) makes that matrix non-finite (NaN amax,
    NaN values) instead of all-zero or plausible wrong weights; valid amaxes keep their bits."""
    x = jnp.asarray(np.random.default_rng(11).standard_normal((3, 16, 32)), jnp.float32)
    x = x.at[2].set(0.0)  # an all-zero matrix: 0 is its amax
    f = jax.jit(lambda v, a: nv.quantize(v, amax=a))
    for bad in (0.0, -1.0, float("-inf")):
        q = f(x, jnp.asarray([bad, 8.0, 0.0], jnp.float32))
        np.testing.assert_array_equal(np.asarray(q.isfinite()), [False, True, True])
        assert np.isnan(np.asarray(nv.dequantize(q, jnp.float32))[0]).all()
        eager = nv.quantize(x[1], amax=8.0)
        np.testing.assert_array_equal(np.asarray(q.data[1]), np.asarray(eager.data))
        np.testing.assert_array_equal(np.asarray(q.scale_bits[1]), np.asarray(eager.scale_bits))
    # A traced x with a known zero amax, too.
    q = jax.jit(lambda v: nv.quantize(v, amax=0.0))(x[0])
    assert not bool(q.isfinite())


def test_a_given_amax_of_minus_zero_is_the_amax_zero():
    # -0.0 (max(-x.min(), x.max()) of zeros) made every scale NaN: a zero matrix decoded to NaN under isfinite() True.
    for quantize in (nv.quantize, jax.jit(nv.quantize)):
        q = quantize(jnp.zeros((16, 32)), amax=jnp.float32(-0.0))
        assert int(q.amax_bits) == 0 and not np.asarray(q.scale_bits).any() and not np.asarray(q.data).any()
        assert bool(q.isfinite()) and not np.asarray(nv.dequantize(q, jnp.float32)).any()


def test_a_negative_value_whose_scaled_value_is_subnormal_encodes_to_minus_zero():
    # x * e = -1e-30 * 6/1e9 is a float32 subnormal: the reference keeps its sign (code 8, -0); XLA:CPU flushes the
    # product to +0, which gave code 0. -1.5e-38's product is below half the smallest subnormal: -0.0, code 0 in the
    # reference too. Values and amax are normal floats, inside the contract.
    x = np.zeros((3, 16), np.float32)
    x[0, :4] = 1e9, -1e-30, -1e-36, -1.5e-38
    x[1, :2] = 3221225472.0, -3.761582e-37  # a product of exactly 2^-150: -0.0, code 0, everywhere
    x[2, :3] = 1e9, 1e-30, -1e-30
    for block in ((1, 16), (16, 16)):
        q = nv.quantize(x, block=block)
        np.testing.assert_array_equal(np.asarray(q.data), ref.quantize_matrix(x, block)[0])
    assert [int(b) for b in np.asarray(nv.quantize(x, block=(1, 16)).data)[:2, 0]] == [0x87, 0x07]  # 7, 8 | 7, 0
    # Stochastic rounding: a draw of 0 rounds a subnormal value of either sign away from zero, as the reference does.
    codes, _, _ = nv.array.quantize_padded(jnp.asarray(x), (1, 16), uniform=jnp.zeros(x.shape))
    data = ref.quantize_matrix(x, (1, 16), uniform=np.zeros(x.shape))[0]
    want = np.stack([data & 15, data >> 4], axis=-1).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(codes), want)
    assert list(want[2, :3]) == [7, 1, 9]
