"""The per-layer parameter fetch of FSDP x tensor parallelism (inside ``shard_map``).

A training step passes each parameter to the model as a :class:`Shard` (this device's
stored shard and master shard, boxed the way Flax boxes partitioned params). The layer that
reads it (``self.param`` in Linen, ``variable[...]`` in NNX) calls :func:`gather_weight` right
there, inside the scan over layers: it all-gathers the layer's packed bytes and scale bytes (or
a plain weight's bits) over the data axes and dequantizes; its VJP reduce-scatters the weight
gradient straight into this device's master shard in a fixed order
(:func:`jax_nvfp4.collectives.ordered_reduce_scatter`), so no device ever holds more than one
layer's weights or full-size gradients. A weight split over the tensor axis is this rank's own
tile-major matrix (:meth:`jax_nvfp4.layout.Layout.local`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import meta
from jax.sharding import PartitionSpec as P

from jax_nvfp4.collectives import (GATHER_SCOPE, REDUCE_SCOPE, _levels, _size, all_gather_bits, all_gather_levels,
                                   ordered_mean, ordered_reduce_scatter, ordered_sum)
from jax_nvfp4.layout import Tiled, TiledNVFP4, is_tiled

__all__ = ["GatherConfig", "Shard", "gather_weight", "shard_tree"]


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
    ``tensor_gspmd``: the tensor axis when the ``shard_map`` leaves it to GSPMD (stock layers
    that compute with the logical weight): a weight split over it is fetched by a nested
    ``shard_map`` manual over that axis, each rank gathering its own sub-matrix.
    """

    axis: Any = "data"
    dtype: Any = jnp.bfloat16
    packed: bool = True
    nvfp4: bool = False
    replica_axis: Optional[str] = None
    tensor_axis: Optional[str] = None
    tensor_gspmd: Optional[str] = None

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
        return _in_dtype(stored, cfg.dtype), None
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
        return _in_dtype(stored, cfg.dtype), None


def _in_dtype(x, dtype):
    """A replicated leaf as the weights compute: a float one in ``dtype``; others (ids, flags) as they are."""
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


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


def _manual_specs(spec: P, keep) -> P:
    """``spec`` with only the mesh axes in ``keep`` (the others are GSPMD's)."""
    out = []
    for e in spec:
        if isinstance(e, tuple):
            e = tuple(a for a in e if a in keep) or None
        elif e is not None and e not in keep:
            e = None
        out.append(e)
    return P(*out)


def _fetch_tensor_split(stored, master, cfg: GatherConfig):
    """:func:`gather_weight` of a weight split over ``cfg.tensor_gspmd``, an axis the step's
    ``shard_map`` leaves to GSPMD: a nested ``shard_map`` manual over that axis gathers this
    rank's tile-major sub-matrix over the data axes only and returns it as its block of the
    logical weight (sharded over the tensor axis), so no byte of it crosses the tensor axis."""
    lay = stored.layout
    keep = {cfg.tensor_gspmd}
    local_cfg = dataclasses.replace(cfg, tensor_axis=cfg.tensor_gspmd, tensor_gspmd=None)
    nvfp4 = isinstance(stored, TiledNVFP4)  # else a plain (kept) weight, split the same way
    k = (stored.data if nvfp4 else stored.value).ndim - 4
    specs = stored.specs() if nvfp4 else Tiled(stored.spec(), lay)
    s_specs = jax.tree.map(lambda sp: _manual_specs(sp, keep), specs, is_leaf=lambda x: isinstance(x, P))
    out = [None] * (k + 2)
    out[lay.tensor_dim] = cfg.tensor_gspmd
    if master is None:
        return jax.shard_map(lambda s: gather_weight(s, None, local_cfg), in_specs=(s_specs,), out_specs=P(*out),
                             axis_names=keep, check_vma=False)(stored)
    m_specs = Tiled(_manual_specs(master.spec(), keep), master.layout)
    return jax.shard_map(lambda s, m: gather_weight(s, m, local_cfg), in_specs=(s_specs, m_specs), out_specs=P(*out),
                         axis_names=keep, check_vma=False)(stored, master)


class Shard(struct.PyTreeNode, meta.AxisMetadata):
    """A parameter as one device holds it inside the sharded step (:func:`jax_nvfp4.make_step`):
    ``stored`` (its shard of the stored param) and ``master`` (its shard of the float32 master,
    which receives the gradient; None in evaluation).

    It is a Flax boxed value (``flax.core.meta.AxisMetadata``, the hook ``nn.Partitioned``
    uses): a Linen module reading it with ``self.param`` (``nn.Dense``, ``nn.DenseGeneral``,
    ``nn.Einsum``, ``nn.Embed``, norms...) unboxes it, which gathers the weight right there,
    inside the user's scan or loop over blocks; an NNX variable holding it reads it with
    ``variable[...]``, ``.value`` (its ``.T``, ``.dtype``, ``.astype``...), ``.get_value()`` or its
    operators (``x @ variable``); ``jnp.dot(x, variable)`` is refused by JAX (a variable's array is this box).
    ``nn.scan`` / ``nnx.scan`` slice its leaves per layer. Every read
    gathers: a weight read twice is gathered twice and its gradient is the sum."""

    stored: Any
    master: Any
    config: GatherConfig = struct.field(pytree_node=False, default=GatherConfig())

    @property
    def is_nvfp4(self) -> bool:
        return isinstance(self.stored, TiledNVFP4)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The logical shape of the weight this device computes with."""
        s = self.stored
        if not is_tiled(s):
            return tuple(s.shape)
        lead = tuple((s.data if isinstance(s, TiledNVFP4) else s.value).shape[:-4])
        split = self.config.tensor_axis is not None and _split_over_tensor(s)
        return lead + tuple(s.layout.sub if split else s.layout.matrix)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        """The dtype the weight is read in: ``config.dtype`` (a replicated non-float leaf: its own)."""
        s = self.stored
        return jnp.dtype(self.config.dtype) if is_tiled(s) or jnp.issubdtype(s.dtype, jnp.floating) else s.dtype

    @property
    def T(self) -> jax.Array:
        return self.unbox().T

    def unbox(self) -> jax.Array:
        """The logical weight in ``config.dtype``, gathered here (its gradient goes to ``master``)."""
        if self.config.tensor_gspmd is not None and _split_over_tensor(self.stored):
            return _fetch_tensor_split(self.stored, self.master, self.config)
        return gather_weight(self.stored, self.master, self.config)

    def nvfp4(self):
        """``(NVFP4Array, sink)``: the gathered stored weight for the recipe GEMM and a float
        array that only carries the weight gradient (its values are never read)."""
        if self.config.tensor_gspmd is not None and _split_over_tensor(self.stored):
            raise NotImplementedError(
                "the recipe GEMM (nv.dot, nv.intercept_dense) of a kernel split over the tensor axis under "
                "tensor='gspmd' is not implemented: run the recipe on a data-only mesh, keep the split kernels out of "
                "it, or write the model for tensor='manual' (each rank's GEMM on its shard, combined with "
                "nv.TensorParallel)")
        return gather_weight(self.stored, self.master, dataclasses.replace(self.config, nvfp4=True))

    def __getitem__(self, index):
        # NNX: ``variable[...]`` indexes the variable's raw value, this box.
        return self.unbox()[index]

    def __setitem__(self, index, value):
        # NNX: a module writing one of its variables (nnx.BatchNorm's running statistics, a counter) in its call.
        raise TypeError("a leaf of the trained params is written inside the model (e.g. nnx.BatchNorm's running "
                        "statistics): the step trains params and returns no other state; split the model with "
                        "nnx.split(model, nnx.Param, ...) and keep state the model writes out of the params")

    def __jax_array__(self) -> jax.Array:
        # A model reading the box as an array (``x @ variable.value``, ``jnp.dot(x, variable.get_value())``).
        return self.unbox()

    def __len__(self) -> int:
        # NNX layers test an optional variable's truth (``if self.scale``), i.e. its length.
        return self.shape[0]

    def replace_boxed(self, val):
        return val

    def add_axis(self, index: int, params: dict) -> "Shard":
        return self

    def remove_axis(self, index: int, params: dict) -> "Shard":
        # A Linen transform over the params (nn.scan, nn.vmap with variable_axes) is about to slice
        # this box's leaves along ``index``: only a stacked layout has that axis first.
        if is_tiled(s := self.stored):
            stacked = (s.data if isinstance(s, TiledNVFP4) else s.value).ndim > 4
            if not stacked:
                raise ValueError(
                    f"a weight of shape {self.shape} is sliced by nn.scan or nn.vmap along its axis {index}, which its "
                    "layout does not stack: declare the transformed params stacked, e.g. "
                    "nv.Rules(stacked=('^blocks/',)) for the params under 'blocks', with the number of axes nested "
                    "transforms stack (('^blocks/', ('/experts/', 2)) for an nn.vmap inside an nn.scan)")
            if index != 0:
                raise ValueError(f"a weight of shape {self.shape} is sliced by nn.scan or nn.vmap along its axis "
                                 f"{index}, but stacked params stack their layers on axis 0: use variable_axes "
                                 "{'params': 0}")
        return self


def _gathered(name: str):
    def op(self, *args, **kwargs):
        return getattr(self.unbox(), name)(*args, **kwargs)
    op.__name__ = name
    return op


# NNX variables forward their operators to their value, this box (``x @ variable``, ``variable * 2``), and a model
# may call an array's methods on it (``variable.value.astype(...)``): each gathers the weight.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__matmul__", "__rmatmul__",
              "__truediv__", "__rtruediv__", "__pow__", "__neg__", "__pos__", "astype", "reshape", "transpose",
              "swapaxes"):
    setattr(Shard, _name, _gathered(_name))


def shard_tree(params, masters, config: GatherConfig):
    """The stored params tree with each leaf (and its master) boxed as a :class:`Shard`;
    ``masters=None`` for evaluation."""
    if masters is None:
        masters = jax.tree.map(lambda _: None, params, is_leaf=is_tiled)
    return jax.tree.map(lambda s, m: Shard(s, m, config), params, masters, is_leaf=is_tiled)
