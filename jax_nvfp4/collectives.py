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

Outside (``jit`` with shardings): :func:`reshard_bits`, :func:`global_norm`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4.array import NVFP4Array
from jax_nvfp4.layout import TILE, Tiled, TiledNVFP4

# Name scopes (HLO op_name metadata): what a collective is for.
GATHER_SCOPE = "weight_gather"
REDUCE_SCOPE = "ordered_reduce"

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


def fold_sum(parts: jax.Array) -> jax.Array:
    """``((p[0] + p[1]) + p[2]) + ...`` over axis 0 in float32: a fixed order (``jnp.sum``
    may sum pairwise for one shape and sequentially for another)."""
    acc = parts[0].astype(jnp.float32)
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i].astype(jnp.float32)
    return acc


def _size(axis) -> int:
    return jax.lax.psum(1, axis)


def all_gather_bits(x: jax.Array, axis, *, dim: int = 0, tiled: bool = False) -> jax.Array:
    """``jax.lax.all_gather`` of ``x``'s bits (floats travel as same-width unsigned ints)."""
    out = jax.lax.all_gather(to_bits(x), axis, axis=dim, tiled=tiled)
    return from_bits(out, x.dtype)


def ordered_mean(x: jax.Array, axis) -> jax.Array:
    """Mean over ``axis`` of a value each device holds (inside ``shard_map``): all-gather
    its bits, fold in shard order in float32, divide by the axis size. Same on every device."""
    n = _size(axis)
    if n == 1:
        return x.astype(jnp.float32)
    with jax.named_scope(REDUCE_SCOPE):
        parts = all_gather_bits(x, axis)
        return fold_sum(parts) / np.float32(n)


def ordered_reduce_scatter(tiles: jax.Array, axis) -> jax.Array:
    """Mean over ``axis`` of every device's full tile array ``[..., nt, T, 16, 16]``, each
    device receiving its own ``T / N`` tiles ``[..., nt, T/N, 16, 16]`` float32 (inside
    ``shard_map``): an all-to-all of the bits, then a fold in shard order."""
    n = _size(axis)
    if n == 1:
        return tiles.astype(jnp.float32)
    *lead, nt, t, a, b = tiles.shape
    k = len(lead)
    with jax.named_scope(REDUCE_SCOPE):
        parts = tiles.reshape(*lead, nt, n, t // n, a, b)
        parts = jnp.moveaxis(parts, k + 1, 0)  # [n, ..., nt, T/n, 16, 16]; row j goes to device j
        moved = jax.lax.all_to_all(to_bits(parts), axis, 0, 0, tiled=True)
        return fold_sum(from_bits(moved, tiles.dtype)) / np.float32(n)


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """How :func:`gather_weight` materialises a weight.

    ``axis``: the data axis (name or tuple) the shards are split over. ``dtype``: the weight's
    compute dtype (its gradient arrives in it). ``packed``: gather the packed NVFP4 bytes and
    dequantize after (True), or dequantize each shard and gather the dequantized values
    (False; the bf16-gather reference, bit-identical values). ``nvfp4``: also return the
    gathered :class:`NVFP4Array` (for the recipe GEMMs).
    """

    axis: Any = "data"
    dtype: Any = jnp.bfloat16
    packed: bool = True
    nvfp4: bool = False


def _gather_forward(stored, cfg: GatherConfig):
    """(logical weight in ``cfg.dtype`` or None, gathered NVFP4Array or None)."""
    axis = cfg.axis
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
                full = TiledNVFP4(jax.lax.all_gather(stored.data, axis, axis=dim, tiled=True),
                                  jax.lax.all_gather(stored.scale_bits, axis, axis=dim, tiled=True),
                                  stored.amax_bits, stored.layout)
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
        stored, master = res
        g = ct[1] if cfg.nvfp4 else ct
        if isinstance(master, Tiled):
            tiles = master.layout.to_tiles(g)
            grad = Tiled(ordered_reduce_scatter(tiles, cfg.axis).astype(master.value.dtype), master.layout)
        else:
            grad = ordered_mean(g, cfg.axis).astype(master.dtype)
        return _zero_cotangent(stored), grad

    fetch.defvjp(fwd, bwd)
    return fetch


def gather_weight(stored, master, cfg: GatherConfig = GatherConfig()):
    """A parameter at its point of use (inside ``shard_map`` manual over ``cfg.axis``).

    ``stored``: this device's shard of the stored param (:class:`TiledNVFP4`, :class:`Tiled`
    plain, or a replicated array); ``master``: this device's shard of its float32 master
    (:class:`Tiled`, or the replicated array), which only receives the gradient.

    Forward: all-gather the shard's packed bytes and scale bytes (u8) or plain bits and return
    the logical weight in ``cfg.dtype`` (or ``(NVFP4Array, sink)`` with ``cfg.nvfp4``).
    Backward: the weight gradient, averaged over the data axis in a fixed order, lands in
    ``master``'s layout: this device's tiles only (a replicated master gets the full mean).
    """
    return _gather_fn(cfg)(stored, master)


# ----------------------------------------------------------------------------- outside shard_map
def constrain(x, sharding):
    """``with_sharding_constraint``, or ``jax.sharding.reshard`` on meshes with Explicit axes
    (the default of ``jax.make_mesh``), where a constraint is refused."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if any(str(t).endswith("Explicit") for t in types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def reshard_bits(x, sharding, *, min_itemsize: int = 1):
    """Reshard ``x`` (under ``jit``) through its same-width unsigned bits, so the collective
    only moves bytes: XLA can neither widen it (XLA:CPU widens bf16 and float8 collectives) nor
    turn it into a reduction. The optimization barriers stop XLA from folding the bitcasts back
    into the collective. Float arrays narrower than ``min_itemsize`` bytes, and non-floats,
    are resharded as they are."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < min_itemsize:
        return constrain(x, sharding)
    bits = jax.lax.optimization_barrier(to_bits(x))
    bits = jax.lax.optimization_barrier(constrain(bits, sharding))
    return from_bits(bits, x.dtype)


def global_norm(tree, mesh, rules) -> jax.Array:
    """``sqrt(sum of squares)`` of a tree of :class:`Tiled` / replicated float arrays (e.g.
    master-layout gradients) with the cross-device sum in a fixed order: each device sums its
    own shard, the partial sums are gathered as bits and folded in shard order."""
    from jax_nvfp4.sharding import spec_of

    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Tiled))
    if not leaves:
        return jnp.zeros([], jnp.float32)
    if mesh is None:
        sq = [jnp.sum(jnp.square((x.value if isinstance(x, Tiled) else x).astype(jnp.float32))) for x in leaves]
        return jnp.sqrt(functools.reduce(jnp.add, sq))
    axes = tuple(a for a in (*rules.data_axes, rules.tensor_axis) if a is not None and a in mesh.axis_names)
    specs = [spec_of(x) for x in leaves]
    values = [x.value if isinstance(x, Tiled) else x for x in leaves]
    # Leaves split over the same mesh axes share one partial sum and one gather; a replicated
    # leaf is counted once.
    groups = {}
    for i, spec in enumerate(specs):
        used = set()
        for e in spec:
            used.update(e if isinstance(e, tuple) else (e,))
        groups.setdefault(tuple(a for a in axes if a in used), []).append(i)

    def local(*vs):
        total = None
        for split, idx in groups.items():
            part = None
            for i in idx:
                s = jnp.sum(jnp.square(vs[i].astype(jnp.float32)))
                part = s if part is None else part + s
            with jax.named_scope(REDUCE_SCOPE):
                for ax in split:  # a fixed order of axes, each folded in shard order
                    part = fold_sum(all_gather_bits(part, ax))
            total = part if total is None else total + part
        return jnp.sqrt(total)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)(*values)
