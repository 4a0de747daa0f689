"""Where parameters live on a mesh, decided in one place: :class:`Rules` (the data, replica
and tensor axes and which paths they split) and :func:`layout_for`, the :class:`Layout` of each
leaf (params, masters and optimizer state all follow it)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence, Tuple, Union

from jax_nvfp4.layout import TILE, Layout


@dataclasses.dataclass(frozen=True)
class Rules:
    """How parameters are laid out on a mesh (sharding is data, decided here).

    Args:
      data_axis: the mesh axis (or tuple of axes, major first, e.g. ``("data", "rack")``)
        that shards storage: params, masters, optimizer state, gradients. A tuple is gathered
        and reduced one level per axis (:mod:`jax_nvfp4.collectives`): with the rack axis
        minor, weight gathers cross racks first on 1/I of the bytes and gradients are summed
        inside the rack first (I = devices per rack).
      replica_axis: a mesh axis the batch is split over but storage is replicated over
        (hybrid sharding, HSDP: e.g. racks, so weight gathers never leave a rack); gradients
        are averaged over it too. None: every batch axis shards storage (FSDP).
      tensor_axis: the mesh axis that splits weights for compute (absent from the mesh = off).
      tensor: ``(regex, dim)`` pairs: a matrix whose path matches is split over the tensor axis
        along ``dim`` (-1: columns, e.g. QKV and MLP-in kernels; -2: rows, e.g. attention-out
        and MLP-out kernels).
      stacked: regexes of paths whose first axis stacks layers (``nn.scan``, ``nn.vmap``): that
        axis is a batch axis, so a stacked ``[L, d]`` vector is a vector per layer, not a matrix.
        An entry ``(regex, n)`` stacks the first ``n`` axes, for transforms nested in each other:
        ``("^blocks/", ("/experts/", 2))`` makes the biases ``[L, E, d]`` of experts under an
        ``nn.vmap`` inside an ``nn.scan`` vectors. A path takes the most of the entries it matches.
      min_shard_size: plain (non-NVFP4) leaves with fewer elements than this, or fewer than two
        matrix axes, are replicated (norm scales, biases): their update needs no collective.
        A leaf a tensor rule splits is laid out and split whatever its size.
    """

    data_axis: object = "data"
    replica_axis: Optional[str] = None
    tensor_axis: Optional[str] = "tensor"
    tensor: Tuple[Tuple[str, int], ...] = ()
    stacked: Tuple[Union[str, Tuple[str, int]], ...] = ()
    min_shard_size: int = 1 << 14

    def __post_init__(self):
        for pat, dim in self.tensor:
            re.compile(pat)
            if dim not in (-1, -2):
                raise ValueError(f"tensor rule {pat!r}: dim must be -1 or -2, got {dim}")
        for entry in self.stacked:
            pat, n = (entry, 1) if isinstance(entry, str) else entry
            re.compile(pat)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"stacked entry {entry!r}: a regex, or (regex, n) with n >= 1 stacked axes")

    def tensor_dim(self, path: str) -> Optional[int]:
        for pat, dim in self.tensor:
            if re.search(pat, path):
                return dim
        return None

    def stacked_axes(self, path: str) -> int:
        """The leading axes of the leaf at ``path`` that stack layers: the most of the entries it matches."""
        entries = ((e, 1) if isinstance(e, str) else e for e in self.stacked)
        return max((n for pat, n in entries if re.search(pat, path)), default=0)

    @property
    def data_axes(self) -> Tuple[str, ...]:
        return tuple(self.data_axis) if isinstance(self.data_axis, (tuple, list)) else (self.data_axis,)

    @property
    def batch_axes(self) -> Tuple[str, ...]:
        """Every mesh axis the batch is split over: the replica axis (if any), then the data
        axes."""
        return (*((self.replica_axis,) if self.replica_axis else ()), *self.data_axes)


DEFAULT_RULES = Rules()


def batch_axes(mesh, rules: Rules) -> Tuple[str, ...]:
    """The mesh axes the batch rows are split over, in mesh order (each process's rows consecutive).
    Raises ValueError: the mesh has none of them."""
    axes = tuple(a for a in mesh.axis_names if a in rules.batch_axes)
    if not axes:
        raise ValueError(f"the mesh {dict(mesh.shape)} has none of the rules' batch axes {rules.batch_axes}: "
                         "nothing would be sharded (name the data axis in nv.Rules(data_axis=...))")
    return axes


def axis_size(mesh, name) -> int:
    """Size of mesh axis ``name`` (a tuple of axes: their product); 1 when absent."""
    if mesh is None or name is None:
        return 1
    if isinstance(name, (tuple, list)):
        return math.prod(axis_size(mesh, n) for n in name)
    return int(mesh.shape.get(name, 1)) if name in mesh.axis_names else 1


def layout_for(path: str, shape: Sequence[int], nvfp4: bool, mesh, rules: Rules = DEFAULT_RULES) -> Optional[Layout]:
    """The layout of the leaf at ``path``: a :class:`Layout` (tile-major, sharded over the
    data axis) for NVFP4 leaves and large plain leaves, None (replicated) for small ones.
    The one place that decides it: params, masters and optimizer state all follow."""
    shape = tuple(int(d) for d in shape)
    n_data = axis_size(mesh, rules.data_axis)
    n_tensor = axis_size(mesh, rules.tensor_axis)
    matrix = len(shape) - rules.stacked_axes(path) >= 2
    tdim = rules.tensor_dim(path) if n_tensor > 1 and matrix else None
    if tdim is not None and shape[tdim] % (TILE * n_tensor):
        if nvfp4:
            raise ValueError(
                f"{path}: axis {tdim} of shape {shape} is split over {n_tensor} tensor shards and must "
                f"be a multiple of {TILE} x {n_tensor} so that no 16x16 tile is cut")
        raise ValueError(
            f"{path}: axis {tdim} of shape {shape} is split over {n_tensor} tensor shards (a tensor rule "
            f"matches it) and must be a multiple of {TILE} x {n_tensor}")
    # A plain leaf split over the tensor axis is laid out like an NVFP4 one whatever its size
    # (every tensor rank computes with its own sub-matrix); other small plain leaves are
    # replicated.
    if not nvfp4 and tdim is None and (not matrix or math.prod(shape) < rules.min_shard_size):
        return None
    return Layout(shape[-2:], n_data, n_tensor if tdim is not None else 1, tdim, rules.data_axis,
                  rules.tensor_axis if tdim is not None else None)
