import functools

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jax_nvfp4 import numerics as nx


def test_decode_all_256_bytes():
    data = jnp.arange(256, dtype=jnp.uint8)
    codes = np.asarray(nx.unpack_codes(data)).reshape(256, 2)
    np.testing.assert_array_equal(codes[:, 0], np.arange(256) & 0xF)
    np.testing.assert_array_equal(codes[:, 1], np.arange(256) >> 4)
    vals = np.asarray(nx.decode_e2m1(jnp.asarray(codes)))
    # Independent decode: ml_dtypes' float4_e2m1fn interprets the same 4-bit codes.
    expect = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(vals, expect)
    np.testing.assert_array_equal(np.signbit(vals), np.signbit(expect))  # code 8 is -0
    # And pack is the exact inverse of unpack.
    np.testing.assert_array_equal(np.asarray(nx.pack_codes(jnp.asarray(codes.reshape(-1)))), np.arange(256))


TIES = [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14),
]


@pytest.mark.parametrize("value,code", TIES)
def test_every_tie_rounds_to_even(value, code):
    got = int(jax.jit(nx.encode_e2m1)(jnp.float32(value)))
    assert got == code


def test_encode_grid_neighbours_and_signs():
    grid = nx.E2M1_VALUES
    xs = np.concatenate([grid, -grid, np.nextafter(grid, 7), np.nextafter(grid, -1)]).astype(np.float32)
    xs = np.clip(xs, -6, 6)
    # nextafter(0, +-1) is subnormal, which XLA:CPU flushes; use tiny normal values instead.
    xs[xs == np.nextafter(np.float32(0), np.float32(7))] = 1e-30
    xs[xs == np.nextafter(np.float32(0), np.float32(-1))] = -1e-30
    got = np.asarray(nx.encode_e2m1(jnp.asarray(xs)))
    # Reference by nearest value with ties to even code, on the explicit value table.
    from reference import _e2m1_code

    np.testing.assert_array_equal(got, _e2m1_code(xs))
    assert int(nx.encode_e2m1(jnp.float32(-0.1))) == 8
    assert int(nx.encode_e2m1(jnp.float32(-0.0))) == 0
    assert int(nx.encode_e2m1(jnp.float32(np.nan))) == 0


@functools.partial(jax.jit, static_argnums=1)
def stochastic_rounds(v, n):
    """``decode(encode_stochastic(v))`` of ``n`` copies of ``v``, drawn by element index (one
    program for all the values: op by op, each of its ops compiles a program of its own)."""
    u = nx.uniform_from_index(jax.random.key(0), jnp.arange(n, dtype=jnp.uint32))
    return nx.decode_e2m1(nx.encode_e2m1_stochastic(jnp.full((n,), v, jnp.float32), u))


def test_stochastic_rounding_is_unbiased_and_exact_on_grid():
    n = 200_000
    for v in [0.1, 0.3, 1.2, 2.7, 4.9, -3.3, 5.99]:
        mean = float(np.mean(np.asarray(stochastic_rounds(np.float32(v), n), np.float64)))
        # Binomial standard error of the mean is at most gap/2/sqrt(n) <= 2.3e-3 for gap 2.
        assert abs(mean - v) < 5 * 1.0 / np.sqrt(n) + 1e-6, (v, mean)
    for g in nx.E2M1_VALUES:
        np.testing.assert_array_equal(np.asarray(stochastic_rounds(np.float32(g), 1000)), g)


def test_uniform_from_index_depends_on_key_and_index_only():
    k = jax.random.key(3)
    a = nx.uniform_from_index(k, jnp.arange(10, 20, dtype=jnp.uint32))
    b = nx.uniform_from_index(k, jnp.arange(0, 30, dtype=jnp.uint32))[10:20]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = nx.uniform_from_index(jax.random.key(4), jnp.arange(10, 20, dtype=jnp.uint32))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    u = np.asarray(nx.uniform_from_index(k, jnp.arange(100_000, dtype=jnp.uint32)))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002


def test_hadamard_matrix_is_the_recipes_and_orthogonal():
    h = nx.hadamard_matrix(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    # Row i of diag(signs) @ H16 carries sign i; entries are +-1/4.
    assert set(np.unique(np.abs(h))) == {0.25}
    np.testing.assert_array_equal(np.sign(h[:, 0]), nx.RHT_SIGNS)
    sylvester = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    np.testing.assert_array_equal(np.sign(h) * nx.RHT_SIGNS[:, None], sylvester)


def test_hadamard_transform_cancels_in_a_contraction():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    b = rng.standard_normal((64, 12)).astype(np.float32)
    ta = nx.hadamard_transform(jnp.asarray(a), axis=1)
    tb = nx.hadamard_transform(jnp.asarray(b), axis=0)
    np.testing.assert_allclose(np.asarray(ta @ tb), a @ b, rtol=1e-4, atol=1e-4)
    # Group-local: each 16-group is transformed by the same matrix.
    np.testing.assert_allclose(np.asarray(ta)[:, 16:32], a[:, 16:32] @ nx.hadamard_matrix(16), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        nx.hadamard_transform(jnp.ones((3, 20)))


def test_abs_max_propagates_nan_and_keeps_subnormals():
    x = jnp.asarray([1.0, -3.0, 2.0], jnp.float32)
    assert float(nx.abs_max(x, 0)) == 3.0
    assert np.isnan(float(nx.abs_max(x.at[1].set(jnp.nan), 0)))
    assert float(nx.abs_max(x.at[0].set(-jnp.inf), 0)) == np.inf
    assert float(jax.jit(lambda v: nx.abs_max(v, 0))(jnp.asarray([1e-40, -2e-40], jnp.float32))) == np.float32(2e-40)
