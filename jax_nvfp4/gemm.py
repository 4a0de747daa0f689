"""The NVFP4 training-recipe GEMM: quantized fprop, dgrad and wgrad.

For ``y = x @ W`` with the weight stored as a 2D-tiled :class:`~jax_nvfp4.NVFP4Array`:

- fprop  ``y  = q1d(x) @ W_q``: x quantized in 1D blocks along K (round to nearest).
- dgrad  ``dx = q1d_sr(dy) @ W_qᵀ``: dy quantized along N with stochastic rounding; ``W_qᵀ`` is
  the stored weight transposed without re-quantization (its 16x16 tiles make that exact).
- wgrad  ``dW = q1d(H xᵀ) @ q1d_sr(H dyᵀ)ᵀ``: both operands get the random Hadamard transform
  ``H`` along the token axis (the contraction), then 1D quantization along tokens; it
  cancels in the product and spreads outliers before quantization.

Each quantized operand has its own global amax. The emulated GEMMs dequantize to float32 and
multiply at ``Precision.HIGHEST``, so the product carries both global decode scales; native
GEMMs multiply the E2M1 x E4M3 operands and apply ``alpha = D_a * D_b`` afterwards.

Backends (chosen when ``dot`` is traced):

- ``"emulate"``: everywhere; the reference.
- ``"scaled_matmul"``: ``jax.nn.scaled_matmul`` (cuDNN block-scaled GEMM; Blackwell, sm_100+).
- ``"te"``: Transformer Engine's JAX GEMM (optional dependency; Blackwell). Experimental:
  chosen only when asked for by name.
- ``"auto"``: ``"scaled_matmul"`` on a Blackwell GPU, else ``"emulate"``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import BLOCK_1D, BLOCK_2D, NVFP4Array, _ceil_to, dequantize, quantize, transpose

__all__ = ["BACKENDS", "BackendUnavailableError", "dot", "last_backend", "resolve_backend"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "emulate", "scaled_matmul", "te")
# Native block-scaled GEMMs: rows padded to the 128-row scale tiles, the contraction to 64
# (4 scale columns), with zero codes and zero scales, which add nothing to the product.
_ROW_ALIGN = 128
_K_ALIGN = 64

_logged_backends: set = set()
_last_backend: Optional[str] = None


class BackendUnavailableError(RuntimeError):
    """A GEMM backend was requested explicitly but cannot run here."""


# -------------------------------------------------------------------------- backend choice
def _gpu_compute_capability() -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of the first device when the default backend is a CUDA GPU."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def _te_import_error() -> Optional[str]:
    """None when ``transformer_engine.jax`` imports, else why it does not."""
    try:
        import transformer_engine.jax  # noqa: F401
        from transformer_engine.jax.cpp_extensions import gemm as _  # noqa: F401
        from transformer_engine.jax.quantize import ScaledTensorFactory, ScalingMode  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA library failing to load
        return f"{type(e).__name__}: {e}"
    return None


def _is_blackwell() -> bool:
    cc = _gpu_compute_capability()
    return cc is not None and cc[0] >= 10


def resolve_backend(backend: str = "auto") -> str:
    """The backend ``dot`` runs for ``backend`` on this process's default device.

    Raises:
      ValueError: an unknown name.
      BackendUnavailableError: ``"scaled_matmul"`` or ``"te"`` requested where it cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulate":
        return backend
    if backend == "auto":
        # JAX's own block-scaled GEMM first: the TE path has not run on hardware in this
        # project's checks yet, so it is used only when requested by name.
        return "scaled_matmul" if _is_blackwell() else "emulate"
    cc = _gpu_compute_capability()
    where = (f"default backend {jax.default_backend()!r}" if cc is None
             else f"GPU compute capability {cc[0]}.{cc[1]}")
    if backend == "te":
        err = _te_import_error()
        if err is not None:
            raise BackendUnavailableError(
                "backend='te' needs Transformer Engine's JAX extension "
                f"(pip install 'transformer-engine[jax]'), which does not import: {err}")
    if cc is None or cc[0] < 10:
        raise BackendUnavailableError(
            f"backend={backend!r} needs an NVIDIA Blackwell GPU (compute capability >= 10.0) "
            f"for its native NVFP4 GEMM; found {where}. Use backend='emulate' (or 'auto').")
    return backend


def _select(backend: str) -> str:
    global _last_backend
    chosen = resolve_backend(backend)
    _last_backend = chosen
    if chosen not in _logged_backends:
        _logged_backends.add(chosen)
        logger.info("jax_nvfp4.gemm: NVFP4 GEMM backend %r (requested %r)", chosen, backend)
    return chosen


def last_backend() -> Optional[str]:
    """The backend chosen by the most recent trace of :func:`dot` (None before any)."""
    return _last_backend


# ------------------------------------------------------------------------------ GEMM kernels
def _native_operand(q: NVFP4Array):
    """``(e2m1 [Rp, Kp] float4, scales [Rp, Kp/16] e4m3, D)`` with K (the last logical
    axis) the contraction. A 2D-tiled array's tile scale is repeated over its 16 rows, the
    per-row layout the block-scaled GEMM reads.
    """
    rows, cols = q.matrix_shape
    rp, kp = _ceil_to(rows, _ROW_ALIGN), _ceil_to(cols, _K_ALIGN)
    data = jnp.pad(q.data, ((0, rp - rows), (0, kp // 2 - q.data.shape[-1])))
    e2m1 = jax.lax.bitcast_convert_type(data, jnp.float4_e2m1fn).reshape(rp, kp)
    scale = q.scale
    if q.block == BLOCK_2D:
        scale = jnp.repeat(scale, BLOCK_2D[0], axis=-2)[:rows]
    scale = jnp.pad(scale, ((0, rp - scale.shape[0]), (0, kp // 16 - scale.shape[1])))
    return e2m1, scale, nx.global_decode_scale(q.amax)


def _gemm_nt_native(a: NVFP4Array, b: NVFP4Array, backend: str) -> jax.Array:
    """``dequantize(a) @ dequantize(b)ᵀ`` in float32 on a native block-scaled GEMM."""
    (m, _), (n, _) = a.matrix_shape, b.matrix_shape
    a4, sa, da = _native_operand(a)
    b4, sb, db = _native_operand(b)
    if backend == "scaled_matmul":
        out = jax.nn.scaled_matmul(a4[None], b4[None], sa[None], sb[None],
                                   preferred_element_type=jnp.float32)[0]
    elif backend == "te":
        out = _te_gemm_nt(a4, sa, b4, sb)
    else:  # pragma: no cover - resolve_backend guards this
        raise AssertionError(backend)
    return out[:m, :n] * (da * db)


def _te_gemm_nt(a4, sa, b4, sb) -> jax.Array:
    """Transformer Engine's cuBLAS NVFP4 GEMM, contraction on the last axis of both.

    TE derives each operand's decode scale from its ``amax`` as ``amax / (6 * 448)``; passing
    ``amax = 2688`` makes that 1, so alpha is applied by the caller exactly as in the other
    paths. Both operands are given as 1D-scaled (per-row scales), which is also how a 2D tile
    scale reads per row.
    """
    from transformer_engine.jax.cpp_extensions import gemm as te_gemm
    from transformer_engine.jax.quantize import ScaledTensorFactory, ScalingMode

    unit_amax = jnp.full((1,), nx.E4M3_MAX * nx.E2M1_MAX, jnp.float32)

    def scaled(data, scale):
        return ScaledTensorFactory.create_1x(
            data, scale, amax=unit_amax, scaling_mode=ScalingMode.NVFP4_1D_SCALING,
            dq_dtype=jnp.float32, is_colwise=False, data_layout="N", flatten_axis=-1)

    try:
        out = te_gemm(scaled(a4, sa), scaled(b4, sb), contracting_dims=((1,), (1,)))
    except Exception as e:
        raise BackendUnavailableError(
            f"Transformer Engine's NVFP4 GEMM rejected the operands ({type(e).__name__}: {e}); "
            "use backend='scaled_matmul' or 'emulate'") from e
    return out.astype(jnp.float32)


def _gemm(a: NVFP4Array, b: NVFP4Array, b_contract: int, backend: str) -> jax.Array:
    """``dequantize(a) [R, K] @ dequantize(b)`` contracted over K, float32 ``[R, C]``.

    ``b`` is ``[C, K]`` (``b_contract=1``) or, for a 2D-tiled weight, ``[K, C]``
    (``b_contract=0``; native paths transpose its codes, exact for 16x16 tiles).
    """
    if backend == "emulate":
        return jax.lax.dot_general(
            dequantize(a, jnp.float32), dequantize(b, jnp.float32),
            (((1,), (b_contract,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if b_contract == 0:
        b = transpose(b)
    return _gemm_nt_native(a, b, backend)


# ------------------------------------------------------------------------ the custom VJP
@dataclasses.dataclass(frozen=True)
class _Config:
    backend: str
    out_dtype: np.dtype
    w_dtype: Optional[np.dtype]
    stochastic_dgrad: bool
    rht_wgrad: bool


def _quantize_1d(v: jax.Array, key: Optional[jax.Array]) -> NVFP4Array:
    if key is None:
        return quantize(v, block=BLOCK_1D)
    return quantize(v, block=BLOCK_1D, rounding="stochastic", key=key)


def _fprop(x2d, w_q, cfg: _Config):
    xq = quantize(x2d, block=BLOCK_1D)
    return _gemm(xq, w_q, 0, cfg.backend).astype(cfg.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dot(x2d, w_q, w, key, cfg: _Config):
    del w, key
    return _fprop(x2d, w_q, cfg)


def _dot_fwd(x2d, w_q, w, key, cfg: _Config):
    del w
    return _fprop(x2d, w_q, cfg), (x2d, w_q, key)


def _dot_bwd(cfg: _Config, res, g):
    x2d, w_q, key = res
    if key is not None:
        k_dgrad, k_wgrad = jax.random.split(key)
    else:
        k_dgrad = k_wgrad = None

    # dgrad: dx [M, K] = dy [M, N] @ Wᵀ; the stored tiles serve transposed as they are.
    dyq = _quantize_1d(g, k_dgrad if cfg.stochastic_dgrad else None)
    dx = _gemm(dyq, w_q, 1, cfg.backend).astype(x2d.dtype)

    dw = None
    if cfg.w_dtype is not None:
        # wgrad: dW [K, N] = xᵀ [K, M] @ dy [M, N], contracted over the tokens M.
        xt = x2d.astype(jnp.float32).T
        gt = g.astype(jnp.float32).T
        if cfg.rht_wgrad:
            m = xt.shape[1]
            mp = _ceil_to(m, nx.BLOCK)
            if mp != m:  # zero tokens add nothing to the product
                xt = jnp.pad(xt, ((0, 0), (0, mp - m)))
                gt = jnp.pad(gt, ((0, 0), (0, mp - m)))
            xt = nx.hadamard_transform(xt, axis=-1)
            gt = nx.hadamard_transform(gt, axis=-1)
        xtq = quantize(xt, block=BLOCK_1D)
        gtq = _quantize_1d(gt, k_wgrad)
        dw = _gemm(xtq, gtq, 1, cfg.backend).astype(cfg.w_dtype)
    return dx, None, dw, None


_dot.defvjp(_dot_fwd, _dot_bwd)


def dot(
    x: jax.Array,
    w_q: NVFP4Array,
    w: Optional[jax.Array] = None,
    *,
    key: Optional[jax.Array] = None,
    backend: str = "auto",
    out_dtype=None,
    stochastic_dgrad: bool = True,
    rht_wgrad: bool = True,
) -> jax.Array:
    """``y [..., N] = x [..., K] @ W [K, N]`` with the NVFP4 training recipe.

    Args:
      x: activations ``[..., K]`` (float); leading axes are tokens (flattened to M).
      w_q: the stored weight, an :class:`NVFP4Array` ``[K, N]`` with 2D ``(16, 16)`` tiles.
      w: optional float ``[K, N]`` that only receives the weight gradient; its values are
        never read (pass the dequantized or master weight). Without it no wgrad is computed.
      key: PRNG key for stochastic rounding of the gradient in dgrad and wgrad (split
        between the two). ``None``: every quantization rounds to nearest, deterministically.
      backend: ``"auto"``, ``"emulate"``, ``"scaled_matmul"`` or ``"te"`` (module docstring).
      out_dtype: dtype of ``y`` (default ``x.dtype``).
      stochastic_dgrad: stochastic rounding of dy in dgrad (with a key); wgrad always rounds
        dy stochastically when a key is given.
      rht_wgrad: apply the random Hadamard transform along tokens in wgrad.

    Returns:
      ``y [..., N]``. Gradients: ``x`` gets dgrad (dtype of ``x``), ``w`` gets wgrad (dtype of
      ``w``); ``w_q`` and ``key`` get zero cotangents.
    """
    if not isinstance(w_q, NVFP4Array):
        raise TypeError(f"w_q must be an NVFP4Array, got {type(w_q).__name__}")
    if w_q.block != BLOCK_2D or w_q.ndim != 2:
        raise ValueError(
            f"w_q must be one [K, N] matrix with 2D (16, 16) tiles, got shape {w_q.shape}, "
            f"block {w_q.block} (map batched weights with vmap or scan)")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating point, got dtype {x.dtype}")
    k, n = w_q.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x [..., K] must end in K={k} (w_q is [{k}, {n}]), got shape {x.shape}")
    if w is not None:
        w = jnp.asarray(w)
        if w.shape != (k, n) or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"w must be a float [{k}, {n}] array, got {w.dtype}{list(w.shape)}")
    cfg = _Config(
        backend=_select(backend),
        out_dtype=np.dtype(out_dtype if out_dtype is not None else x.dtype),
        w_dtype=None if w is None else np.dtype(w.dtype),
        stochastic_dgrad=bool(stochastic_dgrad),
        rht_wgrad=bool(rht_wgrad),
    )
    lead = x.shape[:-1]
    y = _dot(x.reshape(-1, k), w_q, w, key, cfg)
    return y.reshape(*lead, n)
