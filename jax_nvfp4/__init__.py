"""jax_nvfp4: model weights that live in NVFP4 during data-parallel training in JAX."""

from jax_nvfp4.array import (
    BLOCK_1D,
    BLOCK_2D,
    NVFP4Array,
    codes,
    dequantize,
    from_codes,
    is_nvfp4,
    isfinite,
    packed_shapes,
    quantize,
    transpose,
)
from jax_nvfp4.numerics import hadamard_matrix, hadamard_transform

__version__ = "0.1.0"

__all__ = [
    "BLOCK_1D",
    "BLOCK_2D",
    "NVFP4Array",
    "codes",
    "dequantize",
    "from_codes",
    "hadamard_matrix",
    "hadamard_transform",
    "is_nvfp4",
    "isfinite",
    "packed_shapes",
    "quantize",
    "transpose",
]
