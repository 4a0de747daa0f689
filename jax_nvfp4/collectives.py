"""Collectives inside ``shard_map`` that move bits and sum in a fixed order.

Every cross-device sum of floats here is a pure data movement of the values' bits (an
all-to-all or all-gather of same-width unsigned integers, which XLA can neither widen nor turn
into a reduction) followed by an explicit left fold on the device, in shard order, in float32.
Results therefore do not depend on how the runtime implements its collectives: one process
with 8 devices and two processes with 4 each train bit-identically.

- :func:`all_gather_levels` / :func:`all_gather_bits`: gathers, one mesh level at a time, of
  bits;
- :func:`ordered_mean` / :func:`ordered_sum`: the mean or sum of a value every device holds;
- :func:`ordered_sum_scatter` / :func:`ordered_reduce_scatter`: a sum each device gets its
  chunk of (a gradient's tiles: the master shard it owns).

The per-layer parameter fetch built on them is :mod:`jax_nvfp4.fetch`; their counterparts outside ``shard_map`` (``jit`` with shardings: ``constrain``,
``reshard_bits``, ``global_norm``) are in :mod:`jax_nvfp4.sharding`.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

# What each of the library's collectives is for, said where it is called with a name scope
# (HLO op_name metadata): the innermost of these scopes in a collective's scope path is its
# purpose (jax_nvfp4.comm). The ordered primitives below carry none of their own: their callers
# say what a sum is for.
GATHER_SCOPE = "weight_gather"
REDUCE_SCOPE = "grad_reduce"
TENSOR_SCOPE = "tensor_parallel"
NORM_SCOPE = "grad_norm"
REQUANTIZE_SCOPE = "requantize"
OPTIMIZER_SCOPE = "optimizer"
LOSS_SCOPE = "loss_metrics"
SCOPES = {
    GATHER_SCOPE: "weight gather",
    REDUCE_SCOPE: "grad reduce",
    TENSOR_SCOPE: "tensor parallel",
    NORM_SCOPE: "grad norm",
    REQUANTIZE_SCOPE: "re-quantize",
    OPTIMIZER_SCOPE: "optimizer",
    LOSS_SCOPE: "loss / metrics",
}

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def to_bits(x: jax.Array) -> jax.Array:
    """The same-width unsigned-integer view of a float array (other arrays unchanged)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype).itemsize])


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    if bits.dtype == jnp.dtype(dtype):
        return bits
    return jax.lax.bitcast_convert_type(bits, dtype)


# Folds of up to this many parts are unrolled; longer ones run as a loop, so that a program
# for hundreds of devices does not carry hundreds of additions per reduced array.
UNROLL = 8


def fold_sum(parts: jax.Array) -> jax.Array:
    """``((p[0] + p[1]) + p[2]) + ...`` over axis 0 in float32: a fixed order (``jnp.sum``
    may sum pairwise for one shape and sequentially for another). The same additions in the
    same order whether unrolled or looped (:data:`UNROLL`)."""
    acc = parts[0].astype(jnp.float32)
    n = parts.shape[0]
    if n <= UNROLL:
        for i in range(1, n):
            acc = acc + parts[i].astype(jnp.float32)
        return acc
    return jax.lax.fori_loop(1, n, lambda i, a: a + parts[i].astype(jnp.float32), acc)


def _size(axis) -> int:
    return jax.lax.psum(1, axis)


def _levels(axis) -> Tuple[str, ...]:
    """The mesh axes of a (possibly tuple) data axis, major first: shard ``(i_1, ..., i_k)``
    of a tuple axis is shard ``i_1 n_2 ... n_k + ... + i_k`` of the whole."""
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def all_gather_levels(x: jax.Array, axis, *, dim: int = 0) -> jax.Array:
    """Tiled all-gather of ``x`` along ``dim`` over ``axis``; over a tuple axis one level at
    a time, the minor (last) axis first. With ``("data", "rack")`` (racks minor) the first,
    cross-rack gather moves 1/I of the bytes (I = devices per rack) and the second stays in
    the rack. Same result as one all-gather over the tuple."""
    for a in reversed(_levels(axis)):
        if _size(a) > 1:
            x = jax.lax.all_gather(x, a, axis=dim, tiled=True)
    return x


def all_gather_bits(x: jax.Array, axis, *, dim: int = 0, tiled: bool = False) -> jax.Array:
    """``jax.lax.all_gather`` of ``x``'s bits (floats travel as same-width unsigned ints);
    ``tiled`` gathers over a tuple axis level by level (:func:`all_gather_levels`)."""
    if tiled:
        return from_bits(all_gather_levels(to_bits(x), axis, dim=dim), x.dtype)
    out = jax.lax.all_gather(to_bits(x), axis, axis=dim, tiled=False)
    return from_bits(out, x.dtype)


def ordered_mean(x: jax.Array, axis) -> jax.Array:
    """Mean over ``axis`` of a value each device holds (inside ``shard_map``): all-gather
    its bits, fold in shard order in float32, divide by the axis size. Same on every device."""
    n = _size(axis)
    if n == 1:
        return x.astype(jnp.float32)
    return fold_sum(all_gather_bits(x, axis)) / np.float32(n)


def ordered_sum(x: jax.Array, axis) -> jax.Array:
    """Sum over ``axis`` of a value each device holds (inside ``shard_map``), in ``x``'s dtype:
    all-gather its bits, fold in shard order in float32. Same on every device."""
    if _size(axis) == 1:
        return x
    return fold_sum(all_gather_bits(x, axis)).astype(x.dtype)


def ordered_sum_scatter(x: jax.Array, axis: str, dim: int, out_dtype=None) -> jax.Array:
    """Sum over mesh axis ``axis`` of every device's ``x``, each device receiving its own
    ``1/n`` chunk along ``dim`` (inside ``shard_map``): ``psum_scatter`` in a fixed order. An
    all-to-all of the bits sends chunk ``j`` to device ``j``, which folds the ``n`` parts in
    shard order in float32; the result has ``out_dtype`` (default: ``x``'s dtype)."""
    n = _size(axis)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if n == 1:
        return x.astype(out_dtype)
    dim = dim % x.ndim
    shape = x.shape
    if shape[dim] % n:
        raise ValueError(f"ordered_sum_scatter: dimension {dim} of {shape} is not divisible by the {n} shards of {axis!r}")
    parts = jnp.moveaxis(x.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1:]), dim, 0)
    moved = jax.lax.all_to_all(to_bits(parts), axis, 0, 0, tiled=True)
    return fold_sum(from_bits(moved, x.dtype)).astype(out_dtype)


def ordered_reduce_scatter(tiles: jax.Array, axis, replica_axis=None) -> jax.Array:
    """Mean over ``axis`` (and ``replica_axis``) of every device's full tile array
    ``[..., nt, T, 16, 16]``, each device receiving its own ``T / N`` tiles
    ``[..., nt, T/N, 16, 16]`` float32 (inside ``shard_map``).

    One level per mesh axis of ``axis``, major first: an all-to-all of the bits sends each
    device of the level its part, which it folds in shard order in float32. Over
    ``("data", "rack")`` the gradient is summed inside each rack first (over NVLink), then
    only the rack's partial sums of this device's 1/I of the tiles cross racks (I = devices
    per rack), folded in rack order: the sum is ``sum_rack(sum_in_rack(g))``, a fixed order
    that no runtime or process layout changes (it rounds differently from the one-level fold
    over the same devices). Partial sums travel in the gradient's dtype (one rounding per
    level for bf16 gradients, as in any bf16 reduce-scatter; float32 gradients stay exact).

    ``replica_axis`` (hybrid sharding: the masters are replicated over it, e.g. racks): the
    partial sums are then all-gathered over it and folded in its order, the same sum on every
    replica.
    """
    levels = [a for a in _levels(axis) if _size(a) > 1]
    replicas = _size(replica_axis) if replica_axis is not None else 1
    n = _size(axis) * replicas
    if n == 1:
        return tiles.astype(jnp.float32)
    x = tiles
    for ax in levels:  # the tile axis (-3): tile block j -> device j of the level
        x = ordered_sum_scatter(x.astype(tiles.dtype), ax, -3, out_dtype=jnp.float32)
    if replicas > 1:
        x = fold_sum(all_gather_bits(x.astype(tiles.dtype), replica_axis))
    return x.astype(jnp.float32) / np.float32(n)
