"""The one sharded layout of a parameter, its float32 master and its optimizer state.

Every large matrix ``[..., R, C]`` is stored **tile-major**: its 16x16 tiles in row-major tile
order, ``[..., nt, T, 16, 16]``, where ``nt`` is the number of tensor shards (1 when the
matrix is not split for tensor parallelism; each tensor shard's sub-matrix has its own tile
list) and ``T`` is the tile count rounded up to a multiple of the data-axis size ``N``. The
data axis shards ``T``: every device owns ``T / N`` whole tiles of every matrix, for ANY ``N``
and any shape, and the padding is at most ``N - 1`` zero tiles per matrix (8192x8192 on
N=144: 0.03%; rows rounded to 16 N would cost 12.5%).

The same layout serves every form of the matrix:

- :class:`TiledNVFP4`, a stored NVFP4 parameter: packed codes ``[..., nt, T, 16, 8] uint8``,
  the tiles' E4M3 scale bytes (``[..., nt, T] uint8`` with one scale per 16x16 tile,
  ``[..., nt, T, 16]`` with 1D blocks: one per tile column for ``(16, 1)``, per tile row for
  ``(1, 16)``), amax ``[...] uint32`` (float32 bits);
- :class:`Tiled`, a float array: the float32 master, each optimizer moment, a large plain
  (e.g. bf16) parameter, a gradient shard: ``[..., nt, T, 16, 16]``.

So a device re-quantizes exactly the tiles it stores (the re-quantized shard *is* the stored
shard: no relayout after the optimizer), all-gathers whole tiles, and receives exactly its
tiles' gradients. :class:`Layout` owns the padding and the logical view; nothing else derives
them. Which leaves get a layout, split over which axes, is :mod:`jax_nvfp4.rules`; small
leaves (norm scales, biases) are replicated and keep their logical shape.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import (BLOCK_2D, NVFP4Array, _check_block, _concrete, _replicated, as_array, flat_index,
                             quantize_padded)

TILE = 16


def _ceil_div(n: int, m: int) -> int:
    return -(-n // m)


def _xp(x):
    """The array namespace of ``x``: NumPy for host arrays, jax.numpy for everything else."""
    return np if isinstance(x, np.ndarray) else jnp


def _relayout(method):
    """A :class:`Layout` relayout (reshapes, pads, transposes, slices), run where its input is:
    a NumPy array stays on the host in NumPy (a checkpoint's or an export's host copy compiles
    nothing); a traced one is inlined into the caller's program; a concrete ``jax.Array`` runs
    it as one compiled program per shape (op by op, each of its ops would compile its own).
    An input sharded over an Explicit mesh axis (a stored leaf's tiles over the data axis) is
    replicated first (:func:`~jax_nvfp4.array._replicated`), and so is the result."""
    self_name, _array, *rest = inspect.signature(method).parameters
    static = (self_name, *rest)

    @functools.wraps(method)  # jit reads the static arguments' names from its signature
    def replicated(self, x, *args, **kwargs):
        return method(self, _replicated(x), *args, **kwargs)

    program = jax.jit(replicated, static_argnames=static)

    @functools.wraps(method)
    def run(self, x, *args, **kwargs):
        if _concrete(x) and not isinstance(x, np.ndarray):
            return program(self, x, *args, **kwargs)
        return replicated(self, x, *args, **kwargs)

    return run


def tile_scales(block) -> Tuple[int, int]:
    """``(rows, cols)`` of the block scales inside one 16x16 tile: (1, 1) for 2D tiles,
    (1, 16) for ``(16, 1)`` blocks, (16, 1) for ``(1, 16)``."""
    br, bc = _check_block(block)
    return TILE // br, TILE // bc


def packed_gather_ratio(block=BLOCK_2D) -> float:
    """Bytes of a packed 16x16 tile (128 code bytes + its E4M3 scale bytes) per byte of the
    same tile in bf16 (512): the floor of an NVFP4 weight gather against a bf16 one.
    ``(0.5 + 1/256) / 2 = 0.2520`` with 2D tiles, ``(0.5 + 1/16) / 2 = 0.2812`` with 1D blocks."""
    return (TILE * TILE / 2 + math.prod(tile_scales(block))) / (2 * TILE * TILE)


def packed_gather_text(block=BLOCK_2D) -> str:
    """:func:`packed_gather_ratio` in words, e.g. ``"16x16 tiles: 4-bit codes + 1 scale byte
    per 256 values = 129/512 = 0.25195"``."""
    n = math.prod(tile_scales(block))
    what = {BLOCK_2D: "16x16 tiles", (16, 1): "1d blocks of 16 rows", (1, 16): "1d blocks of 16 columns"}[_check_block(block)]
    return (f"{what}: 4-bit codes + {n} scale byte{'s' if n > 1 else ''} per 256 values = "
            f"{TILE * TILE // 2 + n}/512 = {packed_gather_ratio(block):.5f}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Tile-major layout of one matrix ``[rows, cols]`` (leading batch axes are free).

    ``n_data`` data shards split the (padded) tile list; ``n_tensor`` tensor shards split the
    matrix along ``tensor_dim`` (-1 columns, -2 rows; None when ``n_tensor == 1``), each shard
    holding whole tiles. Static (hashable): it travels as pytree metadata.
    """

    matrix: Tuple[int, int]
    n_data: int = 1
    n_tensor: int = 1
    tensor_dim: Optional[int] = None
    data_axis: object = "data"
    tensor_axis: Optional[str] = None

    def __post_init__(self):
        r, c = self.matrix
        if r < 1 or c < 1:
            raise ValueError(f"Layout: empty matrix {self.matrix}")
        if self.n_tensor > 1:
            if self.tensor_dim not in (-1, -2):
                raise ValueError("Layout: a tensor split needs tensor_dim -1 or -2")
            if self.matrix[self.tensor_dim] % (TILE * self.n_tensor):
                raise ValueError(
                    f"Layout: axis {self.tensor_dim} of {self.matrix} is split over {self.n_tensor} tensor "
                    f"shards and must be a multiple of {TILE} x {self.n_tensor} so that no 16x16 tile is cut")

    # -- sizes
    @property
    def sub(self) -> Tuple[int, int]:
        """The ``(rows, cols)`` of one tensor shard's sub-matrix."""
        r, c = self.matrix
        if self.tensor_dim == -2:
            return r // self.n_tensor, c
        if self.tensor_dim == -1:
            return r, c // self.n_tensor
        return r, c

    def local(self) -> "Layout":
        """The layout of ONE tensor shard as a device holds it inside a ``shard_map`` that is
        manual over the tensor axis: its sub-matrix, with the same tile list (same grid, same
        data-axis padding), not split any further. ``self`` when the matrix is not split."""
        if self.n_tensor == 1:
            return self
        return dataclasses.replace(self, matrix=self.sub, n_tensor=1, tensor_dim=None, tensor_axis=None)

    @property
    def grid(self) -> Tuple[int, int]:
        """Tiles per sub-matrix along rows and columns."""
        return _ceil_div(self.sub[0], TILE), _ceil_div(self.sub[1], TILE)

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def padded_tiles(self) -> int:
        """``T``: tiles per tensor shard, rounded up to a multiple of ``n_data``."""
        return _ceil_div(self.tiles, self.n_data) * self.n_data

    @property
    def local_tiles(self) -> int:
        return self.padded_tiles // self.n_data

    def shape(self, batch: Sequence[int] = (), tile: Sequence[int] = (TILE, TILE)) -> Tuple[int, ...]:
        """Global shape of a tiled array: ``[*batch, nt, T, *tile]``."""
        return (*batch, self.n_tensor, self.padded_tiles, *tile)

    def spec(self, batch_ndim: int, trailing: int = 2) -> P:
        """PartitionSpec of a tiled array with ``batch_ndim`` batch axes and ``trailing``
        axes after the tile axis (2 for values and codes, 0 or 1 for scales)."""
        t = self.tensor_axis if self.n_tensor > 1 else None
        d = self.data_axis if self.n_data > 1 else None
        return P(*([None] * batch_ndim), t, d, *([None] * trailing))

    def padding(self) -> float:
        """Fraction of stored elements that are padding."""
        r, c = self.matrix
        return 1.0 - r * c / (self.n_tensor * self.padded_tiles * TILE * TILE)

    def holds(self, shape: Sequence[int]) -> jax.Array:
        """bool ``shape`` (a whole tiled array, ``[..., nt, T, 16, 16]``): True where an element
        of the matrix is stored, False on padding."""
        nd = len(shape)
        t = jax.lax.broadcasted_iota(jnp.int32, shape, nd - 3)
        row = (t // self.grid[1]) * TILE + jax.lax.broadcasted_iota(jnp.int32, shape, nd - 2)
        col = (t % self.grid[1]) * TILE + jax.lax.broadcasted_iota(jnp.int32, shape, nd - 1)
        return (row < self.sub[0]) & (col < self.sub[1])

    # -- logical <-> tiles
    def _split(self, x: jax.Array) -> jax.Array:
        """``[..., R, C]`` -> ``[..., nt, R / nt, C]`` or ``[..., nt, R, C / nt]``: the tensor
        shards' sub-matrices (``nt = 1``: a new axis)."""
        *batch, r, c = x.shape
        nt, k = self.n_tensor, len(batch)
        if self.tensor_dim == -1:
            return _xp(x).moveaxis(x.reshape(*batch, r, nt, c // nt), k + 1, k)
        if self.tensor_dim == -2:
            return x.reshape(*batch, nt, r // nt, c)
        return x[..., None, :, :]

    @_relayout
    def to_tiles(self, x: jax.Array, width: int = TILE, height: int = TILE) -> jax.Array:
        """``[..., rows', cols']`` -> ``[..., nt, T, height, width]``, zero-padded: each tile's
        ``height x width`` entries. 16 x 16 for values; 16 x 8 for packed codes (``cols'`` =
        bytes per row); the tile's scales for block scales (:meth:`scales_to_tiles`). A NumPy
        array stays one (host-side relayouts compile nothing)."""
        *batch, _, _ = x.shape
        nt, k, xp = self.n_tensor, len(batch), _xp(x)
        x = self._split(x)
        gr, gc = self.grid
        x = xp.pad(x, [(0, 0)] * (k + 1) + [(0, gr * height - x.shape[-2]), (0, gc * width - x.shape[-1])])
        x = x.reshape(*batch, nt, gr, height, gc, width)
        x = xp.swapaxes(x, -3, -2).reshape(*batch, nt, gr * gc, height, width)
        if self.padded_tiles != self.tiles:
            x = xp.pad(x, [(0, 0)] * (k + 1) + [(0, self.padded_tiles - self.tiles), (0, 0), (0, 0)])
        return x

    @_relayout
    def from_tiles(self, t: jax.Array, cols: Optional[int] = None) -> jax.Array:
        """``[..., nt, T, height, width]`` -> ``[..., rows, cols]`` (the inverse of
        :meth:`to_tiles`; rows and ``cols`` default to the logical ones scaled by
        ``height/16`` and ``width/16``). A NumPy array stays one."""
        *batch, nt, _, height, width = t.shape
        k = len(batch)
        gr, gc = self.grid
        sr, sc = self.sub
        sr_x, sc_x = _ceil_div(sr * height, TILE), _ceil_div(sc * width, TILE)
        xp = _xp(t)
        t = t[..., : self.tiles, :, :].reshape(*batch, nt, gr, gc, height, width)
        x = xp.swapaxes(t, -3, -2).reshape(*batch, nt, gr * height, gc * width)[..., :sr_x, :sc_x]
        if self.tensor_dim == -1:
            x = xp.moveaxis(x, k, k + 1).reshape(*batch, sr_x, nt * sc_x)
        elif self.tensor_dim == -2:
            x = x.reshape(*batch, nt * sr_x, sc_x)
        else:
            x = x[..., 0, :, :]
        if cols is not None:
            x = x[..., :cols]
        return x

    @_relayout
    def scales_to_tiles(self, s: jax.Array, block=BLOCK_2D) -> jax.Array:
        """Compact block scales ``[..., ceil(R/br), ceil(C/bc)]`` -> ``[..., nt, T]`` (2D tiles)
        or ``[..., nt, T, 16]`` (1D blocks: the tile's 16 scales)."""
        h, w = tile_scales(block)
        t = self.to_tiles(s, width=w, height=h)
        return t.reshape(*t.shape[:-2], h * w) if h * w > 1 else t[..., 0, 0]

    @_relayout
    def scales_from_tiles(self, s: jax.Array, block=BLOCK_2D) -> jax.Array:
        """The tiles' scales (:meth:`scales_to_tiles`) -> compact ``[..., ceil(R/br), ceil(C/bc)]``."""
        h, w = tile_scales(block)
        t = s.reshape(*s.shape[:-1], h, w) if h * w > 1 else s[..., None, None]
        return self.from_tiles(t)

    def positions(self, shape: Sequence[int], tensor_index=0, tile_offset=0):
        """``(row, col)`` uint32 logical positions of every element of a tiled block of
        ``shape`` ``[..., nt_local, T_local, 16, 16]`` whose first tensor shard is
        ``tensor_index`` and first tile ``tile_offset`` (both may be traced)."""
        nd = len(shape)
        u = lambda v: jnp.asarray(v).astype(jnp.uint32)
        ti = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 4) + u(tensor_index)
        t = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 3) + u(tile_offset)
        i = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 2)
        j = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 1)
        gc = np.uint32(self.grid[1])
        row = (t // gc) * np.uint32(TILE) + i
        col = (t % gc) * np.uint32(TILE) + j
        sr, sc = self.sub
        if self.tensor_dim == -2:
            row = row + ti * np.uint32(sr)
        elif self.tensor_dim == -1:
            col = col + ti * np.uint32(sc)
        return row, col


# ----------------------------------------------------------------------------- the arrays
@dataclasses.dataclass(frozen=True)
class Tiled:
    """A float array in a :class:`Layout`: ``value [..., nt, T, 16, 16]`` (a pytree node with
    one leaf, so optax transforms treat it like any array; the zero padding gets zero
    gradients and stays zero under element-wise optimizers)."""

    value: jax.Array
    layout: Layout = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_logical(cls, x, layout: Layout, dtype=None) -> "Tiled":
        x = as_array(x)
        return cls(layout.to_tiles(x if dtype is None else x.astype(dtype)), layout)

    def logical(self) -> jax.Array:
        """The ``[..., rows, cols]`` array."""
        return self.layout.from_tiles(self.value)

    def zero_padding(self) -> "Tiled":
        """``self`` with its padding set to zero (an optimizer may have moved it: noise, a
        transform that is not element-wise), as quantizing the logical matrix assumes."""
        if self.layout.padding() == 0:
            return self
        return Tiled(jnp.where(self.layout.holds(self.value.shape), self.value, 0).astype(self.value.dtype),
                     self.layout)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The logical shape."""
        return tuple(self.value.shape[:-4]) + tuple(self.layout.matrix)

    @property
    def dtype(self):
        return self.value.dtype

    def spec(self):
        """The value's PartitionSpec; replicated for what an optimizer keeps per matrix inside the
        node (a scalar statistic, or an empty node such as optax's ``MaskedNode``)."""
        if getattr(self.value, "ndim", 0) >= 4:
            return self.layout.spec(self.value.ndim - 4)
        return jax.tree.map(lambda _: P(), self.value)

    def __repr__(self) -> str:
        if not hasattr(self.value, "shape"):  # a tree of specs or shardings
            return f"Tiled({self.value!r}, layout={self.layout})"
        return f"Tiled(shape={self.shape}, dtype={self.value.dtype}, layout={self.layout})"


jax.tree_util.register_dataclass(Tiled, data_fields=["value"], meta_fields=["layout"])


@dataclasses.dataclass(frozen=True)
class TiledNVFP4:
    """A stored NVFP4 parameter in a :class:`Layout`: ``data [..., nt, T, 16, 8] uint8``
    (element 2k of a tile row in the low nibble), ``scale_bits`` (E4M3 bytes: ``[..., nt, T]``
    for 2D tiles, ``[..., nt, T, 16]`` for 1D blocks, see :func:`tile_scales`), ``amax_bits
    [...] uint32`` (float32 global amax of each matrix). ``block`` (static): the NVFP4 block,
    ``(16, 16)`` or a 1D one; the 16x16 tiles (and so the sharding) are the same for all."""

    data: jax.Array
    scale_bits: jax.Array
    amax_bits: jax.Array
    layout: Layout = dataclasses.field(metadata=dict(static=True))
    block: Tuple[int, int] = dataclasses.field(default=BLOCK_2D, metadata=dict(static=True))

    @classmethod
    def from_array(cls, q: NVFP4Array, layout: Layout) -> "TiledNVFP4":
        """Re-lay an :class:`NVFP4Array` out tile-major (a byte shuffle)."""
        if tuple(q.matrix_shape) != tuple(layout.matrix):
            raise ValueError(f"NVFP4Array of matrix shape {q.matrix_shape} for a layout of {layout.matrix}")
        return cls(layout.to_tiles(q.data, TILE // 2), layout.scales_to_tiles(q.scale_bits, q.block), q.amax_bits,
                   layout, q.block)

    def to_array(self) -> NVFP4Array:
        """The logical :class:`NVFP4Array` (a byte shuffle)."""
        r, c = self.layout.matrix
        data = self.layout.from_tiles(self.data, _ceil_div(c, 2))
        return NVFP4Array(data, self.layout.scales_from_tiles(self.scale_bits, self.block), self.amax_bits, (r, c),
                          self.block)

    def replace(self, data, scale_bits) -> "TiledNVFP4":
        """The same parameter with other code and scale leaves (e.g. gathered ones)."""
        return TiledNVFP4(data, scale_bits, self.amax_bits, self.layout, self.block)

    def dequantize_tiles(self, dtype=jnp.bfloat16) -> jax.Array:
        """``[..., nt, T, 16, 16]`` values, element for element what
        :func:`jax_nvfp4.dequantize` gives (``(e2m1 * scale) * D``, NaN for a non-finite amax)."""
        vals = nx.decode_e2m1(nx.unpack_codes(self.data))
        scale = jax.lax.bitcast_convert_type(self.scale_bits, jnp.float8_e4m3fn).astype(jnp.float32)
        dec = nx.global_decode_scale(jax.lax.bitcast_convert_type(self.amax_bits, jnp.float32))
        (br, bc), (h, w) = self.block, tile_scales(self.block)
        lead = vals.shape[:-2]
        vals = vals.reshape(*lead, h, br, w, bc)
        scale = scale.reshape(*lead, h, 1, w, 1)
        out = (vals * scale) * dec[..., None, None, None, None, None, None]
        return out.reshape(*lead, TILE, TILE).astype(dtype)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        """The logical ``[..., rows, cols]`` weight."""
        return self.layout.from_tiles(self.dequantize_tiles(dtype))

    @property
    def amax(self) -> jax.Array:
        return jax.lax.bitcast_convert_type(self.amax_bits, jnp.float32)

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape[:-4]) + tuple(self.layout.matrix)

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.data.shape) + math.prod(self.scale_bits.shape) + 4 * math.prod(jnp.shape(self.amax_bits)))

    def specs(self) -> "TiledNVFP4":
        """PartitionSpecs of the three leaves (amax replicated)."""
        k = self.data.ndim - 4
        return TiledNVFP4(self.layout.spec(k), self.layout.spec(k, self.scale_bits.ndim - k - 2), P(), self.layout,
                          self.block)

    def isfinite(self) -> jax.Array:
        return jnp.isfinite(self.amax)

    def __repr__(self) -> str:
        if not hasattr(self.data, "shape"):  # a tree of specs or shardings
            return (f"TiledNVFP4({self.data!r}, {self.scale_bits!r}, {self.amax_bits!r}, layout={self.layout}, "
                    f"block={self.block})")
        return f"TiledNVFP4(shape={self.shape}, block={self.block}, layout={self.layout})"


jax.tree_util.register_dataclass(TiledNVFP4, data_fields=["data", "scale_bits", "amax_bits"],
                                 meta_fields=["layout", "block"])


def is_tiled(x) -> bool:
    return isinstance(x, (Tiled, TiledNVFP4))


def quantize_tiles(x: jax.Array, layout: Layout, *, block=BLOCK_2D, key=None, reduce_amax=None, tensor_index=0,
                   tile_offset=0, amax=None, four_over_six=False) -> TiledNVFP4:
    """Quantize float32 tiles ``[..., nt, T, 16, 16]`` (a whole tiled matrix, or one device's
    shard of it) to NVFP4 with ``block`` scales (every block lies inside one tile).

    ``reduce_amax`` combines the local amax bits with the other shards' (an integer ``pmax``),
    so the result is bit-identical to quantizing the whole logical matrix; ``amax`` (``[...]``
    float32, the global amax of each matrix) is used as it is instead. With ``key``,
    stochastic rounding draws by each element's logical position (``tensor_index`` /
    ``tile_offset`` place a shard), the same draws as :func:`jax_nvfp4.quantize`.
    ``four_over_six`` as :func:`jax_nvfp4.quantize`'s (every block lies in one shard).
    """
    *batch, nt, tl, _, _ = x.shape
    # The tiles as one [..., nt*tl*16, 16] column of tiles: the same numeric core as
    # jax_nvfp4.quantize, and the same amax (over every tile of each matrix).
    flat = x.astype(jnp.float32).reshape(*batch, nt * tl * TILE, TILE)
    block = _check_block(block)
    uniform = None
    if key is not None:
        row, col = layout.positions(x.shape, tensor_index, tile_offset)
        uniform = nx.uniform_from_index(key, flat_index(row, col, layout.matrix, len(batch)).reshape(flat.shape))
    codes, scale, amax = quantize_padded(flat, block, uniform=uniform, amax=amax,
                                         reduce_amax=None if amax is not None else reduce_amax,
                                         four_over_six=four_over_six)
    per_tile = math.prod(tile_scales(block))
    return TiledNVFP4(nx.pack_codes(codes.reshape(x.shape)),
                      jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(*batch, nt, tl, *((per_tile,) if per_tile > 1 else ())),
                      jax.lax.bitcast_convert_type(amax, jnp.uint32), layout, block)
