"""How NVFP4 parameters and their float32 masters are laid out across a mesh.

- ``NVFP4Array`` params are stored sharded over the data axis (and the tensor axis where a
  rule splits them for compute). :func:`gather` all-gathers them across the data axis as
  packed bytes and scale bytes only.
- Float32 masters (:class:`MasterArray`, in the optimizer state) are padded so that every data
  shard owns whole 16x16 tiles; each device re-quantizes its own tiles with the global amax
  (one float per matrix, a max across shards), which is bit-identical to quantizing the whole
  unsharded tensor for any data-axis size and any shape.

Sharding is data, decided in one place: :class:`Rules`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import BLOCK_2D, NVFP4Array, element_index, is_nvfp4, quantize_padded
from jax_nvfp4.params import path_str


@dataclasses.dataclass(frozen=True)
class Rules:
    """Sharding rules.

    Args:
      data_axis: the mesh axis that shards storage (params, masters, optimizer state).
      tensor_axis: the mesh axis that splits weights for compute (absent from the mesh = off).
      tensor: ``(regex, dim)`` pairs: a weight whose path matches is split over the tensor axis
        along ``dim`` (-1: columns, e.g. QKV and MLP-in kernels; -2: rows, e.g. attention-out
        and MLP-out kernels). The data axis then shards the other of the last two axes.
      min_shard_size: plain (non-NVFP4) leaves smaller than this keep a replicated master and
        param, so their update needs no collective (biases, norms).
      shard_params: also store large plain (e.g. bf16) params sharded over the data axis and
        gather them in :func:`gather` (FSDP-style, as for NVFP4 leaves); default: replicated.
    """

    data_axis: str = "data"
    tensor_axis: Optional[str] = "tensor"
    tensor: Tuple[Tuple[str, int], ...] = ()
    min_shard_size: int = 1 << 14
    shard_params: bool = False

    def tensor_dim(self, path: str) -> Optional[int]:
        for pat, dim in self.tensor:
            if re.search(pat, path):
                if dim not in (-1, -2):
                    raise ValueError(f"tensor rule {pat!r}: dim must be -1 or -2, got {dim}")
                return dim
        return None


DEFAULT_RULES = Rules()


# ----------------------------------------------------------------------------- mesh helpers
def context_mesh(mesh=None):
    """The mesh to use: ``mesh`` if given, else the one set by ``jax.set_mesh`` (or None)."""
    if mesh is not None:
        return mesh
    try:
        m = jax.sharding.get_mesh()  # concrete, when set by jax.set_mesh
    except Exception:  # noqa: BLE001 - older JAX or no concrete mesh in this context
        m = None
    if m is None or m.empty:
        m = jax.sharding.get_abstract_mesh()
    if m is None or m.empty:
        return None
    return m


def axis_size(mesh, name: Optional[str]) -> int:
    if mesh is None or name is None or name not in mesh.axis_names:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[name])


def _named(mesh, spec: P):
    if isinstance(mesh, jax.sharding.Mesh):
        return NamedSharding(mesh, spec)
    return NamedSharding(mesh, spec) if mesh is not None else None


def _spec(ndim: int, placements: dict) -> P:
    """A PartitionSpec of ``ndim`` entries with ``placements`` {dim (negative ok): axis}."""
    entries = [None] * ndim
    for dim, ax in placements.items():
        if ax is not None:
            entries[dim % ndim] = ax
    return P(*entries)


# ----------------------------------------------------------------------------- the master layout
@dataclasses.dataclass(frozen=True)
class MasterArray:
    """A float32 master weight in its sharded layout (a pytree node with one leaf).

    ``value`` is ``[..., R, C]`` padded with zeros so that the data shards (and tensor shards)
    hold whole 16x16 tiles: ``R`` is a multiple of ``16 * data`` (when the data axis is on the
    rows) and so on. ``shape`` is the logical shape; ``data_dim``/``tensor_dim`` say which of
    the last two axes the data/tensor axes split (None: not split). ``nvfp4`` says whether the
    parameter it backs is an NVFP4 leaf. Optimizer transforms see ``value`` like any leaf; the
    zero padding receives zero gradients and stays zero under element-wise optimizers.
    """

    value: jax.Array
    shape: Tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    data_dim: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))
    tensor_dim: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))
    nvfp4: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def logical(self) -> jax.Array:
        """The unpadded ``[..., rows, cols]`` master."""
        return self.value[tuple(slice(0, d) for d in self.shape)]


jax.tree_util.register_dataclass(
    MasterArray, data_fields=["value"], meta_fields=["shape", "data_dim", "tensor_dim", "nvfp4"]
)


def is_master(x) -> bool:
    return isinstance(x, MasterArray)


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def master_layout(path: str, shape: Sequence[int], nvfp4: bool, mesh, rules: Rules = DEFAULT_RULES):
    """``(padded_shape, data_dim, tensor_dim)`` of the master of a leaf."""
    shape = tuple(int(d) for d in shape)
    n_data = axis_size(mesh, rules.data_axis)
    n_tensor = axis_size(mesh, rules.tensor_axis)
    if nvfp4:
        tdim = rules.tensor_dim(path) if n_tensor > 1 else None
        ddim = -1 if tdim == -2 else -2
        padded = list(shape)
        padded[ddim] = _ceil_to(shape[ddim], 16 * n_data)
        other = -1 if ddim == -2 else -2
        if tdim is not None and shape[tdim] % (16 * n_tensor):
            raise ValueError(
                f"{path}: axis {tdim} of shape {shape} is split over {n_tensor} tensor shards and must "
                f"be a multiple of 16 x {n_tensor} so that no 16x16 tile is cut"
            )
        padded[other] = _ceil_to(shape[other], 16)
        return tuple(padded), ddim, tdim
    # Plain leaves: shard a divisible axis when the leaf is big enough; a big leaf with no
    # divisible axis (say a 128256-row embedding on 144 devices) gets its rows padded, so its
    # master and optimizer state are still split N ways.
    ddim, tdim = plain_layout(path, shape, mesh, rules)
    if ddim is None and n_data > 1 and math.prod(shape) >= rules.min_shard_size:
        ddim = -2 if len(shape) >= 2 and tdim != -2 else -1
        padded = list(shape)
        padded[ddim] = _ceil_to(shape[ddim], n_data)
        return tuple(padded), ddim, tdim
    return shape, ddim, tdim


def plain_layout(path: str, shape: Sequence[int], mesh, rules: Rules = DEFAULT_RULES):
    """``(data_dim, tensor_dim)`` of a plain (non-NVFP4) leaf: the tensor axis where a rule
    says (and it divides), the data axis on the rows (else columns) when the leaf has at least
    ``min_shard_size`` elements and the axis divides; None where not split."""
    n_data = axis_size(mesh, rules.data_axis)
    n_tensor = axis_size(mesh, rules.tensor_axis)
    tdim = None
    if n_tensor > 1 and len(shape) >= 2:
        t = rules.tensor_dim(path)
        if t is not None and shape[t] % n_tensor == 0:
            tdim = t
    if n_data == 1 or math.prod(shape) < rules.min_shard_size:
        return None, tdim
    for d in ((-2, -1) if len(shape) >= 2 else (-1,)):
        if d != tdim and shape[d] % n_data == 0:
            return d, tdim
    return None, tdim


def to_master(path: str, leaf, mesh, rules: Rules = DEFAULT_RULES, nvfp4: Optional[bool] = None) -> MasterArray:
    """The float32 master of a parameter leaf (an ``NVFP4Array`` starts from its dequantized
    values), padded into its sharded layout. ``nvfp4`` says whether the parameter is (or will
    be) stored in NVFP4; default: whether ``leaf`` is an ``NVFP4Array``."""
    nvfp4 = is_nvfp4(leaf) if nvfp4 is None else nvfp4
    value = leaf.dequantize(jnp.float32) if is_nvfp4(leaf) else jnp.asarray(leaf, jnp.float32)
    shape = tuple(value.shape)
    padded, ddim, tdim = master_layout(path, shape, nvfp4, mesh, rules)
    if padded != shape:
        value = jnp.pad(value, [(0, p - s) for p, s in zip(padded, shape)])
    return MasterArray(value, shape, ddim, tdim, nvfp4)


def master_spec(m: MasterArray, rules: Rules = DEFAULT_RULES) -> P:
    return _spec(len(m.value.shape) if hasattr(m.value, "shape") else len(m.shape),
                 {**({m.data_dim: rules.data_axis} if m.data_dim is not None else {}),
                  **({m.tensor_dim: rules.tensor_axis} if m.tensor_dim is not None else {})})


# ----------------------------------------------------------------------------- param layout
def _nvfp4_specs(path: str, q: NVFP4Array, mesh, rules: Rules):
    """PartitionSpecs of (data, scale, amax_bits) of a stored NVFP4 parameter."""
    n_data = axis_size(mesh, rules.data_axis)
    n_tensor = axis_size(mesh, rules.tensor_axis)
    tdim = rules.tensor_dim(path) if n_tensor > 1 else None
    ddim = -1 if tdim == -2 else -2
    specs = []
    for arr in (q.data, q.scale_bits):
        shape = arr.shape
        place = {}
        if tdim is not None and shape[tdim] % n_tensor == 0:
            place[tdim] = rules.tensor_axis
        if n_data > 1 and shape[ddim] % n_data == 0:
            place[ddim] = rules.data_axis
        specs.append(_spec(len(shape), place))
    specs.append(P())
    return specs


def _plain_param_spec(path: str, leaf, mesh, rules: Rules) -> P:
    shape = jnp.shape(leaf)
    if not rules.shard_params or len(shape) == 0:
        return P()
    ddim, tdim = plain_layout(path, shape, mesh, rules)
    return _spec(len(shape), {**({ddim: rules.data_axis} if ddim is not None else {}),
                              **({tdim: rules.tensor_axis} if tdim is not None else {})})


def _without(spec: P, axis: str) -> P:
    out = []
    for e in spec:
        if e == axis:
            out.append(None)
        elif isinstance(e, tuple):
            rest = tuple(a for a in e if a != axis)
            out.append(rest if len(rest) > 1 else (rest[0] if rest else None))
        else:
            out.append(e)
    return P(*out)


def partition_specs(tree, mesh=None, rules: Rules = DEFAULT_RULES):
    """PartitionSpecs for every leaf of a params tree or an optimizer state (``NVFP4Array``
    and ``MasterArray`` nodes get their layouts; other leaves are replicated)."""
    mesh = context_mesh(mesh)

    def one(path, leaf):
        p = path_str(path)
        if is_nvfp4(leaf):
            d, s, a = _nvfp4_specs(p, leaf, mesh, rules)
            return NVFP4Array(d, s, a, leaf.matrix_shape, leaf.block)
        if is_master(leaf):
            return MasterArray(master_spec(leaf, rules), leaf.shape, leaf.data_dim, leaf.tensor_dim, leaf.nvfp4)
        return _plain_param_spec(p, leaf, mesh, rules)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: is_nvfp4(x) or is_master(x))


def shardings(tree, mesh, data_axis: str = "data", rules: Optional[Rules] = None):
    """``NamedSharding`` for every leaf of ``tree`` (params or optimizer state) on ``mesh``.

    NVFP4 params: packed data and scales sharded over ``data_axis`` (rows, or columns where a
    tensor rule splits the rows), amax replicated. Masters: their padded layout. Everything
    else: replicated. Use with ``jax.device_put`` or as ``jit`` in/out shardings.
    """
    rules = rules or dataclasses.replace(DEFAULT_RULES, data_axis=data_axis)
    specs = partition_specs(tree, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- gather
def gather(tree, mesh=None, rules: Optional[Rules] = None, data_axis: str = "data"):
    """All-gather the NVFP4 leaves of ``tree`` across the data axis as packed bytes and scale
    bytes (uint8).

    Call inside ``jit``; ``mesh`` defaults to the context mesh (``jax.set_mesh``). Other leaves
    are returned unchanged (gathered in their dtype when ``rules.shard_params``). Tensor-axis
    splits are kept.
    """
    rules = rules or dataclasses.replace(DEFAULT_RULES, data_axis=data_axis)
    mesh = context_mesh(mesh)
    if mesh is None or axis_size(mesh, rules.data_axis) == 1:
        return tree

    def one(path, leaf):
        p = path_str(path)
        if not is_nvfp4(leaf):
            if not rules.shard_params or not hasattr(leaf, "shape"):
                return leaf
            spec = _plain_param_spec(p, leaf, mesh, rules)
            return _gather_as_bytes(leaf, _named(mesh, _without(spec, rules.data_axis)))
        ds, ss, _ = _nvfp4_specs(p, leaf, mesh, rules)
        data = jax.lax.with_sharding_constraint(leaf.data, _named(mesh, _without(ds, rules.data_axis)))
        scale = jax.lax.with_sharding_constraint(leaf.scale_bits, _named(mesh, _without(ss, rules.data_axis)))
        amax = jax.lax.with_sharding_constraint(leaf.amax_bits, _named(mesh, P()))
        return NVFP4Array(data, scale, amax, leaf.matrix_shape, leaf.block)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_nvfp4)


def reshard_bits(x, sharding, *, min_itemsize: int = 1):
    """Reshard ``x`` through its same-width unsigned bits, so the collective only moves bytes:
    XLA can neither widen it (XLA:CPU widens bf16 and float8 collectives to f32/f16) nor turn
    it into a reduction. The optimization barriers stop XLA from folding the bitcasts back
    into the collective. Float arrays narrower than ``min_itemsize`` bytes, and non-floats,
    are resharded as they are."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < min_itemsize:
        return jax.lax.with_sharding_constraint(x, sharding)
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
    bits = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, uint))
    bits = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(bits, sharding))
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def _gather_as_bytes(x, sharding):
    """Gather a parameter: narrow floats (bf16, f16, float8) travel as their bits; float32
    collectives are native everywhere and go as they are."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize >= 4:
        return jax.lax.with_sharding_constraint(x, sharding)
    return reshard_bits(x, sharding)


# ----------------------------------------------------------------------------- re-quantization
def requantize(
    m: MasterArray,
    mesh=None,
    rules: Rules = DEFAULT_RULES,
    *,
    block=BLOCK_2D,
    key=None,
    cast_bf16: bool = False,
) -> NVFP4Array:
    """Quantize a sharded master to an ``NVFP4Array`` of its logical shape, each device
    quantizing its own tiles with the global amax (a max over the data and tensor shards).

    Bit-identical to ``quantize(m.logical())`` (with the same ``key`` for stochastic rounding:
    draws are indexed by each element's position in the logical tensor).
    """
    mesh = context_mesh(mesh)
    rows, cols = m.shape[-2:]
    value = m.value.astype(jnp.bfloat16).astype(jnp.float32) if cast_bf16 else m.value
    spec = master_spec(m, rules)
    sharded_axes = tuple(a for a in spec if a is not None and axis_size(mesh, a) > 1)

    def reduce_amax(bits):
        for ax in sharded_axes:
            bits = jax.lax.pmax(bits, ax)
        return bits

    def local(v):
        uniform = None
        if key is not None:
            offs = [0, 0]
            for dim_i, dim in enumerate((-2, -1)):
                ax = spec[dim % len(spec)]
                if ax in sharded_axes:
                    offs[dim_i] = jax.lax.axis_index(ax) * v.shape[dim]
            uniform = nx.uniform_from_index(key, element_index(v.shape, (rows, cols), offs))
        codes, scale, amax = quantize_padded(v, block, uniform=uniform, reduce_amax=reduce_amax)
        # Bytes leave the shard: a float8 array may be widened by a later collective.
        amax_bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
        return nx.pack_codes(codes), jax.lax.bitcast_convert_type(scale, jnp.uint8), amax_bits

    if mesh is None or not sharded_axes:
        data, scale, amax_bits = local(value)
    else:
        data, scale, amax_bits = jax.shard_map(
            local, mesh=mesh if isinstance(mesh, jax.sharding.Mesh) else None,
            in_specs=(spec,), out_specs=(spec, spec, P()), check_vma=False,
        )(value)
    data = data[..., :rows, : _ceil_to(cols, 2) // 2]
    scale = scale[..., : -(-rows // block[0]), : -(-cols // block[1])]
    return NVFP4Array(data, scale, amax_bits, (rows, cols), block)


def constrain(tree, mesh=None, rules: Rules = DEFAULT_RULES):
    """``with_sharding_constraint`` of a params tree or state to its layout (inside jit)."""
    mesh = context_mesh(mesh)
    if mesh is None:
        return tree
    specs = partition_specs(tree, mesh, rules)
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, _named(mesh, s)), tree, specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def reduce_scatter_grads(grads, masters, data_axis: str = "data", dtype=None):
    """Inside a ``shard_map`` that is manual over ``data_axis``: sum each device's partial
    gradients across the data axis straight into the master shards (``psum_scatter``), in
    ``dtype`` (e.g. float32 for an fp32-accumulating reduction) or the gradient dtype.

    ``grads`` is a tree of full-size local partial gradients shaped like the logical params;
    ``masters`` the matching tree of :class:`MasterArray` (local shards, for the layout).
    Returns a tree of ``MasterArray`` holding the local gradient shards, which
    ``master_weights(...).update`` accepts as gradients.
    """

    def one(g, m):
        g = g.astype(dtype) if dtype is not None else g
        full = tuple(
            d * (jax.lax.axis_size(data_axis) if (i - len(m.shape)) == m.data_dim else 1)
            for i, d in enumerate(m.value.shape)
        )
        pad = [(0, f - s) for f, s in zip(full, g.shape)]
        if any(p for _, p in pad):
            g = jnp.pad(g, pad)
        if m.data_dim is None:
            g = jax.lax.psum(g, data_axis)
        else:
            g = jax.lax.psum_scatter(g, data_axis, scatter_dimension=m.data_dim % g.ndim, tiled=True)
        return MasterArray(g, m.shape, m.data_dim, m.tensor_dim, m.nvfp4)

    return jax.tree.map(one, grads, masters, is_leaf=is_master)


def gather_dequantized(tree, dtype=jnp.bfloat16, mesh=None, rules: Optional[Rules] = None):
    """The reference to :func:`gather`: each device dequantizes its own shard of every NVFP4
    leaf to ``dtype`` and the *dequantized* weights are all-gathered (``dtype`` bytes, about
    4x the packed bytes). Values are bit-identical to ``dequantize_params(gather(tree))``.
    Other leaves: cast to ``dtype`` (floats) and gathered like :func:`gather` does."""
    from jax_nvfp4.params import dequantize_params

    rules = rules or DEFAULT_RULES
    mesh = context_mesh(mesh)
    if mesh is None or axis_size(mesh, rules.data_axis) == 1:
        return dequantize_params(tree, dtype)

    def one(path, leaf):
        p = path_str(path)
        if is_nvfp4(leaf):
            ds, _, _ = _nvfp4_specs(p, leaf, mesh, rules)
            # Shard the dequantized values like the packed rows/columns, then gather them.
            local = jax.lax.with_sharding_constraint(leaf.dequantize(dtype), _named(mesh, ds))
            return _gather_as_bytes(local, _named(mesh, _without(ds, rules.data_axis)))
        out = gather({"x": leaf}, mesh, rules)["x"]
        if hasattr(out, "dtype") and jnp.issubdtype(out.dtype, jnp.floating):
            out = out.astype(dtype)
        return out

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_nvfp4)
