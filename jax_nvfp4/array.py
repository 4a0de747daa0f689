"""The packed ``NVFP4Array`` pytree and ``quantize`` / ``dequantize``.

Layout of one matrix ``[rows, cols]`` (axes before the last two are batch axes, one matrix
each, each with its own amax):

- ``data``  ``[..., rows, ceil(cols/2)] uint8``: element ``2k`` in the low nibble.
- ``scale`` ``[..., ceil(rows/16), ceil(cols/16)] float8_e4m3fn`` for 2D tiles ``(16, 16)``,
  ``[..., rows, ceil(cols/16)]`` for 1D blocks along a row ``(1, 16)``, ``[..., ceil(rows/16),
  cols]`` for 1D blocks down a column ``(16, 1)``; compact, row-major. Stored as its bytes
  (``scale_bits``, uint8) and read as E4M3 through ``.scale``.

The three blocks: ``(16, 16)`` is the recipe's weight tile (a weight and its transpose share
codes and scales, as the FP4 GEMMs of the backward pass need); ``(1, 16)`` its activation and
gradient block; ``(16, 1)`` is the recipe's 1D weight quantization written for an ``[in, out]``
kernel: 16 consecutive inputs of one output share a scale, which is a ``(1, 16)`` block of the
``[out, in]`` weight of PyTorch, Transformer Engine and compressed-tensors. It is the transpose
of ``(1, 16)`` (``transpose`` maps one to the other without re-quantizing).
- ``amax``  ``[...] float32``: the global amax of each matrix, stored as its bit pattern
  (``amax_bits``, uint32); read it through ``.amax``.

Every leaf is thus an unsigned integer: an optimizer update to a re-quantized weight is an
exact wrap-around delta (see ``jax_nvfp4.optim``), and collectives move plain bytes (some
backends widen float8 collectives to float16).

Shapes that are not multiples of the block are zero-padded for quantization; zeros change
neither the amax nor a block scale, and the logical shape is kept.

Non-finite input: a matrix holding NaN or +-Inf gets a non-finite ``amax`` (NaN for NaN,
+Inf otherwise); :func:`dequantize` then returns NaN for every element of that matrix, so a
poisoned tensor never passes for a valid weight. ``q.isfinite()`` is the cheap check (one
float per matrix).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import numerics as nx

BLOCK_2D = (16, 16)
BLOCK_1D = (1, 16)
BLOCK_COLUMN = (16, 1)
_BLOCKS = (BLOCK_2D, BLOCK_1D, BLOCK_COLUMN)
_BLOCK_NAMES = "(16, 16), (1, 16) or (16, 1)"
# The block of the transpose: the same codes and scales, transposed.
_TRANSPOSED = {BLOCK_2D: BLOCK_2D, BLOCK_1D: BLOCK_COLUMN, BLOCK_COLUMN: BLOCK_1D}


def as_array(x) -> jax.Array:
    """``x`` as a JAX array. A NumPy array is transferred as it is: ``jnp.asarray`` of one
    stages it through a small compiled program, one per shape and dtype (tens of ms each)."""
    if isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray):
        return jax.device_put(x)
    return jnp.asarray(x)


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_block(block) -> Tuple[int, int]:
    # Integers only: int(16.9) would silently quantize with a block the caller did not ask for.
    try:
        items = tuple(block)
    except TypeError:
        raise ValueError(f"block must be {_BLOCK_NAMES}, got {block!r}") from None
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_)) for b in items):
        raise ValueError(f"block must be {_BLOCK_NAMES} (integers), got {block!r}")
    block = tuple(int(b) for b in items)
    if block not in _BLOCKS:
        raise ValueError(f"block must be {_BLOCK_NAMES}, got {block}")
    return block


def _concrete(x) -> bool:
    """True for a host or device array (a NumPy scalar included) with a known value (not a tracer, not abstract)."""
    return isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def explicit_sharding(x):
    """The sharding ``x``'s type names where it shards a dimension over an Explicit mesh axis
    (under ``jit`` too: the type carries its mesh), else None."""
    if isinstance(x, np.ndarray) or not isinstance(x, jax.Array):
        return None
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding if sharding is not None and any(e is not None for e in sharding.spec) else None


def _where_it_lives(fn, x, shapes, assemble):
    """``fn`` run where ``x`` lives: ``fn`` itself, or, if ``x`` is split over Explicit mesh axes,
    ``fn`` under ``jax.sharding.auto_axes`` with outputs of ``shapes`` split as ``x`` splits the
    dimension each comes from (the same place counted from the first; a dimension whose size
    does not divide evenly over those axes whole); ``assemble`` builds the output tree from
    their shardings. Quantizing reshapes into blocks, which Explicit sharding types express only
    for reshapes that split one axis: the compiler places the work instead, as on Auto axes,
    and a split weight stays split (no device gathers it whole)."""
    sharding = explicit_sharding(x)
    if sharding is None:
        return fn
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))

    def split(shape):
        def keep(entry, size):
            axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
            return entry if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else None
        return jax.sharding.NamedSharding(mesh, P(*map(keep, spec, shape)))
    out = assemble(*map(split, shapes))
    return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out)


def _replicated(x):
    """``x``, replicated if its type shards it over an Explicit mesh axis: a tile relayout
    reshapes it, which explicit sharding types express only for reshapes that split one axis
    (JAX refuses the others, even with the sharded axis kept)."""
    sharding = explicit_sharding(x)
    return x if sharding is None else jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, P()))


def _check_amax(amax, batch) -> jax.Array:
    """``amax`` as given, once validated: a float scalar or a ``[*batch]`` float array; values checked where known.

    Positive finite values are amaxes; NaN and +Inf mark a poisoned matrix by design (it
    decodes to NaN, see the module docstring); 0 is the amax of an all-zero matrix. Negative
    values and -Inf are refused: they would dequantize to plausible but wrong weights.
    """
    dtype = getattr(amax, "dtype", None)
    if dtype is None:
        if isinstance(amax, bool) or not isinstance(amax, (int, float, np.integer, np.floating)):
            raise TypeError(f"quantize: amax must be a float or a float array, got {type(amax).__name__}")
    elif not (jnp.issubdtype(dtype, jnp.floating) or (jnp.issubdtype(dtype, jnp.integer) and np.ndim(amax) == 0)):
        raise TypeError(f"quantize: amax must be a float array, got dtype {dtype}")
    shape = tuple(np.shape(amax))
    if shape not in ((), tuple(batch)):
        raise ValueError(f"quantize: amax has shape {shape}; expected () or the batch shape {tuple(batch)} "
                         "(one amax per matrix)")
    if dtype is None or _concrete(amax):
        v = np.asarray(amax, np.float32)
        bad = v[(v < 0) | np.isneginf(v)]
        if bad.size:
            raise ValueError(f"quantize: amax must be >= 0 (NaN or +Inf mark a non-finite matrix), got {bad.flat[0]}")
    return amax


def packed_shapes(shape, block=BLOCK_2D):
    """``(data_shape, scale_shape, amax_shape)`` of the NVFP4 storage of a logical ``shape``."""
    block = _check_block(block)
    if len(shape) < 2:
        raise ValueError(f"NVFP4 needs at least 2 axes [..., rows, cols], got shape {tuple(shape)}")
    *batch, rows, cols = (int(d) for d in shape)
    data = (*batch, rows, _ceil_to(cols, 2) // 2)
    scale = (*batch, _ceil_to(rows, block[0]) // block[0], _ceil_to(cols, block[1]) // block[1])
    return data, scale, tuple(batch)


def _check_matrix_shape(matrix_shape) -> Tuple[int, int]:
    ms = tuple(matrix_shape)
    if len(ms) != 2 or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in ms):
        raise ValueError(f"NVFP4Array: matrix_shape must be two positive ints (rows, cols), got {matrix_shape!r}")
    return tuple(int(d) for d in ms)


_LEAF_DTYPES = (("data", "packed uint8 codes", np.uint8), ("scale_bits", "uint8 E4M3 scale bytes", np.uint8),
                ("amax_bits", "the uint32 bits of a float32 amax", np.uint32))


def _check_dtypes(leaves) -> None:
    """Raise TypeError unless ``data``, ``scale_bits`` and ``amax_bits`` have their dtypes: any
    other integer would be decoded as if it were these bytes. (A tree of float0 leaves is the
    cotangent of an array, not an array: left alone.)"""
    if any(np.dtype(leaf.dtype) == jax.dtypes.float0 for leaf in leaves):
        return
    for (name, what, dtype), leaf in zip(_LEAF_DTYPES, leaves):
        if np.dtype(leaf.dtype) != dtype:
            raise TypeError(f"NVFP4Array: {name} must be {what} ({np.dtype(dtype).name}), got dtype {leaf.dtype}")


def check_values(data, scale_bits, amax_bits) -> None:
    """Raise ValueError where concrete NVFP4 leaves hold what no quantization writes and a reader would decode
    as plausible but wrong weights: a negative amax (or -Inf), an amax of 0 over non-zero codes, or, in a matrix
    with a finite amax, a scale byte that is negative (sign bit set) or NaN (0x7F / 0xFF). A NaN or +Inf amax
    marks a poisoned matrix by design (its scales may be NaN); NumPy inputs are checked in NumPy."""
    xp = np if all(isinstance(x, np.ndarray) for x in (data, scale_bits, amax_bits)) else jnp
    amax = xp.asarray(amax_bits).astype(np.uint32).view(np.float32) if xp is np else \
        jax.lax.bitcast_convert_type(jnp.asarray(amax_bits), jnp.float32)
    if bool(xp.any(amax < 0)):
        raise ValueError("NVFP4Array: a negative amax would decode to sign-flipped weights")
    codes = xp.asarray(data) & 0x77  # both nibbles' magnitudes: a code of -0 is zero
    if bool(xp.any((amax == 0) & xp.any(codes != 0, axis=(-2, -1)))):
        raise ValueError("NVFP4Array: amax 0 over non-zero codes would decode them to zeros")
    scale = xp.asarray(scale_bits)
    bad = xp.any(((scale & 0x80) != 0) | ((scale & 0x7F) == 0x7F), axis=(-2, -1))
    if bool(xp.any(bad & xp.isfinite(amax))):
        raise ValueError("NVFP4Array: a scale byte of a matrix with a finite amax is negative or NaN (E4M3 0x80.. / "
                         "0x7F), which no quantization writes")


def _check_layout(data, scale_bits, amax_bits, matrix_shape, block) -> None:
    """Raise ValueError unless the three leaves have the shapes of ``matrix_shape``/``block``."""
    if len(np.shape(data)) < 2:
        raise ValueError(f"NVFP4Array: data must be [..., rows, cols/2], got shape {tuple(np.shape(data))}")
    batch = tuple(np.shape(data))[:-2]
    want = packed_shapes(batch + tuple(matrix_shape), block)
    got = (tuple(np.shape(data)), tuple(np.shape(scale_bits)), tuple(np.shape(amax_bits)))
    for what, g, w in zip(("data", "scale", "amax"), got, want):
        if g != tuple(w):
            raise ValueError(f"NVFP4Array: {what} has shape {g}, but matrix_shape {tuple(matrix_shape)} with block "
                             f"{tuple(block)} and batch {batch} needs {tuple(w)}")


@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """A tensor stored in NVFP4: packed E2M1 codes, E4M3 block scales, float32 global amax.

    A registered pytree: ``data``, ``scale_bits`` and ``amax_bits`` are its leaves;
    ``matrix_shape`` (the logical ``(rows, cols)`` of each matrix) and ``block`` are static.
    The batch axes are read from ``data``, so the array stays consistent under ``vmap`` and
    ``tree_map``. Build one with :func:`quantize` or :meth:`NVFP4Array.create`.
    """

    data: jax.Array
    scale_bits: jax.Array
    amax_bits: jax.Array
    matrix_shape: Tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    block: Tuple[int, int] = dataclasses.field(default=BLOCK_2D, metadata=dict(static=True))

    def __post_init__(self):
        # Arrays built by hand must fit together: a wrong scale shape would otherwise be
        # broadcast or zero-filled silently. Tracers and abstract leaves (inside jit,
        # shard_map, tree utilities) are not checked here; create() checks those too.
        _check_matrix_shape(self.matrix_shape)
        if all(_concrete(x) for x in (self.data, self.scale_bits, self.amax_bits)):
            _check_dtypes((self.data, self.scale_bits, self.amax_bits))
            _check_layout(self.data, self.scale_bits, self.amax_bits, self.matrix_shape, self.block)

    @classmethod
    def create(cls, data, scale, amax, matrix_shape, block=BLOCK_2D) -> "NVFP4Array":
        """From packed data ``uint8``, E4M3 scales (or their bytes) and a float32 amax.

        Raises:
          ValueError / TypeError: shapes or dtypes that do not form an NVFP4 array of
            ``matrix_shape`` with ``block`` (see :func:`packed_shapes`); where the values are
            known, values no quantization writes (:func:`check_values`: a negative amax, negative
            or NaN scales).
        """
        block = _check_block(block)
        data, scale = as_array(data), as_array(scale)
        if data.dtype != jnp.uint8:
            raise TypeError(f"NVFP4Array.create: data must be packed uint8 codes, got dtype {data.dtype}")
        amax = as_array(amax)
        if not jnp.issubdtype(amax.dtype, jnp.floating):
            raise TypeError(f"NVFP4Array.create: amax must be float32, got dtype {amax.dtype}")
        bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
        if jnp.issubdtype(scale.dtype, jnp.integer) and scale.dtype != jnp.uint8:
            raise TypeError(f"NVFP4Array.create: scale must be E4M3 values (a float dtype) or their bytes (uint8), "
                            f"got dtype {scale.dtype}")
        if scale.dtype != jnp.uint8:
            scale = jax.lax.bitcast_convert_type(scale.astype(jnp.float8_e4m3fn), jnp.uint8)
        matrix_shape = _check_matrix_shape(matrix_shape)
        _check_layout(data, scale, bits, matrix_shape, block)
        if all(_concrete(x) for x in (data, scale, bits)):
            check_values(data, scale, bits)
        return cls(data, scale, bits, matrix_shape, block)

    @property
    def scale(self) -> jax.Array:
        """Block scales as ``float8_e4m3fn``."""
        return jax.lax.bitcast_convert_type(self.scale_bits, jnp.float8_e4m3fn)

    @property
    def amax(self) -> jax.Array:
        """``[...] float32`` global amax of each matrix."""
        return jax.lax.bitcast_convert_type(self.amax_bits, jnp.float32)

    # -- shape information ---------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, ...]:
        """The logical shape ``[..., rows, cols]``."""
        return tuple(self.data.shape[:-2]) + tuple(self.matrix_shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of storage: packed data + one byte per scale + 4 bytes per amax."""
        return int(
            math.prod(self.data.shape) + math.prod(self.scale_bits.shape) + 4 * math.prod(jnp.shape(self.amax_bits))
        )

    @property
    def T(self) -> "NVFP4Array":
        return transpose(self)

    def isfinite(self) -> jax.Array:
        """``[...] bool``: False for each matrix whose source held NaN or Inf."""
        return jnp.isfinite(self.amax)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return dequantize(self, dtype)

    @classmethod
    def abstract(cls, shape, block=BLOCK_2D, sharding=None) -> "NVFP4Array":
        """An ``NVFP4Array`` of ``jax.ShapeDtypeStruct`` leaves for a logical ``shape``.

        ``sharding`` is an optional ``NVFP4Array``-shaped tree (or one sharding for all leaves).
        """
        block = _check_block(block)
        dshape, sshape, ashape = packed_shapes(shape, block)
        sh = sharding if isinstance(sharding, NVFP4Array) else None
        one = None if isinstance(sharding, NVFP4Array) else sharding
        return cls(
            data=jax.ShapeDtypeStruct(dshape, jnp.uint8, sharding=sh.data if sh else one),
            scale_bits=jax.ShapeDtypeStruct(sshape, jnp.uint8, sharding=sh.scale_bits if sh else one),
            amax_bits=jax.ShapeDtypeStruct(ashape, jnp.uint32, sharding=sh.amax_bits if sh else one),
            matrix_shape=tuple(int(d) for d in shape[-2:]),
            block=block,
        )

    def __repr__(self) -> str:
        return f"NVFP4Array(shape={self.shape}, block={self.block})"


jax.tree_util.register_dataclass(
    NVFP4Array, data_fields=["data", "scale_bits", "amax_bits"], meta_fields=["matrix_shape", "block"]
)


def is_nvfp4(x) -> bool:
    return isinstance(x, NVFP4Array)


def quantize(
    x: jax.Array,
    *,
    block=BLOCK_2D,
    rounding: str = "nearest",
    key: Optional[jax.Array] = None,
    amax: Optional[jax.Array] = None,
    four_over_six: bool = False,
) -> NVFP4Array:
    """Quantize ``x [..., rows, cols]`` (float32 or bfloat16) to NVFP4.

    Args:
      x: the tensor; axes before the last two are batch axes (one amax per matrix).
      block: ``(16, 16)`` 2D tiles (weights), ``(1, 16)`` 1D blocks along rows (activations,
        gradients) or ``(16, 1)`` 1D blocks down columns (an ``[in, out]`` kernel's inputs).
      rounding: ``"nearest"`` (round to nearest, ties to even) or ``"stochastic"``.
      key: a JAX PRNG key, required for stochastic rounding. The random draw of each element
        depends only on the key and the element's flat index in the logical tensor, so a
        sharded quantization draws the same numbers.
      amax: the global amax ``[...]`` (or a scalar) to use instead of ``max(|x|)`` — for
        sharded quantization, where it is the maximum across shards. A float ``>= 0`` (0 only
        for an all-zero matrix); NaN or +Inf mark the matrix non-finite (it dequantizes to
        NaN). Negative values and -Inf, and 0 for a matrix holding non-zero values (it would
        quantize to all zeros), are refused with ``ValueError`` where the values are known;
        where they are traced (under ``jit``) such a matrix gets a NaN amax instead: it is
        marked non-finite (``isfinite()`` False, dequantizes to NaN), never plausible zeros.
      four_over_six: each block's scale maps its amax to 4 instead of 6 where that has the
        smaller squared error (:func:`four_over_six_scales`); the result is ordinary NVFP4. Off
        (the default), the result is the reference recipe's bit for bit.

    Returns:
      An :class:`NVFP4Array` bit-identical to the reference recipe's quantizer.

    Not differentiable: the codes are integers, so a gradient through them would be zero
    everywhere. ``jax.grad`` (or ``jax.jvp``) of an input that reaches ``quantize`` raises
    ``TypeError`` instead. Quantize ``jax.lax.stop_gradient(x)`` where no gradient should
    flow; for quantization-aware training the straight-through estimator is
    ``x + jax.lax.stop_gradient(dequantize(quantize(jax.lax.stop_gradient(x)), x.dtype) - x)``:
    its value is the quantized tensor, its gradient the identity.
    """
    block = _check_block(block)
    check_rounding(rounding, key)
    x = as_array(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point array, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"quantize needs at least 2 axes [..., rows, cols], got shape {x.shape}")
    *batch, rows, cols = x.shape
    if rows == 0 or cols == 0:
        raise ValueError(f"quantize needs a non-empty matrix, got shape {x.shape}")
    if amax is not None:
        amax = _check_amax(amax, batch)
        known = getattr(amax, "dtype", None) is None or _concrete(amax)
        if known and _concrete(x) and np.any(np.asarray(amax) == 0):
            zero = np.broadcast_to(np.asarray(amax) == 0, tuple(batch))
            if np.any(zero & np.asarray(_nonzero_matrices(x))):
                raise ValueError("quantize: amax=0 for a matrix holding non-zero values would quantize it to all "
                                 "zeros; pass its max(|x|) (0 is the amax of an all-zero matrix only)")
        if not (known and _concrete(x)):
            amax = _poison_invalid_amax(x, amax, batch)
    run = _where_it_lives(functools.partial(_quantize, block=block, four_over_six=bool(four_over_six)), x,
                          packed_shapes(x.shape, block),
                          lambda d, s, a: NVFP4Array(d, s, a, tuple(x.shape[-2:]), block))
    return run(x, key if rounding == "stochastic" else None, amax)


@jax.jit
def _nonzero_matrices(x):
    return jnp.any(x != 0, axis=(-2, -1))


def _poison_invalid_amax(x, amax, batch):
    """A traced ``amax`` the eager checks would refuse (negative, -Inf, or 0 for a matrix
    holding non-zero values) as NaN: the matrix is then marked non-finite."""
    a = jnp.broadcast_to(jnp.asarray(amax, jnp.float32), tuple(batch))
    return jnp.where((a < 0) | ((a == 0) & _nonzero_matrices(x)), jnp.float32(jnp.nan), a)


NOT_DIFFERENTIABLE = ("quantize is not differentiable: its outputs are integer codes, so a gradient through "
                      "dequantize(quantize(x)) would be zero everywhere. Quantize jax.lax.stop_gradient(x) where no "
                      "gradient should flow; a straight-through estimator is x + jax.lax.stop_gradient(dequantize("
                      "quantize(jax.lax.stop_gradient(x)), x.dtype) - x)")


# The numeric cores of quantize and dequantize are compiled once per shape (inlined when the
# caller is itself traced): called eagerly, each of their few dozen ops would otherwise
# dispatch (and, for every new shape, compile) a program of its own.
@functools.partial(jax.jit, static_argnames=("block", "four_over_six"))
def _quantize(x, key, amax, block, four_over_six=False):
    return _quantize_core(x, key, amax, block, four_over_six)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _quantize_core(x, key, amax, block, four_over_six=False):
    rows, cols = x.shape[-2:]
    xp = pad_to_block(x.astype(jnp.float32), block)
    uniform = None if key is None else nx.uniform_from_index(key, element_index(xp.shape, (rows, cols)))
    codes_, scale, amax = quantize_padded(xp, block, uniform=uniform, amax=amax, four_over_six=four_over_six)
    # The array itself (a pytree) is the program's output: its stored bytes are formed here,
    # not op by op after it.
    return from_codes(codes_[..., :rows, :cols], scale, amax, block)


@_quantize_core.defjvp
def _quantize_jvp(block, four_over_six, primals, tangents):
    # Called only when some input carries a tangent (JAX skips it for symbolic zeros).
    raise TypeError(NOT_DIFFERENTIABLE)


def check_rounding(rounding: str, key) -> None:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key (key=...)")


def pad_to_block(x: jax.Array, block, multiple=(1, 1)) -> jax.Array:
    """Zero-pad the last two axes to multiples of ``block * multiple``."""
    rows, cols = x.shape[-2:]
    rp = _ceil_to(rows, block[0] * multiple[0])
    cp = _ceil_to(cols, block[1] * multiple[1])
    if (rp, cp) == (rows, cols):
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rp - rows), (0, cp - cols)])


def element_index(shape, logical, offset=(0, 0)) -> jax.Array:
    """uint32 flat index, in the logical ``[..., rows, cols]`` tensor, of each element of a
    (padded, possibly local) block of ``shape`` whose first element sits at ``offset``.

    ``offset`` entries may be traced (a shard's position inside ``shard_map``).
    """
    nd = len(shape)
    r = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 2) + jnp.asarray(offset[0]).astype(jnp.uint32)
    c = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 1) + jnp.asarray(offset[1]).astype(jnp.uint32)
    return flat_index(r, c, logical, nd - 2)


def flat_index(row: jax.Array, col: jax.Array, logical, batch_ndim: Optional[int] = None) -> jax.Array:
    """uint32 flat index ``((b0 * B1 + b1) ... * rows + row) * cols + col`` (wrapping) of
    elements at logical ``row``/``col`` positions; the first ``batch_ndim`` axes of ``row``
    (default all but the last two) are the batch axes. Stochastic rounding draws by it."""
    rows, cols = logical
    shape = row.shape
    idx = row * np.uint32(cols) + col
    stride = rows * cols
    nb = len(shape) - 2 if batch_ndim is None else batch_ndim
    for ax in reversed(range(nb)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * np.uint32(stride % 2**32)
        stride *= shape[ax]
    return idx


def quantize_padded(xp: jax.Array, block, *, uniform=None, amax=None, reduce_amax=None, four_over_six=False):
    """The recipe on a float32 array whose last two axes are multiples of the block.

    The global amax is the maximum of the block maxima (one pass over the data); pass
    ``amax`` to use a given one instead, or ``reduce_amax`` (a function of the uint32 amax
    bits, e.g. a ``pmax`` across shards) to combine it with other shards first.
    ``four_over_six``: each block takes the scale of :func:`four_over_six_scales`.
    Returns ``(codes [..., rp, cp] uint8, scale e4m3, amax [...] float32)``. This is the whole
    numeric core: :func:`quantize` and the sharded re-quantization call it.
    """
    *batch, rp, cp = xp.shape
    br, bc = block
    tiles = xp.reshape(*batch, rp // br, br, cp // bc, bc)
    block_amax = nx.abs_max(tiles, axis=(-3, -1))
    given = amax is not None
    if not given:
        # XLA's float max propagates NaN; a reduction over bit patterns here would keep
        # subnormal maxima too, but it stops XLA from fusing and costs a second pass.
        amax = jnp.max(block_amax, axis=(-2, -1))
        if reduce_amax is not None:
            bits = reduce_amax(jax.lax.bitcast_convert_type(amax, jnp.uint32))  # integer max
            amax = jax.lax.bitcast_convert_type(bits, jnp.float32)
    amax = jnp.broadcast_to(jnp.asarray(amax, jnp.float32), tuple(batch))
    if given:  # a given -0.0 is the amax 0 (its reciprocal, -inf, would make every scale NaN)
        amax = jnp.where(amax == 0, np.float32(0.0), amax)
    enc = nx.global_encode_scale(amax)
    dec = np.float32(1.0) / enc
    scale = nx.block_scales(block_amax, enc[..., None, None])
    if four_over_six:
        scale = four_over_six_scales(tiles, block_amax, scale, enc, dec)
    e = nx.block_encode_multiplier(scale, dec[..., None, None])[..., :, None, :, None]
    v = tiles * e
    # An element whose scaled value is a float32 subnormal keeps its sign in the reference (a negative one encodes to
    # -0, code 8; stochastic rounding may round either up); XLA:CPU flushes that product to +0. Where the product,
    # taken at 2^32 times the scale, is above 2^-150 (nonzero once rounded; never true of a product that rounds to
    # zero), the smallest normal of its sign stands in, which rounds the same.
    flushed = (v == 0) & (tiles != 0) & (jnp.abs(tiles) * (e * np.float32(2.0**32)) > np.float32(2.0**-118))
    v = jnp.where(flushed, jnp.where(tiles < 0, np.float32(-(2.0**-126)), np.float32(2.0**-126)), v)
    v = jnp.clip(v, -nx.E2M1_MAX, nx.E2M1_MAX).reshape(*batch, rp, cp)
    codes_ = nx.encode_e2m1(v) if uniform is None else nx.encode_e2m1_stochastic(v, uniform)
    return codes_, scale, amax


def four_over_six_scales(tiles, block_amax, scale, enc, dec):
    """Per block, the E4M3 scale of least squared error between two candidates: ``scale``,
    the recipe's (the block's amax maps to 6), and the one mapping it to 4
    (:func:`~jax_nvfp4.numerics.block_scales` with ``inv_target`` 1/4), which trades the empty range
    between 4 and 6 for finer steps below. Both are ordinary NVFP4 scales: the result decodes
    everywhere NVFP4 decodes. A tie, and a block whose error is NaN, keep the recipe's.

    ``tiles [..., R, br, C, bc]`` float32, ``block_amax``/``scale [..., R, C]``, ``enc``/``dec``
    ``[...]`` the global encode and decode scales. This is the "Four Over Six" adaptive block
    scaling (Cook et al., 2025) on round-to-nearest errors.
    """
    scale4 = nx.block_scales(block_amax, enc[..., None, None], np.float32(0.25))

    def error(s):
        e = nx.block_encode_multiplier(s, dec[..., None, None])[..., :, None, :, None]
        v = jnp.clip(tiles * e, -nx.E2M1_MAX, nx.E2M1_MAX)
        back = (nx.decode_e2m1(nx.encode_e2m1(v)) * s.astype(jnp.float32)[..., :, None, :, None]) \
            * dec[..., None, None, None, None]
        return jnp.sum(jnp.square(back - tiles), axis=(-3, -1))

    return jnp.where(error(scale4) < error(scale), scale4, scale)


def dequantize(q: NVFP4Array, dtype=jnp.bfloat16) -> jax.Array:
    """``[..., rows, cols]`` values ``e2m1(code) * float32(scale) * D`` cast to ``dtype``.

    The product is formed in float32 as ``(e2m1 * scale) * D`` (the first product is exact).
    Matrices with a non-finite amax decode to NaN.
    """
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"dequantize expects an NVFP4Array, got {type(q).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        # An integer or bool result would be silently truncated weights.
        raise TypeError(f"dequantize: dtype must be a floating-point dtype, got {jnp.dtype(dtype).name}")
    # The values' shape, for their sharding: the packed bytes' with the columns unpacked.
    values = (*q.data.shape[:-1], q.matrix_shape[1])
    return _where_it_lives(functools.partial(_dequantize, dtype=jnp.dtype(dtype)), q.data, [values],
                           lambda s: s)(q)


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantize(q: NVFP4Array, dtype) -> jax.Array:
    *batch, rows, _ = q.data.shape
    _, cols = q.matrix_shape
    br, bc = q.block
    rp, cp = _ceil_to(rows, br), _ceil_to(cols, bc)
    # Integer bit arithmetic (decode_e2m1), not XLA's float4 conversion of the reinterpreted
    # bytes: that is faster on CPU but gives wrong values inside some fused gradient computations.
    vals = nx.decode_e2m1(nx.unpack_codes(q.data))[..., :cols]
    vals = jnp.pad(vals, [(0, 0)] * len(batch) + [(0, rp - rows), (0, cp - cols)])
    tiles = vals.reshape(*batch, rp // br, br, cp // bc, bc)
    dec = nx.global_decode_scale(q.amax)
    out = (tiles * q.scale.astype(jnp.float32)[..., :, None, :, None]) * dec[..., None, None, None, None]
    return out.reshape(*batch, rp, cp)[..., :rows, :cols].astype(dtype)


def codes(q: NVFP4Array) -> jax.Array:
    """The unpacked E2M1 codes ``[..., rows, cols] uint8`` of ``q``."""
    return nx.unpack_codes(q.data)[..., : q.matrix_shape[1]]


def from_codes(codes_: jax.Array, scale, amax, block) -> NVFP4Array:
    """Build an ``NVFP4Array`` from unpacked codes ``[..., rows, cols]``, scales and amax."""
    rows, cols = codes_.shape[-2:]
    if cols % 2:
        codes_ = jnp.pad(codes_, [(0, 0)] * (codes_.ndim - 1) + [(0, 1)])
    return NVFP4Array.create(nx.pack_codes(codes_), scale, amax, (rows, cols), block)


def transpose(q: NVFP4Array) -> NVFP4Array:
    """Swap the last two axes without re-quantizing.

    The codes of ``W.T`` are the transposed codes of ``W`` and its scales the transposed
    scales; the block turns with them: ``(16, 16)`` stays, ``(1, 16)`` and ``(16, 1)`` swap. So
    the result is bit-identical to ``quantize(W.T, block=<the turned block>)``.
    """
    return _transpose(q)


@jax.jit
def _transpose(q: NVFP4Array) -> NVFP4Array:
    return from_codes(jnp.swapaxes(codes(q), -1, -2), jnp.swapaxes(q.scale, -1, -2), q.amax, _TRANSPOSED[q.block])


def isfinite(q: NVFP4Array) -> jax.Array:
    """``[...] bool``: False for each matrix whose source held NaN or Inf."""
    return q.isfinite()
