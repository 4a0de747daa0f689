"""Collectives that move bits and sum in a fixed order; the per-layer gather with its VJP.

Every cross-device sum of floats here is a pure data movement of the values' bits (an
all-to-all or all-gather of same-width unsigned integers, which XLA can neither widen nor turn
into a reduction) followed by an explicit left fold on the device, in shard order, in float32.
Results therefore do not depend on how the runtime implements its collectives: one process
with 8 devices and two processes with 4 each train bit-identically.

Inside a ``shard_map`` that is manual over the data axis:

- :func:`gather_weight` is how a layer gets its weight at the point of use: it all-gathers the
  layer's packed bytes and scale bytes (or a plain weight's bits) and dequantizes; its VJP
  reduce-scatters the weight gradient straight into this device's master shard
  (:func:`ordered_reduce_scatter`), so no device ever holds more than one layer's weights or
  full-size gradients.
- :func:`ordered_mean` averages a replicated value (the loss, a norm's partial gradient).

Their counterparts outside ``shard_map`` (``jit`` with shardings: ``constrain``,
``reshard_bits``, ``global_norm``) are in :mod:`jax_nvfp4.sharding`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.layout import Tiled, TiledNVFP4, is_tiled

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


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """How :func:`gather_weight` materialises a weight.

    ``axis``: the data axis (name or tuple, major first) the shards are split over;
    ``replica_axis``: a mesh axis the shards are replicated over (hybrid sharding; the
    gradient is also averaged over it), or None. ``dtype``: the weight's
    compute dtype (its gradient arrives in it). ``packed``: gather the packed NVFP4 bytes and
    dequantize after (True), or dequantize each shard and gather the dequantized values
    (False; the bf16-gather reference, bit-identical values). ``nvfp4``: also return the
    gathered :class:`NVFP4Array` (for the recipe GEMMs). ``tensor_axis``: the tensor axis
    when the ``shard_map`` is manual over it (size > 1), else None. A weight split over it
    (``layout.n_tensor > 1``) is then this device's tensor shard, its own tile-major matrix
    (:meth:`Layout.local`): its gather crosses the data axes only, and its gradient is
    complete on this tensor rank. Every other weight is the same on each tensor rank and
    gets a partial gradient there, summed over the tensor axis in a fixed order.
    """

    axis: Any = "data"
    dtype: Any = jnp.bfloat16
    packed: bool = True
    nvfp4: bool = False
    replica_axis: Optional[str] = None
    tensor_axis: Optional[str] = None

    @property
    def batch_axes(self) -> Tuple[str, ...]:
        """Every mesh axis the batch is split over (the gradient is averaged over all)."""
        return (*((self.replica_axis,) if self.replica_axis else ()), *_levels(self.axis))


def _local(x):
    """``x`` (a :class:`Tiled` / :class:`TiledNVFP4` shard inside a ``shard_map`` manual over
    the tensor axis) with the layout of its own tensor shard."""
    if is_tiled(x) and x.layout.n_tensor > 1:
        return dataclasses.replace(x, layout=x.layout.local())
    return x


def _split_over_tensor(x) -> bool:
    return is_tiled(x) and x.layout.n_tensor > 1


def _gather_forward(stored, cfg: GatherConfig):
    """(logical weight in ``cfg.dtype`` or None, gathered NVFP4Array or None)."""
    axis = cfg.axis
    stored = _local(stored)
    if _size(axis) == 1:  # nothing to gather: the shard is the whole parameter
        if isinstance(stored, TiledNVFP4):
            return (None, stored.to_array()) if cfg.nvfp4 else (stored.dequantize(cfg.dtype), None)
        if isinstance(stored, Tiled):
            return stored.logical().astype(cfg.dtype), None
        return stored.astype(cfg.dtype), None
    with jax.named_scope(GATHER_SCOPE):
        if isinstance(stored, TiledNVFP4):
            dim = stored.data.ndim - 3
            if cfg.packed or cfg.nvfp4:
                full = stored.replace(all_gather_levels(stored.data, axis, dim=dim),
                                      all_gather_levels(stored.scale_bits, axis, dim=dim))
            if cfg.nvfp4:
                return None, full.to_array()
            if cfg.packed:
                return full.dequantize(cfg.dtype), None
            local = stored.dequantize_tiles(cfg.dtype)
            return stored.layout.from_tiles(all_gather_bits(local, axis, dim=dim, tiled=True)), None
        if isinstance(stored, Tiled):
            dim = stored.value.ndim - 3
            full = all_gather_bits(stored.value, axis, dim=dim, tiled=True)
            return stored.layout.from_tiles(full).astype(cfg.dtype), None
        return stored.astype(cfg.dtype), None


def _zero_cotangent(x):
    return jax.tree.map(
        lambda a: np.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(a.dtype, jnp.inexact)
        else jnp.zeros_like(a), x)


@functools.lru_cache(maxsize=None)
def _gather_fn(cfg: GatherConfig):
    @jax.custom_vjp
    def fetch(stored, master):
        w, q = _gather_forward(stored, cfg)
        if cfg.nvfp4:
            # The recipe GEMM never reads the float weight's values: a zero sink that only
            # routes the weight gradient (XLA removes it).
            return q, jnp.zeros(q.shape, cfg.dtype)
        return w

    def fwd(stored, master):
        return fetch(stored, master), (stored, master)

    def bwd(res, ct):
        with jax.named_scope(REDUCE_SCOPE):
            return _reduce_grad(res, ct)

    def _reduce_grad(res, ct):
        stored, master = res
        g = ct[1] if cfg.nvfp4 else ct
        if isinstance(master, Tiled):
            tiles = master.layout.local().to_tiles(g)
            value = ordered_reduce_scatter(tiles, cfg.axis, cfg.replica_axis)
            if cfg.tensor_axis is not None and not _split_over_tensor(master):
                value = ordered_sum(value, cfg.tensor_axis)
            grad = Tiled(value.astype(master.value.dtype), master.layout)
        else:
            value = ordered_mean(g, cfg.batch_axes)
            if cfg.tensor_axis is not None:
                value = ordered_sum(value, cfg.tensor_axis)
            grad = value.astype(master.dtype)
        return _zero_cotangent(stored), grad

    fetch.defvjp(fwd, bwd)
    return fetch


def gather_weight(stored, master, cfg: GatherConfig = GatherConfig()):
    """A parameter at its point of use (inside ``shard_map`` manual over ``cfg.axis``).

    ``stored``: this device's shard of the stored param (:class:`TiledNVFP4`, :class:`Tiled`
    plain, or a replicated array); ``master``: this device's shard of its float32 master
    (:class:`Tiled`, or the replicated array), which only receives the gradient.

    Forward: all-gather the shard's packed bytes and scale bytes (u8) or plain bits and return
    the logical weight in ``cfg.dtype`` (or ``(NVFP4Array, sink)`` with ``cfg.nvfp4``); with
    ``cfg.tensor_axis``, a tensor-split weight is this rank's sub-matrix.
    Backward: the weight gradient, averaged over the data axis in a fixed order, lands in
    ``master``'s layout: this device's tiles only (a replicated master gets the full mean).
    ``master=None`` (evaluation): the forward alone, nothing to differentiate.
    """
    if master is None:
        w, q = _gather_forward(stored, cfg)
        return (q, None) if cfg.nvfp4 else w
    return _gather_fn(cfg)(stored, master)
