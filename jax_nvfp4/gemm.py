"""The NVFP4 training-recipe GEMM: quantized fprop, dgrad and wgrad.

For ``y = x @ W`` with the weight stored as a 2D-tiled :class:`~jax_nvfp4.NVFP4Array`:

- fprop  ``y  = q1d(x) @ W_q``: x quantized in 1D blocks along K (round to nearest).
- dgrad  ``dx = q1d_sr(dy) @ W_qᵀ``: dy quantized along N with stochastic rounding; ``W_qᵀ`` is
  the stored weight transposed without re-quantization (its 16x16 tiles make that exact).
- wgrad  ``dW = q1d(H xᵀ) @ q1d_sr(H dyᵀ)ᵀ``: both operands get the random Hadamard transform
  ``H`` along the token axis (the contraction), then 1D quantization along tokens; it
  cancels in the product and spreads outliers before quantization.

Each element can be switched off, to measure what it buys (:func:`dot`): ``key=None`` rounds
the gradient to nearest, ``rht_wgrad=False`` drops the transform, ``quantize_x=False`` keeps the
activations (fprop's and wgrad's ``x`` operand) in their float dtype, and a weight stored in 1D
blocks of 16 along K (``(16, 1)``, the weights-only layout) serves fprop as stored while dgrad,
which contracts over N, re-quantizes its dequantized values in 1D blocks along N: the backward
pass then sees a different weight from the forward pass, what the 16x16 tiles avoid.

Each quantized operand has its own global amax. The emulated GEMMs dequantize to float32 and
multiply at ``Precision.HIGHEST``, so the product carries both global decode scales; native
GEMMs multiply the E2M1 x E4M3 operands and apply ``alpha = D_a * D_b`` afterwards.

Backends: one traced program carries a GEMM per platform (``jax.lax.platform_dependent``), and
the platform it is lowered for picks one: the emulation everywhere but on CUDA, and on CUDA what
``backend`` asks for:

- ``"emulate"``: the emulation on CUDA too; the reference.
- ``"scaled_matmul"``: ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM; Blackwell, sm_100+).
- ``"te"``: Transformer Engine's JAX GEMM (optional dependency; Blackwell). Experimental: chosen
  only when asked for by name.
- ``"auto"`` (default): ``"scaled_matmul"`` where the CUDA target has block-scaled GEMMs
  (compute capability 10.0 and up), else the emulation (Hopper, sm_90, has no FP4 GEMM).

The CUDA target (:func:`cuda_target`) is known while tracing: the compute capability of this
process's CUDA devices when it has some; without one (a CUDA lowering on a host without GPUs,
``jit(f).trace(*args).lower(lowering_platforms=("cuda",))``) the ``NVFP4_CUDA_CAPABILITY``
environment variable (e.g. ``9.0`` for Hopper's program), else 10.0: the program a Blackwell
runs. A jitted function keeps the trace of its first call, so set the variable before it
traces. :func:`last_backend` says what the latest trace built for a platform, and
:func:`jax_nvfp4.comm.native_gemms` reads the native GEMMs from a lowered program's text.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import BLOCK_1D, BLOCK_2D, BLOCK_COLUMN, NVFP4Array, _ceil_to, dequantize, quantize, transpose

__all__ = ["BACKENDS", "BackendUnavailableError", "CudaTarget", "cuda_target", "default_platform", "dot",
           "last_backend", "resolve_backend"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "emulate", "scaled_matmul", "te")
# Native block-scaled GEMMs: rows padded to the 128-row scale tiles, the contraction to 64
# (4 scale columns), with zero codes and zero scales, which add nothing to the product.
_ROW_ALIGN = 128
_K_ALIGN = 64

# The first compute capability with block-scaled FP4 GEMMs (Blackwell).
NATIVE_CAPABILITY = (10, 0)
# Without a CUDA device in the process: the CUDA target of a lowering, "major.minor".
CUDA_CAPABILITY_ENV = "NVFP4_CUDA_CAPABILITY"

_logged: set = set()
_last_cuda: Optional[str] = None  # what the latest trace of dot built for CUDA


class BackendUnavailableError(RuntimeError):
    """A GEMM backend was requested explicitly but cannot run here."""


# -------------------------------------------------------------------------- backend choice
@dataclasses.dataclass(frozen=True)
class CudaTarget:
    """The CUDA GPU the CUDA branch of :func:`dot` is built for.

    ``capability``: ``(major, minor)``; ``source``: ``"devices"`` (this process's CUDA
    devices, the smallest capability among them), ``"NVFP4_CUDA_CAPABILITY"`` (the environment
    variable, read only without CUDA devices) or ``"default"`` (no CUDA device and no variable:
    a Blackwell, 10.0)."""

    capability: Tuple[int, int]
    source: str

    @property
    def native(self) -> bool:
        """Whether the target has block-scaled FP4 GEMMs."""
        return self.capability >= NATIVE_CAPABILITY

    def __str__(self) -> str:
        cc = f"compute capability {self.capability[0]}.{self.capability[1]}"
        return {"devices": f"{cc} (this process's GPUs)",
                "default": f"{cc} (no GPU in this process: a Blackwell's program; set {CUDA_CAPABILITY_ENV} "
                           "for another target)"}.get(self.source, f"{cc} (from {self.source})")


def _parse_capability(text: str, where: str) -> Tuple[int, int]:
    major, _, minor = str(text).strip().partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        raise ValueError(f"{where}={text!r}: expected a compute capability such as 9.0 or 10.0") from None


def _local_cuda_capability() -> Optional[Tuple[int, int]]:
    """The smallest compute capability of this process's CUDA devices, or None without any."""
    try:
        devices = jax.local_devices(backend="cuda")
    except RuntimeError:  # no CUDA backend in this process
        return None
    ccs = [_parse_capability(d.compute_capability, "compute_capability") for d in devices
           if getattr(d, "compute_capability", None)]
    return min(ccs) if ccs else None


def cuda_target() -> CudaTarget:
    """The CUDA target of :func:`dot`'s CUDA branch (see :class:`CudaTarget`)."""
    cc = _local_cuda_capability()
    if cc is not None:
        return CudaTarget(cc, "devices")
    env = os.environ.get(CUDA_CAPABILITY_ENV)
    if env:
        return CudaTarget(_parse_capability(env, CUDA_CAPABILITY_ENV), CUDA_CAPABILITY_ENV)
    return CudaTarget(NATIVE_CAPABILITY, "default")


def default_platform() -> str:
    """The platform a plain ``jit`` call runs on in this process: ``"cuda"``, ``"rocm"``,
    ``"cpu"`` or ``"tpu"``."""
    device = jax.devices()[0]
    if device.platform == "gpu":  # CUDA and ROCm devices both say "gpu"
        return "cuda" if getattr(device, "compute_capability", None) else "rocm"
    return device.platform


@functools.lru_cache(maxsize=None)
def te_import_error() -> Optional[str]:
    """None when Transformer Engine's JAX extension (what ``backend="te"`` uses) imports, else why
    it does not (``"ImportError: ..."``)."""
    try:
        import transformer_engine.jax  # noqa: F401
        from transformer_engine.jax.cpp_extensions import gemm as _  # noqa: F401
        from transformer_engine.jax.quantize import ScaledTensorFactory, ScalingMode  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA library failing to load
        return f"{type(e).__name__}: {e}"
    return None


def resolve_backend(backend: str = "auto", platform: Optional[str] = None) -> str:
    """The GEMM :func:`dot` builds for ``platform`` (``"cuda"``, ``"cpu"``, ...; default: the
    platform of this process's devices, :func:`default_platform`) when asked for ``backend``.

    Raises:
      ValueError: an unknown name.
      BackendUnavailableError: ``"scaled_matmul"`` or ``"te"`` for a platform or CUDA target
        without block-scaled FP4 GEMMs, or ``"te"`` without Transformer Engine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    platform = platform or default_platform()
    if backend == "emulate":
        return backend
    if platform != "cuda":
        if backend == "auto":
            return "emulate"
        raise BackendUnavailableError(
            f"backend={backend!r} needs an NVIDIA Blackwell GPU (compute capability >= 10.0) for its native "
            f"NVFP4 GEMM; this process runs on {platform!r}. Use backend='emulate' (or 'auto', which also "
            "builds the native GEMM for a CUDA lowering).")
    target = cuda_target()
    if backend == "auto":
        # JAX's own block-scaled GEMM first: the TE path has not run on hardware in this
        # project's checks yet, so it is used only when requested by name.
        return "scaled_matmul" if target.native else "emulate"
    if backend == "te":
        err = te_import_error()
        if err is not None:
            raise BackendUnavailableError(
                "backend='te' needs Transformer Engine's JAX extension "
                f"(pip install 'transformer-engine[jax]'), which does not import: {err}")
    if not target.native:
        raise BackendUnavailableError(
            f"backend={backend!r} needs an NVIDIA Blackwell GPU (compute capability >= 10.0) for its native "
            f"NVFP4 GEMM; the CUDA target is {target}. Use backend='emulate' (or 'auto').")
    return backend


def _select(backend: str) -> str:
    """The CUDA branch's GEMM for ``backend``, recorded for :func:`last_backend`. An explicit
    native backend must also suit this process's own platform."""
    global _last_cuda
    here = default_platform()
    if here != "cuda":
        resolve_backend(backend, here)
    chosen = resolve_backend(backend, "cuda")
    _last_cuda = chosen
    key = (backend, chosen, here)
    if key not in _logged:
        _logged.add(key)
        target = f" for {cuda_target()}" if chosen != "emulate" else ""
        logger.info("jax_nvfp4.gemm: NVFP4 GEMM %r on CUDA%s, the emulation elsewhere (requested %r; this "
                    "process runs on %s)", chosen, target, backend, here)
    return chosen


def last_backend(platform: Optional[str] = None) -> Optional[str]:
    """The GEMM the most recent trace of :func:`dot` built for ``platform`` (``"cuda"``,
    ``"cpu"``, ``"rocm"``, ``"tpu"``; default: this process's platform, what a plain ``jit``
    call runs here): ``"scaled_matmul"``, ``"te"`` or ``"emulate"``. None before any trace."""
    if _last_cuda is None:
        return None
    platform = platform or default_platform()
    return _last_cuda if platform == "cuda" else "emulate"


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


@jax.custom_batching.custom_vmap
def _block_scaled(a4, b4, sa, sb) -> jax.Array:
    """``jax.nn.scaled_matmul`` of ``[..., M, K]`` and ``[..., N, K]`` codes with their
    ``[..., M, K/16]`` and ``[..., N, K/16]`` scales: float32 ``[..., M, N]``, the leading axes
    (the same for all four) flattened into its batch axis."""
    flat = lambda v: v.reshape(-1, *v.shape[-2:])
    out = jax.nn.scaled_matmul(flat(a4), flat(b4), flat(sa), flat(sb), preferred_element_type=jnp.float32)
    return out.reshape(*a4.shape[:-2], *out.shape[-2:])


@_block_scaled.def_vmap
def _block_scaled_vmap(axis_size, in_batched, *operands):
    # scaled_matmul's own batching rule needs every operand batched alike; under vmap (e.g.
    # over rounding keys) only some are. Unbatched operands are broadcast; the vmapped axis
    # joins the GEMM's batch axis.
    operands = [v if b else jnp.broadcast_to(v, (axis_size, *v.shape)) for v, b in zip(operands, in_batched)]
    return _block_scaled(*operands), True


def _gemm_nt_native(a: NVFP4Array, b: NVFP4Array, backend: str) -> jax.Array:
    """``dequantize(a) @ dequantize(b)ᵀ`` in float32 on a native block-scaled GEMM (CUDA)."""
    (m, _), (n, _) = a.matrix_shape, b.matrix_shape
    a4, sa, da = _native_operand(a)
    b4, sb, db = _native_operand(b)
    if backend == "scaled_matmul":
        out = _block_scaled(a4, b4, sa, sb)
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


def _per_platform(*args, cuda, default):
    """``cuda(*args)`` in a lowering for CUDA, ``default(*args)`` for any other platform."""
    return jax.lax.platform_dependent(*args, cuda=cuda, default=default)


def _product(a: jax.Array, b: jax.Array, b_contract: int) -> jax.Array:
    """The emulation's GEMM: float32 ``a [R, K]`` times ``b`` contracted over its axis
    ``b_contract``, at ``Precision.HIGHEST``."""
    return jax.lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _gemm(a: NVFP4Array, b: NVFP4Array, b_contract: int, backend: str) -> jax.Array:
    """``dequantize(a) [R, K] @ dequantize(b)`` contracted over K, float32 ``[R, C]``: the
    emulation, and on CUDA the ``backend`` GEMM.

    ``b`` is ``[C, K]`` (``b_contract=1``) or, for a weight with 16x16 tiles or ``(16, 1)``
    blocks, ``[K, C]`` (``b_contract=0``; native paths transpose its codes and scales, exact).
    """

    def emulated(a, b):
        return _product(dequantize(a, jnp.float32), dequantize(b, jnp.float32), b_contract)

    def native(a, b):
        return _gemm_nt_native(a, transpose(b) if b_contract == 0 else b, backend)

    if backend == "emulate":
        return emulated(a, b)
    return _per_platform(a, b, cuda=native, default=emulated)


# ------------------------------------------------------------------------ the custom VJP
@dataclasses.dataclass(frozen=True)
class _Config:
    cuda_backend: str  # the CUDA branch's GEMM; every other platform runs the emulation
    out_dtype: np.dtype
    w_dtype: Optional[np.dtype]
    stochastic_dgrad: bool
    rht_wgrad: bool
    quantize_x: bool


def _quantize_1d(v: jax.Array, key: Optional[jax.Array]) -> NVFP4Array:
    if key is None:
        return quantize(v, block=BLOCK_1D)
    return quantize(v, block=BLOCK_1D, rounding="stochastic", key=key)


def _fprop_operand(x2d) -> NVFP4Array:
    """fprop's activation operand: ``x [M, K]`` in 1D blocks along K, round to nearest."""
    return quantize(x2d, block=BLOCK_1D)


def _backward_keys(key):
    """``(dgrad key, wgrad key)`` for stochastic rounding of the gradient; ``(None, None)``
    (round to nearest) without a key."""
    if key is None:
        return None, None
    k_dgrad, k_wgrad = jax.random.split(key)
    return k_dgrad, k_wgrad


def _dgrad_operand(g, key) -> NVFP4Array:
    """dgrad's gradient operand: ``dy [M, N]`` in 1D blocks along N (the contraction),
    stochastically rounded with ``key`` (round to nearest without)."""
    return _quantize_1d(g, key)


def _dgrad_weight(w_q: NVFP4Array) -> NVFP4Array:
    """dgrad's weight operand ``[K, N]``, contracted over N: the stored 2D tiles as they are,
    or, for a weight in ``(16, 1)`` blocks along K, its dequantized values re-quantized in 1D
    blocks along N (round to nearest)."""
    if w_q.block == BLOCK_2D:
        return w_q
    return quantize(dequantize(w_q, jnp.float32), block=BLOCK_1D)


def _wgrad_operands(x2d, g, key, rht: bool, quantize_x: bool = True):
    """wgrad's operands ``(q1d(H xᵀ) [K, M'], q1d_sr(H dyᵀ) [N, M'])``: both transposed so the
    tokens M (the contraction) are the last axis, optionally Hadamard-transformed along it
    (tokens zero-padded to M' = a multiple of 16; zero tokens add nothing to the product),
    then 1D-quantized along it; only the gradient is rounded stochastically (with ``key``).
    ``quantize_x=False``: the first operand is ``H xᵀ`` in float32, not quantized."""
    xt = x2d.astype(jnp.float32).T
    gt = g.astype(jnp.float32).T
    if rht:
        m = xt.shape[1]
        mp = _ceil_to(m, nx.BLOCK)
        if mp != m:
            xt = jnp.pad(xt, ((0, 0), (0, mp - m)))
            gt = jnp.pad(gt, ((0, 0), (0, mp - m)))
        xt = nx.hadamard_transform(xt, axis=-1)
        gt = nx.hadamard_transform(gt, axis=-1)
    return (quantize(xt, block=BLOCK_1D) if quantize_x else xt), _quantize_1d(gt, key)


def _float_gemm(a: jax.Array, b: NVFP4Array, b_contract: int) -> jax.Array:
    """``a [R, K] @ dequantize(b)`` contracted over K in float32, for an operand left in float
    (``quantize_x=False``): not a block-scaled GEMM on any platform."""
    return _product(a.astype(jnp.float32), dequantize(b, jnp.float32), b_contract)


def _fprop(x2d, w_q, cfg: _Config):
    if not cfg.quantize_x:
        return _float_gemm(x2d, w_q, 0).astype(cfg.out_dtype)
    return _gemm(_fprop_operand(x2d), w_q, 0, cfg.cuda_backend).astype(cfg.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dot(x2d, w_q, w, key, cfg: _Config):
    del w, key
    return _fprop(x2d, w_q, cfg)


def _dot_fwd(x2d, w_q, w, key, cfg: _Config):
    del w
    return _fprop(x2d, w_q, cfg), (x2d, w_q, key)


def _dot_bwd(cfg: _Config, res, g):
    x2d, w_q, key = res
    k_dgrad, k_wgrad = _backward_keys(key)
    # dgrad: dx [M, K] = dy [M, N] @ Wᵀ; the stored tiles serve transposed as they are.
    dyq = _dgrad_operand(g, k_dgrad if cfg.stochastic_dgrad else None)
    dx = _gemm(dyq, _dgrad_weight(w_q), 1, cfg.cuda_backend).astype(x2d.dtype)

    dw = None
    if cfg.w_dtype is not None:
        # wgrad: dW [K, N] = xᵀ [K, M] @ dy [M, N], contracted over the tokens M.
        xtq, gtq = _wgrad_operands(x2d, g, k_wgrad, cfg.rht_wgrad, cfg.quantize_x)
        dw = (_gemm(xtq, gtq, 1, cfg.cuda_backend) if cfg.quantize_x else _float_gemm(xtq, gtq, 1))
        dw = dw.astype(cfg.w_dtype)
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
    quantize_x: bool = True,
) -> jax.Array:
    """``y [..., N] = x [..., K] @ W [K, N]`` with the NVFP4 training recipe.

    Args:
      x: activations ``[..., K]`` (float); leading axes are tokens (flattened to M).
      w_q: the stored weight, an :class:`NVFP4Array` ``[K, N]`` with 2D ``(16, 16)`` tiles (the
        recipe), or ``(16, 1)`` blocks along K (1D weights: dgrad re-quantizes it along N).
      w: optional float ``[K, N]`` that only receives the weight gradient; its values are
        never read (pass the dequantized or master weight). Without it no wgrad is computed.
      key: PRNG key for stochastic rounding of the gradient in dgrad and wgrad (split
        between the two). ``None``: every quantization rounds to nearest, deterministically.
      backend: the GEMM on CUDA: ``"auto"``, ``"emulate"``, ``"scaled_matmul"`` or ``"te"``
        (module docstring); other platforms run the emulation. ``"scaled_matmul"`` and ``"te"``
        raise :class:`BackendUnavailableError` unless this process runs on a Blackwell GPU.
      out_dtype: dtype of ``y`` (default ``x.dtype``).
      stochastic_dgrad: stochastic rounding of dy in dgrad (with a key); wgrad always rounds
        dy stochastically when a key is given.
      rht_wgrad: apply the random Hadamard transform along tokens in wgrad.
      quantize_x: quantize the activations (fprop's and wgrad's ``x`` operand); False keeps
        them in float, those GEMMs then multiply float by the dequantized other operand.

    Returns:
      ``y [..., N]``. Gradients: ``x`` gets dgrad (dtype of ``x``), ``w`` gets wgrad (dtype of
      ``w``); ``w_q`` and ``key`` get zero cotangents.
    """
    if not isinstance(w_q, NVFP4Array):
        raise TypeError(f"w_q must be an NVFP4Array, got {type(w_q).__name__}")
    if w_q.block not in (BLOCK_2D, BLOCK_COLUMN) or w_q.ndim != 2:
        raise ValueError(
            f"w_q must be one [K, N] matrix with 2D (16, 16) tiles or (16, 1) blocks along K, got shape "
            f"{w_q.shape}, block {w_q.block} (map batched weights with vmap or scan)")
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
        cuda_backend=_select(backend),
        out_dtype=np.dtype(out_dtype if out_dtype is not None else x.dtype),
        w_dtype=None if w is None else np.dtype(w.dtype),
        stochastic_dgrad=bool(stochastic_dgrad),
        rht_wgrad=bool(rht_wgrad),
        quantize_x=bool(quantize_x),
    )
    lead = x.shape[:-1]
    if x.size == 0:  # no tokens: nothing to quantize; an empty y, zero gradients
        return (x.reshape(0, k) @ (jnp.zeros((k, n), x.dtype) if w is None else w.astype(x.dtype))).astype(
            cfg.out_dtype).reshape(*lead, n)
    y = _dot(x.reshape(-1, k), w_q, w, key, cfg)
    return y.reshape(*lead, n)
