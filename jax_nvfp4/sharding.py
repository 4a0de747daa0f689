"""Where parameters, masters and optimizer state live on a mesh, and moving them there.

The layout itself (tile-major, sharded over the data axis for any data-axis size) is
:mod:`jax_nvfp4.layout`. This module applies it to trees:

- :func:`shard_params`: logical params (``NVFP4Array`` / float arrays) -> the stored form
  (:class:`~jax_nvfp4.layout.TiledNVFP4` / :class:`~jax_nvfp4.layout.Tiled` / replicated
  arrays); :func:`logical` is the inverse view.
- :func:`partition_specs` / :func:`shardings`: where every leaf of a stored tree or an
  optimizer state lives.
- :func:`gather` (under ``jit``): all-gather the stored params across the data axis as packed
  bytes and scale bytes, returning logical ``NVFP4Array`` leaves. The training step gathers
  layer by layer instead (:func:`jax_nvfp4.fetch.gather_weight`).
- :func:`constrain` / :func:`reshard_bits`: place an array (bits only, for floats);
  :func:`global_norm`: the norm of a tree of shards, summed across devices in a fixed order.
- :func:`scatter_replicated`: a logical float array that every device holds whole (e.g. the
  gradient of gathered weights) -> its :class:`~jax_nvfp4.layout.Tiled` shards, each device
  slicing its own tiles: no communication, on Auto and Explicit meshes alike.
- :func:`requantize`: a sharded float32 master -> its stored NVFP4 shard, each device
  quantizing the tiles it owns with the global amax (bit-identical to quantizing the whole
  unsharded tensor).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import BLOCK_2D, explicit_sharding, is_nvfp4, quantize
from jax_nvfp4.collectives import (GATHER_SCOPE, NORM_SCOPE, REQUANTIZE_SCOPE, all_gather_bits, fold_sum, from_bits,
                                   to_bits)
from jax_nvfp4.layout import Layout, Tiled, TiledNVFP4, is_tiled, quantize_tiles, tile_scales
from jax_nvfp4.rules import DEFAULT_RULES, Rules, batch_axes, layout_for
from jax_nvfp4.params import Policy, dequantize_params, matrix_amax, path_str, shared_amaxes

__all__ = ["Rules", "context_mesh", "shard_params", "logical", "partition_specs", "shardings", "gather",
           "gather_dequantized", "requantize", "scatter_replicated", "spec_of", "constrain"]


def context_mesh(mesh=None):
    """The mesh to use: ``mesh`` if given, else the one set by ``jax.set_mesh`` (or None)."""
    if mesh is not None:
        return mesh
    try:
        m = jax.sharding.get_mesh()  # concrete, when set by jax.set_mesh
    except Exception:  # noqa: BLE001 - no concrete mesh in this context
        m = None
    if m is None or m.empty:
        m = jax.sharding.get_abstract_mesh()
    if m is None or m.empty:
        return None
    return m


def typed_mesh(tree):
    """The mesh a leaf of ``tree`` names in its type (sharded over Explicit axes), or None: under
    ``jit`` without a context mesh, where a state's arrays still carry their mesh."""
    return next((s.mesh for s in map(explicit_sharding, jax.tree.leaves(tree)) if s is not None), None)


def _is_node(x) -> bool:
    return is_nvfp4(x) or is_tiled(x)


def spec_of(leaf) -> P:
    """PartitionSpec of one leaf (a :class:`Tiled`'s value; replicated otherwise)."""
    if isinstance(leaf, Tiled):
        return leaf.spec()
    return P()


# ----------------------------------------------------------------------------- placement (outside shard_map)
def constrain(x, sharding):
    """``with_sharding_constraint``, or ``jax.sharding.reshard`` on meshes with Explicit axes
    (the default of ``jax.make_mesh``), where a constraint is refused. Under a context mesh of
    the same axes (a ``jax.set_mesh``, or a ``jax.sharding.auto_axes`` region that retypes
    them), the axes are typed as the context types them."""
    mesh = getattr(sharding, "mesh", None)
    context = jax.sharding.get_abstract_mesh()
    if isinstance(sharding, NamedSharding) and not context.empty and context.axis_names == mesh.axis_names:
        sharding, mesh = NamedSharding(context, sharding.spec), context
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    explicit = {a for a, t in types.items() if str(t).endswith("Explicit")}
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    if not isinstance(sharding, NamedSharding):
        return jax.sharding.reshard(x, sharding)
    # A spec naming Explicit and Auto axes (an Explicit data axis, an Auto tensor axis): the
    # Explicit part is the value's type (reshard), the Auto part a constraint on it.
    ex, auto = _split_spec(sharding.spec, explicit), _split_spec(sharding.spec, set(types) - explicit)
    x = jax.sharding.reshard(x, NamedSharding(mesh, ex))
    if any(e is not None for e in auto):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, auto))
    return x


def _split_spec(spec: P, names) -> P:
    """``spec`` with only the mesh axes in ``names`` kept."""
    def keep(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in names)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*(keep(e) for e in spec))


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
            with jax.named_scope(NORM_SCOPE):
                for ax in split:  # a fixed order of axes, each folded in shard order
                    part = fold_sum(all_gather_bits(part, ax))
            total = part if total is None else total + part
        return jnp.sqrt(total)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)(*values)


# ----------------------------------------------------------------------------- logical <-> stored
def shard_params(tree, mesh=None, rules: Optional[Rules] = None, policy: Optional[Policy] = None, *,
                 cast_bf16: bool = False):
    """The stored form of a params tree: ``NVFP4Array`` leaves (and float leaves ``policy``
    selects, quantized here, from their values rounded to bf16 with ``cast_bf16``: what
    ``master_weights(..., cast_master_bf16=True)`` re-quantizes) become :class:`TiledNVFP4`; other large float leaves
    :class:`Tiled` in their own dtype (``policy.keep_dtype`` for the leaves it keeps, as
    :func:`~jax_nvfp4.params.quantize_params` stores them); small leaves stay as they are (replicated). Pure: call
    it under ``jit`` with ``out_shardings=shardings(...)``, as :func:`~jax_nvfp4.optim.sharded_state` does, or ``jax.device_put``
    the result."""
    rules = rules or DEFAULT_RULES
    mesh = context_mesh(mesh)
    if mesh is not None:
        batch_axes(mesh, rules)  # a data axis the mesh lacks (a typo) would store every leaf whole on every device
    _refuse_mesh_boxes(tree)
    wanted = lambda p, leaf: (not is_tiled(leaf) and not is_nvfp4(leaf) and policy is not None
                              and policy.wants(p, leaf, rules.stacked_axes(p)))
    cast = lambda x: _bf16_rounded(jnp.asarray(x, jnp.float32), True) if cast_bf16 else x
    amax = shared_amaxes({p: matrix_amax(cast(x)) for p, x in ((path_str(k), x) for k, x in
                          jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)[0])
                          if wanted(p, x) and policy.amax_group(p)}, policy)

    def one(path, leaf):
        if is_tiled(leaf):
            return leaf
        p = path_str(path)
        if wanted(p, leaf):
            leaf = quantize(cast(leaf), block=policy.block, amax=amax.get(p), four_over_six=policy.four_over_six)
        elif (policy is not None and policy.keep_dtype is not None and policy.kept(p) and not is_nvfp4(leaf)
              and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)):
            leaf = jnp.asarray(leaf).astype(policy.keep_dtype)  # as quantize_params stores a kept leaf
        lay = layout_for(p, leaf.shape, is_nvfp4(leaf), mesh, rules)
        if is_nvfp4(leaf):
            return TiledNVFP4.from_array(leaf, lay)
        if lay is None:
            return leaf
        return Tiled.from_logical(leaf, lay)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_node)


def _refuse_mesh_boxes(tree) -> None:
    """ValueError for a Linen ``nn.Partitioned`` box (``nn.with_partitioning``) in ``tree``: its
    unbox constrains the value to the mesh axes it names, which the step's per-device program
    refuses far from here. (``nn.LogicallyPartitioned`` boxes unbox without a constraint.)"""
    from flax.core import meta

    box = lambda x: type(x) is meta.Partitioned
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=box)[0]:
        if box(leaf):
            raise ValueError(f"{path_str(path)!r} is a flax nn.Partitioned box (nn.with_partitioning): pass the "
                             "unboxed params, nn.unbox(params); the library lays them out over the mesh itself")


def host_array(x) -> np.ndarray:
    """A host copy of ``x``; an array spread over several processes is gathered first (every
    process gets the whole array)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def logical(tree):
    """The logical view of a stored tree or state: ``TiledNVFP4`` -> ``NVFP4Array``,
    ``Tiled`` -> its ``[..., rows, cols]`` array (a relayout of bytes, no arithmetic)."""

    def one(x):
        if isinstance(x, TiledNVFP4):
            return x.to_array()
        if isinstance(x, Tiled):
            return x.logical()
        return x

    return jax.tree.map(one, tree, is_leaf=_is_node)


def partition_specs(tree):
    """PartitionSpecs for every leaf of a stored params tree or an optimizer state
    (``TiledNVFP4`` and ``Tiled`` nodes get their layouts; other leaves are replicated)."""

    def one(leaf):
        if isinstance(leaf, TiledNVFP4):
            return leaf.specs()
        if isinstance(leaf, Tiled):
            return Tiled(leaf.spec(), leaf.layout)
        return P()

    return jax.tree.map(one, tree, is_leaf=_is_node)


def shardings(tree, mesh):
    """``NamedSharding`` for every leaf of a stored params tree or optimizer state on ``mesh``
    (for ``jax.device_put`` or ``jit`` in/out shardings). The layouts are carried by the tree's
    ``Tiled``/``TiledNVFP4`` nodes."""
    specs = partition_specs(tree)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _without_data(spec: P, layout: Layout) -> P:
    data = set(layout.data_axis if isinstance(layout.data_axis, tuple) else (layout.data_axis,))
    out = []
    for e in spec:
        if e is None:
            out.append(None)
        elif isinstance(e, tuple):
            rest = tuple(a for a in e if a not in data)
            out.append(rest or None)
        else:
            out.append(None if e in data or e == layout.data_axis else e)
    return P(*out)


# ----------------------------------------------------------------------------- gather (GSPMD)
def gather(tree, mesh=None):
    """All-gather a stored params tree across the data axis (under ``jit``): packed bytes and
    scale bytes for NVFP4 leaves, bits for large plain leaves. Returns the logical tree
    (``NVFP4Array`` and float arrays; tensor-axis splits are kept)."""
    mesh = context_mesh(mesh)

    def one(leaf):
        if not is_tiled(leaf):
            return leaf
        if mesh is None:
            return logical(leaf)
        if isinstance(leaf, TiledNVFP4):
            sp = leaf.specs()
            full = leaf.replace(constrain(leaf.data, NamedSharding(mesh, _without_data(sp.data, leaf.layout))),
                                constrain(leaf.scale_bits, NamedSharding(mesh, _without_data(sp.scale_bits, leaf.layout))))
            return full.to_array()
        value = reshard_bits(leaf.value, NamedSharding(mesh, _without_data(leaf.spec(), leaf.layout)))
        return leaf.layout.from_tiles(value)

    with jax.named_scope(GATHER_SCOPE):
        return jax.tree.map(one, tree, is_leaf=_is_node)


def gather_dequantized(tree, dtype=jnp.bfloat16, mesh=None):
    """The reference to :func:`gather`: each device dequantizes its own tiles of every NVFP4
    leaf to ``dtype`` and the *dequantized* tiles are all-gathered (``dtype`` bytes, about 4x
    the packed bytes). Values are bit-identical to ``dequantize_params(gather(tree), dtype)``.
    Other float leaves: cast to ``dtype``."""
    mesh = context_mesh(mesh)

    def one(leaf):
        if isinstance(leaf, TiledNVFP4):
            local = leaf.dequantize_tiles(dtype)
            if mesh is not None:
                local = constrain(local, NamedSharding(mesh, leaf.specs().data))
                local = reshard_bits(local, NamedSharding(mesh, _without_data(leaf.specs().data, leaf.layout)))
            return leaf.layout.from_tiles(local)
        out = gather(leaf, mesh)
        return dequantize_params(out, dtype)

    with jax.named_scope(GATHER_SCOPE):
        return jax.tree.map(one, tree, is_leaf=_is_node)


def _shard_origin(layout: Layout):
    """``(first tensor shard, first tile)`` of this device's block of an array in ``layout``
    (inside a ``shard_map`` manual over the layout's axes)."""
    ti = jax.lax.axis_index(layout.tensor_axis) if layout.n_tensor > 1 else 0
    to = jax.lax.axis_index(layout.data_axis) * layout.local_tiles if layout.n_data > 1 else 0
    return ti, to


def scatter_replicated(x: jax.Array, layout: Layout, mesh=None) -> Tiled:
    """``Tiled.from_logical(x, layout)`` sharded as the layout says, for an ``x`` that every
    device holds whole (under ``jit``): each device lays out ``x`` and keeps its own tiles.

    Nothing moves when ``x`` is replicated. (A sharding constraint instead lets XLA propagate
    the tile sharding back into the computation of ``x``: on meshes with Auto axes XLA then
    computes the gradients of gathered weights in pieces and moves float32 tiles between
    devices: all-gathers of the weights' size, collective-permutes of the tile padding.)"""
    mesh = context_mesh(mesh)
    if mesh is None or (layout.n_data == 1 and layout.n_tensor == 1):
        return Tiled.from_logical(x, layout)
    k = x.ndim - 2

    def local(full):
        tiles = layout.to_tiles(full)
        ti, to = _shard_origin(layout)
        tiles = jax.lax.dynamic_slice_in_dim(tiles, ti, 1, axis=k) if layout.n_tensor > 1 else tiles
        return jax.lax.dynamic_slice_in_dim(tiles, to, layout.local_tiles, axis=k + 1)

    value = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=layout.spec(k), check_vma=False)(x)
    return Tiled(value, layout)


# ----------------------------------------------------------------------------- re-quantization
def _bf16_rounded(x, cast_bf16: bool):
    """float32 ``x``, rounded to bf16 first with ``cast_bf16`` (``master_weights(..., cast_master_bf16=True)``)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32) if cast_bf16 else x


def _master_value(m: Tiled, cast_bf16: bool):
    return _bf16_rounded(m.value, cast_bf16)


def _shard_axes(m: Tiled):
    spec = m.spec()
    flat_axes = []
    for a in spec:
        if a is not None:
            flat_axes.extend(a if isinstance(a, tuple) else (a,))
    return spec, tuple(flat_axes)


def global_amax(m: Tiled, mesh=None, *, cast_bf16: bool = False) -> jax.Array:
    """``[...]`` float32: max(|x|) of each matrix of a tiled float32 master, over all its
    shards (an integer ``pmax``, so NaN survives): the amax :func:`requantize` computes."""
    mesh = context_mesh(mesh)
    value = _master_value(m, cast_bf16)
    spec, flat_axes = _shard_axes(m)
    tile_axes = (-4, -3, -2, -1)
    if mesh is None or not flat_axes:
        return nx.abs_max(value, axis=tile_axes)

    def local(v):
        bits = jax.lax.bitcast_convert_type(nx.abs_max(v, axis=tile_axes), jnp.uint32)
        with jax.named_scope(REQUANTIZE_SCOPE):
            return jax.lax.bitcast_convert_type(jax.lax.pmax(bits, flat_axes), jnp.float32)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=P(), check_vma=False)(value)


def requantize(m: Tiled, mesh=None, *, block=BLOCK_2D, key=None, cast_bf16: bool = False,
               amax=None, four_over_six: bool = False) -> TiledNVFP4:
    """Quantize a tiled float32 master to its stored :class:`TiledNVFP4`, each device
    quantizing its own tiles with the global amax (an integer ``pmax`` over the data and
    tensor shards, so NaN survives), or with ``amax`` (``[...]`` float32, replicated) when
    given: a shared amax (:attr:`Policy.shared_amax`). The result is the stored shard itself
    (same layout) and bit-identical to ``quantize(m.logical(), block=block, amax=amax)``
    (with the same ``key`` for stochastic rounding: draws are indexed by each element's
    logical position; with the same ``four_over_six``)."""
    mesh = context_mesh(mesh)
    lay = m.layout
    value = _master_value(m, cast_bf16)
    spec, flat_axes = _shard_axes(m)
    if mesh is None or not flat_axes:
        return quantize_tiles(value, lay, block=block, key=key, amax=amax, four_over_six=four_over_six)

    def local(v, *rest):
        def reduce(bits):
            with jax.named_scope(REQUANTIZE_SCOPE):
                return jax.lax.pmax(bits, flat_axes)
        given = rest[0] if amax is not None else None
        k = rest[-1] if key is not None else None
        ti, to = _shard_origin(lay)
        q = quantize_tiles(v, lay, block=block, key=k, reduce_amax=reduce, tensor_index=ti, tile_offset=to,
                           amax=given, four_over_six=four_over_six)
        return q.data, q.scale_bits, q.amax_bits

    k = value.ndim - 4
    # The key and amax are arguments, not closures: shard_map refuses to close over a value
    # that lives on a mesh with Explicit axes.
    extra = tuple(x for x in (amax, key) if x is not None)
    data, scale, amax_bits = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, *(P() for _ in extra)),
        out_specs=(spec, lay.spec(k, 0 if tile_scales(block) == (1, 1) else 1), P()),
        check_vma=False,
    )(value, *extra)
    return TiledNVFP4(data, scale, amax_bits, lay, block)
