import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import gemm
from jax_nvfp4 import numerics as nx
from jax_nvfp4.nn import NVFP4Dense
import reference as ref

F32 = np.float32


# ------------------------------------------------------------- independent NumPy reference
def ref_deq(a, block):
    """Quantize (nearest) and dequantize one matrix with the NumPy reference."""
    a = np.asarray(a, F32)
    d, s, amax = ref.quantize_matrix(a, block)
    return ref.dequantize_matrix(d, s, amax, a.shape, block)


def ref_clamped(a):
    """E[dequantize(stochastic 1D quantize(a))]: the scaled value clamped to [-6, 6] and
    decoded, with no rounding (stochastic rounding is unbiased inside the clamp range)."""
    a = np.asarray(a, F32)
    rows, cols = a.shape
    _, s_u8, amax = ref.quantize_matrix(a, (1, 16))
    S = np.minimum(F32(2688.0) / amax, np.finfo(F32).max).astype(F32)
    D = F32(1.0) / (F32(1.0) if S == 0 else S)
    s = np.repeat(s_u8.view(ml_dtypes.float8_e4m3fn).astype(F32), 16, axis=1)[:, :cols]
    with np.errstate(divide="ignore"):
        e = np.minimum(F32(1.0) / (s * D), np.finfo(F32).max).astype(F32)
    v = np.clip(a * e, -6, 6).astype(F32)
    return (v * s) * D


def ref_rht(a):
    """:func:`reference.rht` with the recipe's signs, rounded to float32."""
    return ref.rht(a, nx.RHT_SIGNS).astype(F32)


def pad_tokens(a, to=16):
    m = a.shape[1]
    mp = -(-m // to) * to
    return np.pad(a, ((0, 0), (0, mp - m)))


def ref_wgrad_operands(x2d, dy2d, rht):
    xt, gt = np.asarray(x2d, F32).T, np.asarray(dy2d, F32).T
    if rht:
        xt, gt = ref_rht(pad_tokens(xt)), ref_rht(pad_tokens(gt))
    return xt, gt


def data(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F32)


def as_bytes(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def assert_close(a, b, rtol=2e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def grads_eager(x, wq, w, dy, **kw):
    """(dx, dW) of ``gemm.dot`` for the cotangent ``dy``."""
    _, vjp = jax.vjp(lambda x_, w_: gemm.dot(x_, wq, w_, **kw), x, w)
    return vjp(dy)


grads = jax.jit(grads_eager, static_argnames=("backend", "rht_wgrad", "stochastic_dgrad"))
dot = jax.jit(gemm.dot, static_argnames=("backend", "out_dtype"))


# ------------------------------------------------------------------------------ fprop
@pytest.mark.parametrize("x_shape,n", [((32, 48), 64), ((2, 12, 40), 24)])
def test_forward_matches_numpy_reference(x_shape, n):
    k = x_shape[-1]
    x, w = data(x_shape, 0), data((k, n), 1, 0.05)
    y = jax.jit(lambda a, q: gemm.dot(a, q))(jax.device_put(x), nv.quantize(jax.device_put(w)))
    assert y.shape == (*x_shape[:-1], n) and y.dtype == jnp.float32
    expect = ref_deq(x.reshape(-1, k), (1, 16)) @ ref_deq(w, (16, 16))
    assert_close(y.reshape(-1, n), expect)
    # out_dtype, and bf16 activations (quantized from their bf16 values).
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = dot(xb, nv.quantize(jax.device_put(w)))
    assert yb.dtype == jnp.bfloat16
    assert dot(xb, nv.quantize(jax.device_put(w)), out_dtype=jnp.float32).dtype == jnp.float32
    expect_b = ref_deq(np.asarray(xb, F32).reshape(-1, k), (1, 16)) @ ref_deq(w, (16, 16))
    assert_close(np.asarray(yb, F32).reshape(-1, n), expect_b, rtol=1e-2)


# ------------------------------------------------------------------------------ dgrad
def test_dgrad_uses_the_transposed_stored_weight():
    w = data((48, 64), 2, 0.05)
    wq = nv.quantize(jax.device_put(w))
    qt, q_of_t = nv.array.transpose(wq), nv.quantize(jax.device_put(w.T))
    for a, b in zip(jax.tree.leaves(qt), jax.tree.leaves(q_of_t)):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    x, dy = data((32, 48), 3), data((32, 64), 4)
    dx, _ = grads(jax.device_put(x), wq, jax.device_put(w), jax.device_put(dy))
    # dgrad = q1d(dy) [M, N] @ quantize(Wᵀ) [N, K]: dy's codes against the tiles of Wᵀ.
    expect = ref_deq(dy, (1, 16)) @ ref_deq(w.T, (16, 16))
    assert_close(dx, expect)


@pytest.mark.parametrize("rht", [True, False])
@pytest.mark.parametrize("m", [32, 24])
def test_dgrad_and_wgrad_match_numpy_reference(rht, m):
    x, w, dy = data((m, 48), 5), data((48, 64), 6, 0.05), data((m, 64), 7)
    wq = nv.quantize(jax.device_put(w))
    dx, dw = grads(jax.device_put(x), wq, jax.device_put(w), jax.device_put(dy), rht_wgrad=rht)
    assert dx.shape == (m, 48) and dw.shape == (48, 64)
    assert_close(dx, ref_deq(dy, (1, 16)) @ ref_deq(w, (16, 16)).T)
    xt, gt = ref_wgrad_operands(x, dy, rht)
    assert_close(dw, ref_deq(xt, (1, 16)) @ ref_deq(gt, (1, 16)).T, rtol=1e-5)


def test_gradient_dtypes_follow_x_and_w():
    x = jnp.asarray(data((2, 16, 48), 8), jnp.bfloat16)
    w = jnp.asarray(data((48, 32), 9, 0.05), jnp.float32)
    dx, dw = grads(x, nv.quantize(w), w, jnp.ones((2, 16, 32), jnp.bfloat16))
    assert dx.dtype == jnp.bfloat16 and dx.shape == x.shape
    assert dw.dtype == jnp.float32 and dw.shape == w.shape


# ------------------------------------------------------------------------- Hadamard, wgrad
def test_hadamard_cancels_and_rht_wgrad_is_close_to_exact():
    x, dy, w = data((32, 48), 10), data((32, 64), 11), data((48, 64), 12, 0.05)
    xt, gt = jax.device_put(x.T), jax.device_put(dy.T)
    exact = x.T.astype(np.float64) @ dy.astype(np.float64)
    hh = nv.numerics.hadamard_transform(xt, axis=-1) @ nv.numerics.hadamard_transform(gt, axis=-1).T
    assert_close(hh, exact, rtol=1e-5)
    np.testing.assert_allclose(nv.numerics.hadamard_matrix(), ref_rht(np.eye(16, dtype=F32)), rtol=1e-6)
    for rht in (True, False):
        _, dw = grads(jax.device_put(x), nv.quantize(jax.device_put(w)), jax.device_put(w), jax.device_put(dy), rht_wgrad=rht)
        rel = np.linalg.norm(np.asarray(dw) - exact) / np.linalg.norm(exact)
        # Two operands each quantized to E2M1 (~10% rms error on Gaussian data).
        assert 0.02 < rel < 0.25, rel


# ---------------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_is_unbiased_in_dgrad_and_wgrad():
    m, k, n, nkeys = 32, 48, 64, 500
    x, w, dy = data((m, k), 13), data((k, n), 14, 0.05), data((m, n), 15)
    wq = nv.quantize(jax.device_put(w))
    keys = jax.random.split(jax.random.key(1234), nkeys)
    dxs, dws = jax.jit(jax.vmap(lambda kk: grads_eager(jax.device_put(x), wq, jax.device_put(w), jax.device_put(dy), key=kk)))(keys)
    dxs, dws = np.asarray(dxs, np.float64), np.asarray(dws, np.float64)
    xt, gt = ref_wgrad_operands(x, dy, rht=True)
    # The same GEMMs with the rounding of the stochastic operand (dy) taken out.
    expect_dx = ref_clamped(dy).astype(np.float64) @ ref_deq(w, (16, 16)).T
    expect_dw = ref_deq(xt, (1, 16)).astype(np.float64) @ ref_clamped(gt).T
    near_dx = ref_deq(dy, (1, 16)) @ ref_deq(w, (16, 16)).T
    near_dw = ref_deq(xt, (1, 16)) @ ref_deq(gt, (1, 16)).T
    for samples, expect, near in ((dxs, expect_dx, near_dx), (dws, expect_dw, near_dw)):
        mean, se = samples.mean(0), samples.std(0, ddof=1) / np.sqrt(nkeys)
        tol = 5 * se + 1e-6 * np.abs(expect).max()
        assert (np.abs(mean - expect) <= tol).all(), np.abs(mean - expect).max()
        # Power: the rounding is really random, and nearest rounding is visibly biased.
        assert (se > 0).mean() > 0.99
        assert (np.abs(near - expect) > tol).mean() > 0.3


def test_keys_reproducible_and_nearest_without_key():
    x, w, dy = (jax.device_put(a) for a in (data((32, 48), 16), data((48, 64), 17, 0.05), data((32, 64), 18)))
    wq = nv.quantize(w)
    k1, k2 = jax.random.key(0), jax.random.key(1)
    a, b, c = (grads(x, wq, w, dy, key=k) for k in (k1, k1, k2))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1]))
    # stochastic_dgrad=False: dgrad rounds to nearest (key-independent), wgrad stays stochastic.
    d1 = grads(x, wq, w, dy, key=k1, stochastic_dgrad=False)
    d2 = grads(x, wq, w, dy, key=k2, stochastic_dgrad=False)
    n0 = grads(x, wq, w, dy)
    np.testing.assert_array_equal(np.asarray(d1[0]), np.asarray(n0[0]))
    np.testing.assert_array_equal(np.asarray(d2[0]), np.asarray(n0[0]))
    assert not np.array_equal(np.asarray(d1[1]), np.asarray(d2[1]))
    # Legacy uint32 keys work too.
    grads(x, wq, w, dy, key=jax.random.PRNGKey(3))


# -------------------------------------------------------------------------- autodiff plumbing
def test_grad_with_quantized_weight_as_an_argument():
    x, w = jax.device_put(data((32, 48), 19)), jax.device_put(data((48, 64), 20, 0.05))
    wq = nv.quantize(w)

    def loss(x_, wq_, w_, key):
        return jnp.sum(gemm.dot(x_, wq_, w_, key=key) ** 2)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 2)))(x, wq, w, jax.random.key(0))
    assert dx.shape == x.shape and dw.shape == w.shape
    assert np.isfinite(np.asarray(dx)).all() and np.abs(np.asarray(dw)).max() > 0
    # The cotangent of the stored weight and of the key is zero (float0 for integer leaves).
    @jax.jit
    def cotangents(*args):
        _, vjp = jax.vjp(lambda x_, q_, w_, k_: gemm.dot(x_, q_, w_, key=k_), *args)
        return vjp(jnp.ones((32, 64), jnp.float32))

    _, cq, _, ck = cotangents(x, wq, w, jax.random.key(0))
    assert isinstance(cq, nv.NVFP4Array)
    assert cq.data.dtype == jax.dtypes.float0 and ck.dtype == jax.dtypes.float0
    for leaf in jax.tree.leaves(cq):
        assert leaf.dtype == jax.dtypes.float0 or not np.asarray(leaf, F32).any()
    # Without w there is no weight gradient to give; dx still flows.
    gx = jax.jit(jax.grad(lambda x_, q_: jnp.sum(gemm.dot(x_, q_))))(x, wq)
    assert_close(gx, ref_deq(np.ones((32, 64), F32), (1, 16)) @ ref_deq(np.asarray(w), (16, 16)).T)


def test_input_errors_are_clear():
    wq = nv.quantize(jnp.ones((48, 64)))
    with pytest.raises(ValueError, match="K=48"):
        gemm.dot(jnp.ones((4, 40)), wq)
    with pytest.raises(ValueError, match="2D"):
        gemm.dot(jnp.ones((4, 48)), nv.quantize(jnp.ones((48, 64)), block=(1, 16)))
    with pytest.raises(TypeError, match="NVFP4Array"):
        gemm.dot(jnp.ones((4, 48)), jnp.ones((48, 64)))
    with pytest.raises(ValueError, match="w must be"):
        gemm.dot(jnp.ones((4, 48)), wq, jnp.ones((64, 48)))


# ------------------------------------------------------------------------------- backends
def test_backend_selection_on_cpu(caplog, monkeypatch):
    if jax.default_backend() == "gpu":
        pytest.skip("checks the choices of a process without a GPU")
    monkeypatch.delenv(gemm.CUDA_CAPABILITY_ENV, raising=False)
    assert gemm.default_platform() == "cpu"
    assert gemm.resolve_backend("auto") == gemm.resolve_backend("auto", "cpu") == "emulate"
    assert gemm.resolve_backend("emulate", "cuda") == "emulate"
    # Without a GPU, the CUDA branch is what a Blackwell runs, and says so.
    target = gemm.cuda_target()
    assert target.capability == (10, 0) and target.source == "default" and target.native
    assert "no GPU in this process" in str(target)
    assert gemm.resolve_backend("auto", "cuda") == "scaled_matmul"
    gemm._logged.clear()
    with caplog.at_level(logging.INFO, logger="jax_nvfp4.gemm"):
        for _ in range(2):
            gemm.dot(jnp.ones((16, 16)), nv.quantize(jnp.ones((16, 16))))
    assert gemm.last_backend() == gemm.last_backend("cpu") == "emulate"
    assert gemm.last_backend("cuda") == "scaled_matmul"
    assert sum("'scaled_matmul' on CUDA" in r.getMessage() for r in caplog.records) == 1
    # Hopper's program, chosen explicitly: no FP4 GEMM, so the emulation on CUDA too.
    monkeypatch.setenv(gemm.CUDA_CAPABILITY_ENV, "9.0")
    assert str(gemm.cuda_target()).startswith("compute capability 9.0 (from NVFP4_CUDA_CAPABILITY)")
    assert gemm.resolve_backend("auto", "cuda") == "emulate"
    with pytest.raises(gemm.BackendUnavailableError, match="compute capability 9.0"):
        gemm.resolve_backend("scaled_matmul", "cuda")
    monkeypatch.setenv(gemm.CUDA_CAPABILITY_ENV, "hopper")
    with pytest.raises(ValueError, match="NVFP4_CUDA_CAPABILITY='hopper'"):
        gemm.cuda_target()
    # Named native backends need this process to run on a Blackwell GPU.
    with pytest.raises(gemm.BackendUnavailableError, match="Blackwell"):
        gemm.dot(jnp.ones((16, 16)), nv.quantize(jnp.ones((16, 16))), backend="scaled_matmul")
    with pytest.raises(gemm.BackendUnavailableError, match="Transformer Engine|Blackwell"):
        gemm.dot(jnp.ones((16, 16)), nv.quantize(jnp.ones((16, 16))), backend="te")
    with pytest.raises(ValueError, match="backend must be one of"):
        gemm.resolve_backend("cublas")


def _fwd_bwd(x, wq, w, dy, backend="auto"):
    y, vjp = jax.vjp(lambda a, b: gemm.dot(a, wq, b, backend=backend), x, w)
    return (y, *vjp(dy))


def test_one_program_per_platform(monkeypatch):
    """The same trace lowers to block-scaled GEMMs for CUDA (fprop, dgrad, wgrad: E2M1 codes
    and E4M3 scales) and to the emulation for CPU, on a host without a GPU."""
    if jax.default_backend() == "gpu":
        pytest.skip("lowers for CUDA from a host without a GPU")
    monkeypatch.delenv(gemm.CUDA_CAPABILITY_ENV, raising=False)
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((32, 48), (48, 64), (32, 64)))
    wq = jax.eval_shape(nv.quantize, w)

    def gemms(platform, **kw):
        # A new function each time: a jitted function's trace is cached, and it holds the GEMM
        # chosen for the CUDA target of its first trace.
        lowered = jax.jit(functools.partial(_fwd_bwd, **kw)).trace(x, wq, w, dy).lower(lowering_platforms=(platform,))
        return nv.comm.native_gemms(lowered.as_text(dialect="hlo"))

    cuda = gemms("cuda")
    assert sum(g.times for g in cuda) == 3, cuda
    assert {(g.backend, g.operands) for g in cuda} == {("scaled_matmul", nv.comm.BLOCK_SCALED_OPERANDS)}
    assert gemm.last_backend("cuda") == "scaled_matmul"
    assert gemms("cpu") == []
    assert gemms("cuda", backend="emulate") == []  # asked for by name: the emulation on CUDA too
    monkeypatch.setenv(gemm.CUDA_CAPABILITY_ENV, "9.0")  # Hopper's program: no FP4 GEMM
    assert gemms("cuda") == []
    assert gemm.last_backend("cuda") == "emulate"


def _scaled_matmul_math(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """jax.nn.scaled_matmul's documented semantics, for checking the operand layout on CPU."""
    a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), 16, axis=-1)
    b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), 16, axis=-1)
    return jnp.einsum("bmk,bnk->bmn", a, b, precision="highest").astype(preferred_element_type)


def test_native_operand_layout_against_scaled_matmul_semantics(monkeypatch):
    """The packed-data bitcast, per-row tile scales, padding and alpha of the native path,
    checked on CPU by standing in the documented math of ``jax.nn.scaled_matmul``."""
    # (setattr fails if this JAX has no jax.nn.scaled_matmul, the API this layout targets)
    monkeypatch.setattr(jax.nn, "scaled_matmul", _scaled_matmul_math)
    monkeypatch.setattr(gemm, "cuda_target", lambda: gemm.CudaTarget((10, 0), "test"))
    # Run the CUDA branch on this CPU.
    monkeypatch.setattr(gemm, "_per_platform", lambda *args, cuda, default: cuda(*args))
    x, w, dy = data((2, 12, 40), 21), data((40, 24), 22, 0.05), data((2, 12, 24), 23)
    wq = nv.quantize(jax.device_put(w))
    y = jax.jit(gemm.dot)(jax.device_put(x), wq)
    assert gemm.last_backend("cuda") == "scaled_matmul"
    expect = ref_deq(x.reshape(-1, 40), (1, 16)) @ ref_deq(w, (16, 16))
    assert_close(np.asarray(y).reshape(-1, 24), expect, rtol=1e-5)
    dx, dw = jax.jit(grads_eager)(jax.device_put(x), wq, jax.device_put(w), jax.device_put(dy))
    assert_close(np.asarray(dx).reshape(-1, 40), ref_deq(dy.reshape(-1, 24), (1, 16)) @ ref_deq(w, (16, 16)).T, rtol=1e-5)
    xt, gt = ref_wgrad_operands(x.reshape(-1, 40), dy.reshape(-1, 24), rht=True)
    assert_close(dw, ref_deq(xt, (1, 16)) @ ref_deq(gt, (1, 16)).T, rtol=1e-5)
    # Under vmap (over rounding keys: the weight's operands unbatched, the gradient's batched)
    # each key's GEMMs are the unbatched ones.
    # (Arguments, not constants: XLA:CPU's constant folding reads float4 bitcasts wrongly.)
    keys = jax.random.split(jax.random.key(5), 2)
    args = (jax.device_put(x), wq, jax.device_put(w), jax.device_put(dy))
    keyed = lambda k, *a: grads_eager(*a, key=k)
    batched = jax.jit(jax.vmap(keyed, in_axes=(0, None, None, None, None)))(keys, *args)
    for i in range(2):
        for b, one in zip(batched, jax.jit(keyed)(keys[i], *args)):
            np.testing.assert_array_equal(np.asarray(b[i]), np.asarray(one))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="native NVFP4 GEMM needs a CUDA GPU")
def test_native_matches_emulation_on_gpu():
    if not gemm.cuda_target().native:
        pytest.skip("native NVFP4 GEMM needs a Blackwell GPU (compute capability >= 10)")
    x, w, dy = (jax.device_put(data(s, i, c)) for i, (s, c) in enumerate((((256, 512), 1.0), ((512, 256), 0.05), ((256, 256), 1.0))))
    wq = nv.quantize(w)
    out = {}
    for b in ("emulate", "auto"):
        y = dot(x, wq, backend=b)
        out[b] = (y, *grads(x, wq, w, dy, backend=b))
    assert gemm.last_backend() in ("scaled_matmul", "te") and gemm.last_backend("cpu") == "emulate"
    for native, emu in zip(out["auto"], out["emulate"]):
        assert_close(native, emu, rtol=1e-4)


# ---------------------------------------------------------------------------- NVFP4Dense
def test_dense_dequant_mode():
    x = jax.device_put(data((4, 48), 24))
    layer = NVFP4Dense(64, use_bias=True)
    variables = layer.init(jax.random.key(0), x)
    assert set(variables) == {"params"}
    p = variables["params"]
    assert p["kernel"].dtype == jnp.float32 and p["kernel"].shape == (48, 64) and p["bias"].shape == (64,)
    y = jax.jit(layer.apply)(variables, x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(y, F32), np.asarray(jnp.dot(x.astype(jnp.bfloat16), p["kernel"].astype(jnp.bfloat16)), F32))
    g = jax.jit(jax.grad(lambda pp: jnp.sum(layer.apply({"params": pp}, x).astype(jnp.float32))))(p)
    assert g["kernel"].shape == (48, 64) and np.abs(np.asarray(g["kernel"])).max() > 0


def test_dense_nvfp4_mode_stored_and_on_the_fly():
    x = jax.device_put(data((32, 48), 25))
    layer = NVFP4Dense(64, compute="nvfp4", dtype=jnp.float32)
    params = layer.init(jax.random.key(0), x)["params"]
    kernel = params["kernel"]

    apply = jax.jit(layer.apply)

    @jax.jit
    @jax.grad
    def grad(p, variables):
        return jnp.sum(layer.apply({"params": p, **variables}, x) ** 2)

    # No stored weight: the float kernel is quantized on the fly.
    y = apply({"params": params}, x)
    assert_close(y, dot(x, nv.quantize(kernel), out_dtype=jnp.float32))
    g = grad(params, {})
    dy = 2 * y
    assert_close(g["kernel"], grads(x, nv.quantize(kernel), kernel, dy)[1])
    # A stored weight (from other values, to tell them apart) is what the GEMM multiplies.
    stored = nv.quantize(kernel * 3)
    y_s = apply({"params": params, "nvfp4": {"kernel": stored}}, x)
    assert_close(y_s, dot(x, stored))
    g_s = grad(params, {"nvfp4": {"kernel": stored}})
    assert_close(g_s["kernel"], grads(x, stored, kernel, 2 * y_s)[1])
    with pytest.raises(ValueError, match="compute"):
        NVFP4Dense(64, compute="fp8").init(jax.random.key(0), x)


class _Cell(nn.Module):
    features: int

    @nn.compact
    def __call__(self, h, _):
        return NVFP4Dense(self.features, compute="nvfp4", dtype=jnp.float32)(h), None


def test_dense_under_scan_with_stacked_nvfp4_collection():
    depth, f = 2, 48
    stack = nn.scan(_Cell, variable_axes={"params": 0, "nvfp4": 0},
                    split_rngs={"params": True, "rounding": True}, length=depth)(f)
    h = jax.device_put(data((32, f), 26))
    variables = stack.init(jax.random.key(0), h, None)
    assert set(variables) == {"params"}
    kernels = variables["params"]["NVFP4Dense_0"]["kernel"]
    assert kernels.shape == (depth, f, f)
    stored = nv.quantize(kernels)  # [L, f, f]: each layer its own amax
    assert stored.amax.shape == (depth,)
    nvfp4 = {"NVFP4Dense_0": {"kernel": stored}}

    def run_scan(params):
        out, _ = stack.apply({"params": params, "nvfp4": nvfp4}, h, None)
        return out

    def run_loop(ks):
        out = h
        for i in range(depth):
            out = gemm.dot(out, jax.tree.map(lambda a: a[i], stored), ks[i])
        return out

    params = variables["params"]
    assert_close(jax.jit(run_scan)(params), jax.jit(run_loop)(kernels))
    g_scan = jax.jit(jax.grad(lambda p: jnp.sum(run_scan(p) ** 2)))(params)["NVFP4Dense_0"]["kernel"]
    g_loop = jax.jit(jax.grad(lambda ks: jnp.sum(run_loop(ks) ** 2)))(kernels)
    assert g_scan.shape == (depth, f, f)
    assert_close(g_scan, g_loop, rtol=1e-5)

    # A "rounding" RNG stream, split per layer, turns on stochastic rounding of the gradients.
    @jax.jit
    def grad_sr(p, k):
        def loss(p_):
            out, _ = stack.apply({"params": p_, "nvfp4": nvfp4}, h, None, rngs={"rounding": k})
            return jnp.sum(out ** 2)
        return jax.grad(loss)(p)["NVFP4Dense_0"]["kernel"]

    g1, g2 = grad_sr(params, jax.random.key(7)), grad_sr(params, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
    assert not np.array_equal(np.asarray(g1), np.asarray(g_scan))
    assert_close(g1, g_scan, rtol=0.3)
