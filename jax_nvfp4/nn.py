"""Flax linen layers whose matmuls follow the NVFP4 training recipe."""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_nvfp4 import gemm
from jax_nvfp4.array import BLOCK_2D, NVFP4Array, quantize

__all__ = ["NVFP4Dense", "NVFP4_COLLECTION", "ROUNDING_RNG"]

# Variable collection holding the stored (quantized) kernels, under the params' names.
NVFP4_COLLECTION = "nvfp4"
# Optional RNG stream for stochastic rounding when no key is passed to the call.
ROUNDING_RNG = "rounding"
_COMPUTE_MODES = ("dequant", "nvfp4")


class NVFP4Dense(nn.Module):
    """``y = x @ kernel (+ bias)`` over the last axis of ``x``.

    Params: ``kernel [in, features]`` (``param_dtype``, float32 by default) and, with
    ``use_bias``, ``bias [features]``.

    ``compute="dequant"``: the matmul runs in ``dtype`` on the float ``kernel`` param (the caller
    has already put the dequantized weight there).

    ``compute="nvfp4"``: the recipe GEMM (:func:`jax_nvfp4.gemm.dot`) on the stored weight,
    read from the ``"nvfp4"`` collection as an :class:`NVFP4Array` named ``"kernel"``; the
    weight gradient flows to the ``kernel`` param. Without a stored weight (at init, or for
    layers kept in bf16) the float kernel is quantized on the fly with 2D tiles. The stored
    weight is never created here.

    Under ``nn.scan`` give the collection a variable axis (``variable_axes={"params": 0,
    "nvfp4": 0}``): the scan slices the stacked ``NVFP4Array`` leaves and each slice is one
    ``[in, features]`` matrix with its own amax.

    Stochastic rounding of gradients uses ``key`` when given, else the ``"rounding"`` RNG stream
    when the module has one (``apply(..., rngs={"rounding": k})``; under ``nn.scan`` split it
    per layer), else rounds to nearest.
    """

    features: int
    use_bias: bool = False
    compute: str = "dequant"
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    backend: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, key: Optional[jax.Array] = None) -> jax.Array:
        if self.compute not in _COMPUTE_MODES:
            raise ValueError(f"NVFP4Dense.compute must be one of {_COMPUTE_MODES}, got {self.compute!r}")
        x = jnp.asarray(x)
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        x = x.astype(self.dtype)
        if self.compute == "dequant":
            y = jnp.dot(x, kernel.astype(self.dtype))
        else:
            if self.has_variable(NVFP4_COLLECTION, "kernel"):
                w_q = self.get_variable(NVFP4_COLLECTION, "kernel")
                if not isinstance(w_q, NVFP4Array):
                    raise TypeError(
                        f"variable {NVFP4_COLLECTION!r}/'kernel' must be an NVFP4Array, got {type(w_q).__name__}")
                if w_q.shape != kernel.shape:
                    raise ValueError(
                        f"stored NVFP4 kernel has shape {w_q.shape}, the kernel param {kernel.shape}")
            else:
                w_q = quantize(jax.lax.stop_gradient(kernel), block=BLOCK_2D)
            if key is None and self.has_rng(ROUNDING_RNG):
                key = self.make_rng(ROUNDING_RNG)
            y = gemm.dot(x, w_q, kernel, key=key, backend=self.backend, out_dtype=self.dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y
