"""NVFP4 numerics on plain arrays: E2M1 elements, E4M3 block scales, float32 global scales.

Everything here follows the project's numeric contract (NVIDIA Transformer Engine's NVFP4
recipe and its pure-Python reference quantizer), computed in float32 in the order written
there. The functions are pure and work under ``jit``, ``vmap`` and ``shard_map``.

Platform note: XLA:CPU flushes float32 subnormals to zero. Inputs below 2**-126 therefore
quantize as zeros there, and matrices whose amax is below 2688 * 2**-117 (about 1.6e-32),
where a block's decode scale (its E4M3 scale times the global decode scale, down to 2**-9
times it) can be subnormal, may differ from a reference that keeps subnormals. Everything
above that is bit-exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Element format E2M1: codes 0..7 are these magnitudes, codes 8..15 their negations.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_MAX = np.float32(6.0)
E4M3_MAX = np.float32(448.0)
F32_MAX = np.float32(np.finfo(np.float32).max)
BLOCK = 16
# 1/6 rounded once in float32, as the recipe's ``reciprocal(6.0)``.
_INV_E2M1_MAX = np.float32(1.0) / E2M1_MAX

# Round-to-nearest-even thresholds on the magnitude: each adds one code step. Ties go to the
# even code, so the comparison is strict (>) where the lower neighbour is even and (>=) where
# the upper one is: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_RNE_STRICT = np.array([0.25, 1.25, 2.5, 5.0], dtype=np.float32)
_RNE_INCLUSIVE = np.array([0.75, 1.75, 3.5], dtype=np.float32)

# Fixed signs of the recipe's random Hadamard transform (16 entries).
RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float32)


def abs_max(x: jax.Array, axis) -> jax.Array:
    """max(|x|) over ``axis`` in float32, NaN-propagating and immune to subnormal flushing.

    For non-NaN floats the order of the magnitude bit patterns (as unsigned integers) is the
    order of the values, so the maximum is taken on integers: every NaN pattern is above +inf
    and wins, and a subnormal maximum keeps its exact value.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & np.uint32(0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def global_encode_scale(amax: jax.Array) -> jax.Array:
    """``S = min(448 * 6 / amax, float32_max)``, with ``S = 1`` where that is 0 (amax = inf).

    amax = 0 gives ``S = float32_max``; every element of such a matrix is zero and encodes
    to zero codes and zero scales either way.
    """
    amax = jnp.asarray(amax, jnp.float32)
    s = jnp.minimum(np.float32(E4M3_MAX * E2M1_MAX) / amax, F32_MAX)
    return jnp.where(s == 0, np.float32(1.0), s)


def global_decode_scale(amax: jax.Array) -> jax.Array:
    """``D = 1 / S``; NaN where amax is not finite, so a poisoned matrix never decodes to numbers."""
    amax = jnp.asarray(amax, jnp.float32)
    d = np.float32(1.0) / global_encode_scale(amax)
    return jnp.where(jnp.isfinite(amax), d, np.float32(np.nan))


def block_scales(block_amax: jax.Array, encode_scale: jax.Array, inv_target=_INV_E2M1_MAX) -> jax.Array:
    """E4M3 decode scales ``e4m3(clamp(block_amax * (S * inv_target), -448, 448))``: each block's
    amax maps to ``1 / inv_target`` (the recipe's 6; four-over-six's other candidate, 4).

    ``encode_scale`` must broadcast against ``block_amax``.
    """
    mult = encode_scale * inv_target
    s = jnp.clip(jnp.minimum(block_amax * mult, F32_MAX), -E4M3_MAX, E4M3_MAX)
    return s.astype(jnp.float8_e4m3fn)


def block_encode_multiplier(scale: jax.Array, decode_scale: jax.Array) -> jax.Array:
    """``e = min(1 / (float32(s) * D), float32_max)``; an all-zero block (s = 0) saturates."""
    return jnp.minimum(np.float32(1.0) / (scale.astype(jnp.float32) * decode_scale), F32_MAX)


def encode_e2m1(v: jax.Array) -> jax.Array:
    """Round float32 values (already clamped to [-6, 6]) to E2M1 codes, nearest-even, uint8.

    ``-0.0`` and NaN encode to code 0, as in the reference quantizer; any value below zero
    (however small) keeps its sign, so ``-0.1`` is code 8 (-0).
    """
    a = jnp.abs(v)
    mag = sum((a > t).astype(jnp.uint8) for t in _RNE_STRICT)
    mag = mag + sum((a >= t).astype(jnp.uint8) for t in _RNE_INCLUSIVE)
    return mag | ((v < 0).astype(jnp.uint8) << 3)


def encode_e2m1_stochastic(v: jax.Array, uniform: jax.Array) -> jax.Array:
    """Stochastic rounding to E2M1 codes: round the magnitude up with probability
    ``(|v| - lower) / (upper - lower)``, so ``E[decode(code)] = v`` for |v| <= 6.

    ``uniform`` holds independent samples in [0, 1), shaped like ``v``.
    """
    a = jnp.abs(v)
    lo_idx = sum((a >= t).astype(jnp.int32) for t in E2M1_VALUES[1:])
    lo = decode_e2m1(lo_idx)
    hi = decode_e2m1(jnp.minimum(lo_idx + 1, 7))
    gap = hi - lo
    p = jnp.where(gap > 0, (a - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    mag = (lo_idx + (uniform < p).astype(jnp.int32)).astype(jnp.uint8)
    return mag | ((v < 0).astype(jnp.uint8) << 3)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, 0..15) to float32 values (code 8 is -0.0).

    The float32 bits are built from the code's bits (sign, 2 exponent bits, 1 mantissa bit):
    exponent ``e > 0`` is ``2^(e-1)`` (biased ``e + 126``) with the mantissa bit on top of the
    float32 mantissa; ``e == 0`` is the subnormal 0 or 0.5. Integer ops only, elementwise: a
    gather from a constant table is refused for sharded codes on meshes with Explicit axes
    (``jax.make_mesh``'s default), and float arithmetic per code stops XLA from fusing the
    decode into the dequantize (on CPU, 0.9 GB more temporaries for the Llama 3 8B step on
    144 devices).
    """
    c = codes.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    normal = ((e + np.uint32(126)) << 23) | (m << 22)
    bits = ((c >> 3) << 31) | jnp.where(e == 0, m * np.uint32(0x3F000000), normal)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def pack_codes(codes: jax.Array) -> jax.Array:
    """``[..., 2n]`` codes to ``[..., n]`` bytes: element 2k in the low nibble, 2k+1 in the high.

    Each pair is read as one little-endian uint16 (a free reinterpretation), which XLA turns
    into a contiguous loop; splitting pairs with strided slices is several times slower.
    """
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    w = jax.lax.bitcast_convert_type(pairs, jnp.uint16)
    return ((w & np.uint16(0x0F)) | ((w >> 4) & np.uint16(0xF0))).astype(jnp.uint8)


def unpack_codes(data: jax.Array) -> jax.Array:
    """``[..., n]`` bytes to ``[..., 2n]`` codes (the inverse of :func:`pack_codes`)."""
    w = data.astype(jnp.uint16)
    w = (w & np.uint16(0x0F)) | ((w & np.uint16(0xF0)) << 4)
    return jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*data.shape[:-1], data.shape[-1] * 2)


def _hash32(x: jax.Array) -> jax.Array:
    # A 32-bit integer finalizer (xorshift-multiply), bijective and well mixed.
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform_from_index(key: jax.Array, index: jax.Array) -> jax.Array:
    """Uniform [0, 1) float32 samples determined by ``(key, index)`` alone.

    Counter-based, so a shard that knows the global index of its elements draws exactly the
    samples the unsharded tensor would: sharded stochastic rounding stays bit-identical.
    """
    seeds = jax.random.bits(key, (2,), jnp.uint32)  # typed or legacy uint32 keys
    h = _hash32(index.astype(jnp.uint32) * np.uint32(0x9E3779B9) + seeds[0])
    h = _hash32(h ^ seeds[1])
    return (h >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def hadamard_matrix(n: int = BLOCK, signs: np.ndarray | None = RHT_SIGNS) -> np.ndarray:
    """``diag(signs) @ H_n / sqrt(n)`` with ``H_n`` the Sylvester Hadamard matrix (float32).

    With the recipe's fixed signs this is the random Hadamard transform used before
    quantizing the operands of the weight-gradient GEMM. It is orthogonal.
    """
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if signs is not None:
        signs = np.asarray(signs, np.float32)
        if signs.shape != (n,):
            raise ValueError(f"signs must have shape ({n},), got {signs.shape}")
        h = signs[:, None] * h
    return (h / np.float32(np.sqrt(n))).astype(np.float32)


def hadamard_transform(x: jax.Array, axis: int = -1, signs: np.ndarray | None = RHT_SIGNS) -> jax.Array:
    """Multiply each group of 16 consecutive elements along ``axis`` (as a row vector) by
    ``diag(signs) @ H16 / 4``. The axis length must be a multiple of 16.

    Applying it to both operands along a contraction axis leaves their product unchanged
    (the matrix is orthogonal), while spreading outliers across each group.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % BLOCK:
        raise ValueError(f"Hadamard transform needs a multiple of {BLOCK} along axis {axis}, got {n}")
    h = jnp.asarray(hadamard_matrix(BLOCK, signs))
    xm = jnp.moveaxis(x, axis, -1)
    groups = xm.reshape(*xm.shape[:-1], n // BLOCK, BLOCK)
    out = jnp.einsum("...gi,ij->...gj", groups.astype(jnp.float32), h,
                     precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(out.reshape(xm.shape), -1, axis).astype(x.dtype)
