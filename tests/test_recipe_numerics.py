"""The recipe's three GEMMs against the independent NumPy reference (tests/reference.py).

For ``y = x @ W``: each quantized operand's bytes (packed codes, E4M3 scales, amax) equal the
reference's quantization of the right tensor along the right axis, with the right rounding,
and fprop, dgrad and wgrad as :func:`jax_nvfp4.gemm.dot` computes them equal the product of
the reference's dequantized operands (float64 here, float32 at HIGHEST there).

- fprop  ``q1d(x)`` along K (nearest) x ``W`` in 16x16 tiles (nearest).
- dgrad  ``q1d_sr(dy)`` along N (stochastic) x the stored tiles transposed (no re-quantization).
- wgrad  ``q1d(H xᵀ)`` and ``q1d_sr(H dyᵀ)`` along the tokens (H: the Hadamard transform in
  groups of 16 tokens, tokens zero-padded to a multiple of 16); only dy stochastic.

Stochastic rounding: the reference rounds with the recipe's own draws, ``uniform(key, flat
index)`` transcribed in NumPy (``reference.uniform_from_index``) from the key's two seed words,
and the keys split as the recipe does (dgrad, wgrad). The rounding rule itself (up when the
draw is below the fractional distance) is the reference's own; its unbiasedness over many keys
is checked in test_gemm.py. The Hadamard transform is a float32 matrix product whose summation
order is XLA's: it is checked against float64 to a few ulps, and the wgrad operands' bytes
against the reference quantization of both the transformed values the recipe quantized and the
reference's own float64 transform.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import gemm
from jax_nvfp4 import numerics as nx
import reference as ref

F32 = np.float32
# (M tokens, K, N): multiples of 16, and not (every padding path: tokens, K, N, odd columns).
SHAPES = [(32, 48, 64), (24, 40, 24), (21, 35, 19)]


def data(shape, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    # Heavy-tailed values, so that blocks have outliers and scales vary.
    return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape)) * scale).astype(F32)


def seeds(key):
    return np.asarray(jax.random.bits(key, (2,), jnp.uint32))


def ref_q(a, block, key=None):
    """The reference's (data, scale bytes, amax) of matrix ``a``; stochastic with ``key``."""
    a = np.asarray(a, F32)
    u = None if key is None else ref.stochastic_uniform(seeds(key), a.shape)
    return ref.quantize_matrix(a, block, uniform=u)


def ref_deq(q, shape, block):
    return ref.dequantize_matrix(*q, shape, block).astype(np.float64)


def assert_bytes(q, expect, what, amax_ulps=0):
    """Codes and scale bytes equal; the amax's bits equal (or within ``amax_ulps``)."""
    d, s, amax = expect
    np.testing.assert_array_equal(np.asarray(q.data), d, err_msg=f"{what}: codes")
    np.testing.assert_array_equal(np.asarray(q.scale_bits), s, err_msg=f"{what}: scales")
    got, want = (int(np.asarray(a, F32).view(np.uint32)) for a in (q.amax, amax))
    assert abs(got - want) <= amax_ulps, (what, got, want)


def ref_rht(a):
    """:func:`reference.rht` with the recipe's signs, in float64."""
    return ref.rht(a, nx.RHT_SIGNS)


def pad_tokens(a):
    return np.pad(a, ((0, 0), (0, -a.shape[1] % 16)))


@jax.jit
def _grads(x, wq, w, dy, key):
    y, vjp = jax.vjp(lambda a, b: gemm.dot(a, wq, b, key=key, backend="emulate"), x, w)
    return (y, *vjp(dy))


@jax.jit
def _operands(x, dy, key):
    k_dgrad, k_wgrad = gemm._backward_keys(key)
    return (gemm._fprop_operand(x), gemm._dgrad_operand(dy, k_dgrad),
            *gemm._wgrad_operands(x, dy, k_wgrad, True), k_dgrad, k_wgrad)


@pytest.mark.parametrize("m,k,n,dtype", [(*s, "float32") for s in SHAPES] + [(24, 40, 24, "bfloat16")])
def test_recipe_operands_and_gemms_match_the_reference(m, k, n, dtype):
    """float32, and bf16 activations and gradients as in training (float32 master W); the
    reference quantizes the bf16 values."""
    as_dtype = lambda a: np.asarray(jnp.asarray(a, dtype), F32)
    x, w, dy = as_dtype(data((m, k), 1)), data((k, n), 2, 0.05), as_dtype(data((m, n), 3, 1e-3))
    key = jax.random.key(11)
    xj, dyj = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
    wj = jax.device_put(w)
    wq = nv.quantize(wj)
    xq, dyq, xtq, gtq, k_dgrad, k_wgrad = _operands(xj, dyj, key)
    # The recipe's key split: one key for dgrad, one for wgrad, distinct.
    kd, kw = jax.random.split(key)
    np.testing.assert_array_equal(seeds(k_dgrad), seeds(kd))
    np.testing.assert_array_equal(seeds(k_wgrad), seeds(kw))
    assert not np.array_equal(seeds(kd), seeds(kw))

    # fprop: x in 1x16 blocks along K, W in 16x16 tiles, both round to nearest.
    assert xq.block == (1, 16) and xq.shape == (m, k)
    assert_bytes(xq, ref_q(x, (1, 16)), "fprop x")
    assert_bytes(wq, ref_q(w, (16, 16)), "fprop W")
    # dgrad: dy in 1x16 blocks along N, stochastic with the dgrad key; Wᵀ is the stored
    # tiles transposed, bit-identical to quantizing Wᵀ.
    assert dyq.block == (1, 16) and dyq.shape == (m, n)
    ref_dyq = ref_q(dy, (1, 16), kd)
    assert_bytes(dyq, ref_dyq, "dgrad dy")
    assert not np.array_equal(ref_dyq[0], ref_q(dy, (1, 16))[0])  # the rounding is stochastic
    assert_bytes(nv.array.transpose(wq), ref_q(w.T, (16, 16)), "dgrad Wᵀ")
    # wgrad: xᵀ and dyᵀ [*, M'] Hadamard-transformed along the tokens, 1x16 blocks along them,
    # only dyᵀ stochastic (with the wgrad key).
    mp = -(-m // 16) * 16
    assert xtq.shape == (k, mp) and gtq.shape == (n, mp) and xtq.block == gtq.block == (1, 16)
    h_x = np.asarray(nx.hadamard_transform(jax.device_put(pad_tokens(x.T)), axis=-1))
    h_dy = np.asarray(nx.hadamard_transform(jax.device_put(pad_tokens(dy.T)), axis=-1))
    for got, a in ((h_x, x.T), (h_dy, dy.T)):
        exact = ref_rht(pad_tokens(a))
        # Within a few float32 ulps of the group's largest input (a sum of 16 rounded terms).
        ulp = np.spacing(np.abs(pad_tokens(a)).reshape(a.shape[0], -1, 16).max(-1).astype(F32))
        assert (np.abs(got - exact).reshape(a.shape[0], -1, 16) <= 4 * ulp[..., None]).all()
    assert_bytes(xtq, ref_q(h_x, (1, 16)), "wgrad xᵀ")
    assert_bytes(gtq, ref_q(h_dy, (1, 16), kw), "wgrad dyᵀ")
    # The float32 rounding of the transform moves no code or scale here: codes and scales are
    # also the reference's own (float64) transform quantized (0 of 78720 codes differ over 20
    # seeds; only a value within an ulp of a rounding boundary could); the amax (itself a
    # transformed value) within an ulp.
    assert_bytes(xtq, ref_q(ref_rht(pad_tokens(x.T)).astype(F32), (1, 16)), "wgrad xᵀ, float64 RHT", 1)
    assert_bytes(gtq, ref_q(ref_rht(pad_tokens(dy.T)).astype(F32), (1, 16), kw), "wgrad dyᵀ, float64 RHT", 1)

    # The GEMMs: the products of the reference's dequantized operands.
    y, dx, dw = _grads(xj, wq, wj, dyj, key)
    w_deq = ref_deq(ref_q(w, (16, 16)), (k, n), (16, 16))
    expect = {
        "fprop": ref_deq(ref_q(x, (1, 16)), (m, k), (1, 16)) @ w_deq,
        "dgrad": ref_deq(ref_dyq, (m, n), (1, 16)) @ w_deq.T,
        "wgrad": ref_deq(ref_q(h_x, (1, 16)), (k, mp), (1, 16)) @ ref_deq(ref_q(h_dy, (1, 16), kw), (n, mp), (1, 16)).T,
    }
    # float32 results at 1e-6; bf16 ones (y, dx) are the float32 product rounded to bf16.
    for name, got in (("fprop", y), ("dgrad", dx), ("wgrad", dw)):
        e, tol = expect[name], 1e-6 if got.dtype == jnp.float32 else 2.0**-8
        np.testing.assert_allclose(np.asarray(got, np.float64), e, rtol=tol, atol=tol * np.abs(e).max(), err_msg=name)


def test_without_key_every_operand_rounds_to_nearest():
    """No key: dy rounds to nearest in dgrad and wgrad alike (no stochastic path taken)."""
    m, k, n = 24, 40, 24
    x, dy = data((m, k), 4), data((m, n), 5, 1e-3)
    dyq = jax.jit(gemm._dgrad_operand)(jax.device_put(dy), None)
    assert_bytes(dyq, ref_q(dy, (1, 16)), "dgrad dy, nearest")
    assert gemm._backward_keys(None) == (None, None)
    xtq, gtq = jax.jit(gemm._wgrad_operands, static_argnums=(2, 3))(jax.device_put(x), jax.device_put(dy), None, False)
    # Without the Hadamard transform: the plain transposes, tokens not padded beyond the block.
    assert_bytes(xtq, ref_q(x.T, (1, 16)), "wgrad xᵀ, no RHT")
    assert_bytes(gtq, ref_q(dy.T, (1, 16)), "wgrad dyᵀ, no RHT")


def test_stochastic_draws_are_uniform_and_independent():
    """The recipe's draws (reproduced above bit for bit) behave as independent uniforms:
    mean, variance, neighbour correlation and the correlation between two keys' draws."""
    idx = np.arange(1 << 16, dtype=np.uint32)
    u = np.asarray(nx.uniform_from_index(jax.random.key(3), jax.device_put(idx)), np.float64)
    np.testing.assert_array_equal(u.astype(F32), ref.uniform_from_index(seeds(jax.random.key(3)), idx))
    v = ref.uniform_from_index(seeds(jax.random.key(4)), idx).astype(np.float64)
    n = u.size
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.01 / 12 * 5
    for a, b in ((u[:-1], u[1:]), (u, v), (u[:-16], u[16:])):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(n)
    hist = np.bincount((u * 16).astype(int), minlength=16)
    chi2 = ((hist - n / 16) ** 2 / (n / 16)).sum()
    assert chi2 < 45  # 15 degrees of freedom: p < 1e-4


def test_ablations_quantize_what_they_say():
    """The recipe's elements switched off one at a time, against the reference: 1D weights
    (``(16, 1)`` blocks along K: fprop reads them as stored, dgrad re-quantizes the dequantized
    weight in 1x16 blocks along N), activations left in float (fprop and wgrad multiply the
    float activations by the other operand dequantized), and no Hadamard transform."""
    m, k, n = 24, 40, 24
    x, w, dy = data((m, k), 6), data((k, n), 7, 0.05), data((m, n), 8, 1e-3)
    key = jax.random.key(5)
    kd, kw = jax.random.split(key)
    xj, wj, dyj = (jax.device_put(a) for a in (x, w, dy))

    def grads(wq, **kw_):
        y, vjp = jax.vjp(lambda a, b: gemm.dot(a, wq, b, key=key, backend="emulate", **kw_), xj, wj)
        return (y, *vjp(dyj))

    close = lambda got, e, what: np.testing.assert_allclose(
        np.asarray(got, np.float64), e, rtol=1e-6, atol=1e-6 * np.abs(e).max(), err_msg=what)
    x_deq = ref_deq(ref_q(x, (1, 16)), (m, k), (1, 16))
    dy_deq = ref_deq(ref_q(dy, (1, 16), kd), (m, n), (1, 16))

    # 1D weights: the stored (16, 1) blocks along K serve fprop; dgrad's weight is their
    # dequantized values quantized again, 1x16 along N (round to nearest).
    wq1 = nv.quantize(wj, block=(16, 1))
    assert_bytes(wq1, ref_q(w, (16, 1)), "stored W, 1D along K")
    w1 = ref_deq(ref_q(w, (16, 1)), (k, n), (16, 1))
    w1_again = ref_q(w1.astype(F32), (1, 16))
    assert_bytes(gemm._dgrad_weight(wq1), w1_again, "dgrad W, re-quantized along N")
    assert not np.array_equal(ref_deq(w1_again, (k, n), (1, 16)), w1)  # the backward sees another weight
    y, dx, _ = jax.jit(grads)(wq1)
    close(y, x_deq @ w1, "fprop, 1D weights")
    close(dx, dy_deq @ ref_deq(w1_again, (k, n), (1, 16)).T, "dgrad, 1D weights")

    # Activations in float: fprop is x @ W_q; wgrad is (H xᵀ) in float against q1d_sr(H dyᵀ).
    wq = nv.quantize(wj)
    w_deq = ref_deq(ref_q(w, (16, 16)), (k, n), (16, 16))
    y, dx, dw = jax.jit(functools.partial(grads, quantize_x=False))(wq)
    h_x = np.asarray(nx.hadamard_transform(jax.device_put(pad_tokens(x.T)), axis=-1), np.float64)
    h_dy = np.asarray(nx.hadamard_transform(jax.device_put(pad_tokens(dy.T)), axis=-1))
    close(y, x.astype(np.float64) @ w_deq, "fprop, float activations")
    close(dx, dy_deq @ w_deq.T, "dgrad, float activations")
    close(dw, h_x @ ref_deq(ref_q(h_dy, (1, 16), kw), (n, 32), (1, 16)).T, "wgrad, float activations")

    # No Hadamard transform: wgrad's operands are the plain transposes, quantized.
    _, _, dw = jax.jit(functools.partial(grads, rht_wgrad=False))(wq)
    close(dw, ref_deq(ref_q(x.T, (1, 16)), (k, m), (1, 16)) @ ref_deq(ref_q(dy.T, (1, 16), kw), (n, m), (1, 16)).T,
          "wgrad, no transform")

    with pytest.raises(ValueError, match=r"\(16, 16\) tiles or \(16, 1\) blocks"):
        gemm.dot(xj, nv.quantize(wj, block=(1, 16)))
