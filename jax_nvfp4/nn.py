"""The NVFP4 recipe's GEMMs in Flax layers: on stock ``nn.Dense`` layers through Flax's
method interceptors (:func:`intercept_dense`), and :class:`NVFP4Dense`, a dense layer with the
recipe built in. Both quantize their operands (:func:`jax_nvfp4.gemm.dot`) and read the
stored NVFP4 weight itself.

Inside the sharded step (:func:`jax_nvfp4.make_step`) every parameter reaches the model as a
:class:`~jax_nvfp4.fetch.Shard` box: stock layers read it with ``self.param`` (which gathers
and dequantizes it); the recipe takes the gathered packed weight itself
(:meth:`Shard.nvfp4`), so its GEMM runs on the stored bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Any, Callable, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_nvfp4 import gemm
from jax_nvfp4.array import BLOCK_2D, NVFP4Array, quantize
from jax_nvfp4.fetch import Shard

__all__ = ["NVFP4Dense", "NVFP4_COLLECTION", "ROUNDING_RNG", "Recipe", "intercept_dense"]


def _shard(module: nn.Module, name: str) -> Optional[Shard]:
    if module.has_variable("params", name):
        v = module.get_variable("params", name)
        if isinstance(v, Shard):
            return v
    return None

# Variable collection holding the stored (quantized) kernels, under the params' names.
NVFP4_COLLECTION = "nvfp4"
# Optional RNG stream for stochastic rounding when no key is passed to the call.
ROUNDING_RNG = "rounding"
_COMPUTE_MODES = ("dequant", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The elements of the NVFP4 training recipe a ``compute="nvfp4"`` layer applies, each on
    by default (:mod:`jax_nvfp4.gemm`); switching one off measures what it buys.

    ``stochastic_grads``: the gradient operands of dgrad and wgrad are rounded stochastically
    (with the ``"rounding"`` key), else to nearest. ``hadamard_wgrad``: wgrad's operands get
    the random Hadamard transform along the tokens. ``quantize_activations``: fprop's and
    wgrad's activation operand is quantized, else left in float. The weight's block (16x16
    tiles or 1D) is the stored weight's own."""

    stochastic_grads: bool = True
    hadamard_wgrad: bool = True
    quantize_activations: bool = True


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
    per layer), else rounds to nearest; ``recipe`` (:class:`Recipe`) switches elements of the
    recipe off.
    """

    features: int
    use_bias: bool = False
    compute: str = "dequant"
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    backend: str = "auto"
    recipe: Recipe = Recipe()

    @nn.compact
    def __call__(self, x: jax.Array, key: Optional[jax.Array] = None) -> jax.Array:
        if self.compute not in _COMPUTE_MODES:
            raise ValueError(f"NVFP4Dense.compute must be one of {_COMPUTE_MODES}, got {self.compute!r}")
        x = jnp.asarray(x)
        shape = (x.shape[-1], self.features)
        shard = _shard(self, "kernel")
        x = x.astype(self.dtype)

        def add_bias(y):
            if not self.use_bias:
                return y
            return y + self.param("bias", self.bias_init, (self.features,), self.param_dtype).astype(self.dtype)

        if self.compute == "nvfp4" and shard is not None and shard.is_nvfp4:
            w_q, sink = shard.nvfp4()
            return add_bias(self._dot(x, w_q, sink, key))
        kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
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
            y = self._dot(x, w_q, kernel, key)
        return add_bias(y)

    def _dot(self, x, w_q, sink, key):
        return _recipe_dot(self, x, w_q, sink, key, self.recipe, self.backend, self.dtype)


def _recipe_dot(module: nn.Module, x, w_q, sink, key, recipe: "Recipe", backend: str, dtype):
    """The recipe GEMM of one layer call; the rounding key is ``key``, else the module's
    ``"rounding"`` stream when it has one, else none (round to nearest)."""
    if not recipe.stochastic_grads:
        key = None
    elif key is None and module.has_rng(ROUNDING_RNG):
        key = module.make_rng(ROUNDING_RNG)
    return gemm.dot(x, w_q, sink, key=key, backend=backend, out_dtype=dtype,
                    rht_wgrad=recipe.hadamard_wgrad, quantize_x=recipe.quantize_activations)


_DENSE_CALL = inspect.unwrap(nn.Dense.__call__)  # nn.Dense's own __call__, as the interceptors see it


@contextlib.contextmanager
def intercept_dense(recipe: Recipe = Recipe(), *, backend: str = "auto") -> Iterator[None]:
    """Run every stock ``flax.linen.Dense`` whose kernel is an NVFP4 :class:`Shard` (inside
    :func:`jax_nvfp4.make_step` / :func:`jax_nvfp4.make_eval`) with the recipe GEMM on the
    gathered stored bits, within this context (``flax.linen.intercept_methods``)::

        def loss_fn(params, rows, key):
            with nv.intercept_dense():
                logits = model.apply({"params": params}, rows[:, :-1], rngs={"rounding": key})

    The layer's code is unchanged: ``nn.Dense``'s own ``y = x @ kernel (+ bias)`` in its
    ``dtype`` (else the promoted dtype of ``x`` and the gathered weight) runs as the recipe GEMM,
    also where a subclass calls it (``super().__call__``: the rest of the subclass runs as
    written). A Dense with its own ``dot_general``, and other layers reading an NVFP4 kernel
    (``nn.DenseGeneral``, ``nn.Einsum``), run as written on the dequantized weight, with a
    warning: the recipe GEMM is one ``[K, N]`` matrix product. Stochastic rounding of the
    gradients draws from the ``"rounding"`` RNG stream when the model has one (under ``nn.scan``
    split it per layer, as ``"params"``), else rounds to nearest. A Dense whose kernel is not an
    NVFP4 ``Shard`` (kept in bf16 by the :class:`~jax_nvfp4.Policy`, or outside the step, e.g.
    at init) runs as written. The same recipe as :class:`NVFP4Dense` ``(compute="nvfp4")``,
    bit for bit.
    """

    def where(m):
        return "/".join(m.scope.path) or m.name or type(m).__name__

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name != "__call__" or not isinstance(m, (nn.Dense, nn.DenseGeneral, nn.Einsum)):
            return next_fun(*args, **kwargs)
        shard = _shard(m, "kernel")
        if shard is None or not shard.is_nvfp4:
            return next_fun(*args, **kwargs)
        if context.orig_method.func is not _DENSE_CALL:  # a subclass's own __call__: its super() call comes here
            if not isinstance(m, nn.Dense):
                warnings.warn(f"intercept_dense: {type(m).__name__} {where(m)!r} reads an NVFP4 kernel and runs as "
                              "written on the dequantized weight (the recipe GEMM is nn.Dense's)", stacklevel=2)
            return next_fun(*args, **kwargs)
        if m.dot_general is not None or m.dot_general_cls is not None:
            warnings.warn(f"intercept_dense: Dense {where(m)!r} has its own dot_general and runs it on the "
                          "dequantized weight, not the recipe GEMM", stacklevel=2)
            return next_fun(*args, **kwargs)
        if len(args) + len(kwargs) != 1 or (kwargs and "inputs" not in kwargs):
            return next_fun(*args, **kwargs)
        x = jnp.asarray(args[0] if args else kwargs["inputs"])
        dtype = m.dtype or jnp.promote_types(x.dtype, shard.config.dtype)
        w_q, sink = shard.nvfp4()
        y = _recipe_dot(m, x.astype(dtype), w_q, sink, None, recipe, backend, dtype)
        if m.use_bias:
            y = y + m.param("bias", m.bias_init, (m.features,), m.param_dtype).astype(dtype)
        return y

    with nn.intercept_methods(interceptor):
        yield
