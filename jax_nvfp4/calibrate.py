"""W4A4 calibration of any Linen model: stock ``flax.linen.Dense`` or :class:`~jax_nvfp4.nn.NVFP4Dense` layers.

A W4A4 kernel quantizes each Linear's input too: 1x16 groups rounded to nearest, with one
static global scale per layer taken from the input's calibrated amax (compressed-tensors'
``static_minmax`` observer). This module measures that amax and runs a model as such a kernel
would, both through Flax's method interceptors, so the model's code is unchanged:

- :func:`input_amax` records ``max |x|`` entering every NVFP4 kernel's layer over calibration
  batches: ``{param path: float32 amax}``, what
  ``jax_nvfp4.export.export_hf(..., fmt="nvfp4", input_amax=...)`` writes as each Linear's
  input global scale.
- :func:`quantized_inputs` (with :func:`with_input_amax` putting the amaxes among the model's
  variables) runs the layers on their quantized-dequantized inputs, to measure what W4A4 costs.

The amax of a layer crosses the model in the ``"nvfp4"`` collection as the variable
:data:`INPUT_AMAX` next to the layer's stored kernel (the layers never read it), so under
``nn.scan`` with ``variable_axes={"params": 0, "nvfp4": 0}`` each scanned layer gets its own and
the amax of a stacked kernel ``[L, in, out]`` is ``[L]``.

NNX models (``nnx.Linear`` layers) have no method interceptors: :func:`input_amax_nnx` and
:func:`with_input_amax_nnx` do the same by running ``nnx.Linear.__call__`` wrapped, within the
calibration's own trace (and within :func:`quantized_inputs`), and carry each layer's amax as an
:class:`InputAmax` variable of the layer, which ``nnx.scan`` / ``nnx.vmap`` split per layer as
they split its kernel.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import flax
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import BLOCK_1D, NVFP4Array, dequantize, is_nvfp4, quantize
from jax_nvfp4.export import is_linear
from jax_nvfp4.layout import TiledNVFP4, is_tiled
from jax_nvfp4.nn import _DENSE_CALL, NVFP4_COLLECTION, NVFP4Dense
from jax_nvfp4.params import dequantize_params, path_str
from jax_nvfp4.sharding import host_array, logical

__all__ = ["INPUT_AMAX", "InputAmax", "float_weights", "input_amax", "input_amax_nnx", "nvfp4_kernels",
           "quantized_inputs", "with_input_amax", "with_input_amax_nnx"]

# The variable (in the "nvfp4" collection, at each NVFP4Dense) that carries a layer's input amax.
INPUT_AMAX = "input_amax"


def _host(tree):
    """Host copies of ``tree``'s leaves in their logical form (leaves spread over several
    processes gathered first)."""
    return jax.tree.map(host_array, logical(tree))


def nvfp4_kernels(params) -> List[str]:
    """The param paths (``a/b/kernel``) of the Linear kernels of ``params`` (stored or logical)
    held in NVFP4, in the tree's order: the kernels :func:`input_amax` calibrates."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: is_nvfp4(x) or is_tiled(x))[0]
    return [path_str(p) for p, leaf in flat if isinstance(leaf, (NVFP4Array, TiledNVFP4)) and is_linear(path_str(p))]


def float_weights(params, dtype: Any = jnp.bfloat16):
    """``params`` (stored, logical or sharded over any processes) as one process computes with
    them: host copies of the logical leaves, NVFP4 leaves dequantized to ``dtype``, other float
    leaves cast to it (:func:`jax_nvfp4.dequantize_params`). Every process gets the whole tree."""
    return dequantize_params(_host(params), dtype)


def _widened(x):
    # Through its bits: XLA may simplify a bf16 -> f32 convert pair away and keep the excess
    # float32 precision of the value before its rounding to bf16, which the layer never sees.
    if x.dtype != jnp.bfloat16:
        return x
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _as_read(x, dtype) -> jax.Array:
    """``x`` in float32 exactly as a matmul in ``dtype`` reads it (a bf16 input, a bf16 layer's
    output, as rounded, then in ``dtype``)."""
    return _widened(_widened(x).astype(dtype)).astype(jnp.float32)


def _w4a4(x: jax.Array, amax) -> jax.Array:
    """``x`` (float32, any shape with the features last) as a W4A4 kernel reads it: NVFP4 in 1x16
    groups, round to nearest, the global ``amax``; dequantized to float32."""
    rows = x.reshape(1, -1) if x.ndim == 1 else x  # an unbatched input: one row
    return dequantize(quantize(rows, block=BLOCK_1D, amax=amax), jnp.float32).reshape(x.shape)


def _input(context, args, kwargs) -> Optional[Tuple[jax.Array, str, Any]]:
    """``(x, name, dtype)``: an ``NVFP4Dense`` or stock ``nn.Dense`` call's input (positional or by its
    name ``name``) in float32 exactly as the layer's matmul reads it in ``dtype`` (None for other calls, and for a
    subclass's own ``__call__``: its ``super().__call__`` comes here with what the matmul reads)."""
    m = context.module
    if context.method_name != "__call__" or not (args or kwargs):
        return None
    if isinstance(m, NVFP4Dense):
        name = "x"
    elif isinstance(m, nn.Dense) and context.orig_method.func is _DENSE_CALL and m.has_variable("params", "kernel"):
        name = "inputs"
    else:
        return None
    x = args[0] if args else kwargs.get(name)
    if x is None:
        return None

    x = jnp.asarray(x)
    if isinstance(m, NVFP4Dense):
        return _as_read(x, m.dtype), name, m.dtype
    # What nn.Dense's own promotion of its input, kernel and bias gives its matmul (its dtype, else their common one).
    bias = m.get_variable("params", "bias") if m.use_bias else None
    read = m.promote_dtype(x, m.get_variable("params", "kernel"), bias, dtype=m.dtype)[0]
    return _widened(read).astype(jnp.float32), name, read.dtype


def _record(next_fun, args, kwargs, context):
    """Writes ``max |x|`` of an ``NVFP4Dense`` or ``nn.Dense`` input (as its matmul reads it) to the
    layer's :data:`INPUT_AMAX`, the max with an earlier call's where the layer runs more than once."""
    if (read := _input(context, args, kwargs)) is not None:
        m, a = context.module, nx.abs_max(read[0], axis=None)
        if m.has_variable(NVFP4_COLLECTION, INPUT_AMAX):
            a = nx.abs_max(jnp.stack([m.get_variable(NVFP4_COLLECTION, INPUT_AMAX), a]), axis=0)
        try:
            m.put_variable(NVFP4_COLLECTION, INPUT_AMAX, a)
        except flax.errors.ModifyScopeVariableError:
            pass  # a transform that does not carry the collection: an NVFP4 kernel there is named as not recorded
    return next_fun(*args, **kwargs)


def _quantize_inputs(next_fun, args, kwargs, context):
    """An ``NVFP4Dense`` or ``nn.Dense`` with an :data:`INPUT_AMAX` gets its input quantized with it
    and dequantized into its matmul, as a W4A4 kernel does (into a stock ``nn.Dense`` in the dtype
    its matmul reads, so that its own promotion keeps that dtype)."""
    m = context.module
    if m.has_variable(NVFP4_COLLECTION, INPUT_AMAX) and (read := _input(context, args, kwargs)) is not None:
        x, name, dtype = read
        q = _w4a4(x, m.get_variable(NVFP4_COLLECTION, INPUT_AMAX))
        if not isinstance(m, NVFP4Dense):  # its own promotion casts it to what it is already
            q = q.astype(dtype)
        return next_fun(q, *args[1:], **kwargs) if args else next_fun(**{**kwargs, name: q})
    return next_fun(*args, **kwargs)


def input_amax(apply_fn: Callable[..., Any], params, batches: Iterable[Any], *,
               dtype: Any = jnp.bfloat16) -> Dict[str, np.ndarray]:
    """The calibrated input amax of every NVFP4 kernel of ``params``.

    ``apply_fn(variables, batch, mutable=collections)`` runs the model's forward pass on one
    batch and returns ``(outputs, state)`` as ``flax.linen.Module.apply`` does with ``mutable``
    (``model.apply`` itself when a batch is the model's input); it gets ``{"params":
    float_weights(params, dtype)}`` and each batch (a pytree of arrays) as a device array, under
    ``jit``, so its layers run on the weights as stored (``NVFP4Dense(compute="dequant")`` for
    the W4A16 model). ``batches`` is iterated once.

    Returns ``{param path of each NVFP4 Linear kernel (:func:`nvfp4_kernels`): float32 amax}``
    in sorted path order: the largest ``|x|`` entering the kernel's layer over every call and
    every batch, ``x`` taken in the dtype its matmul reads (an ``NVFP4Dense``'s ``dtype``; a stock
    ``nn.Dense``'s own promotion of its input, kernel and bias: its ``dtype``, else their common
    one; a subclass's ``super().__call__`` input); shape
    ``[]``, or ``[L]`` for a kernel stacked by ``nn.scan``. NaN in an input is kept. Layers
    whose kernel is not NVFP4 (kept in float by the policy) are left out.

    Raises ``ValueError`` when there is no batch, when ``params`` hold no NVFP4 kernel, or when
    an NVFP4 kernel's layer recorded no input (a kernel read by another layer, e.g. ``nn.DenseGeneral``).
    """

    @jax.jit
    def amaxes(p, batch):
        with nn.intercept_methods(_record):
            _, state = apply_fn({"params": p}, batch, mutable=[NVFP4_COLLECTION])
        flat = traverse_util.flatten_dict(state.get(NVFP4_COLLECTION, {}))
        return {"/".join(k[:-1] + ("kernel",)): v for k, v in flat.items() if k[-1] == INPUT_AMAX}

    return _calibrated(amaxes, params, batches, dtype,
                       "only nn.Dense and nv.NVFP4Dense layers record theirs (not nn.DenseGeneral or nn.Einsum), and "
                       f"under a Flax transform only where it carries the {NVFP4_COLLECTION!r} collection, as nn.scan "
                       f"or nn.vmap(..., variable_axes={{'params': 0, {NVFP4_COLLECTION!r}: 0}})")


def _calibrated(amaxes: Callable[[Any, Any], Dict[str, Any]], params, batches: Iterable[Any], dtype: Any,
                unrecorded: str) -> Dict[str, np.ndarray]:
    """What :func:`input_amax` and :func:`input_amax_nnx` share: ``amaxes(weights, batch)`` (``{kernel path:
    amax}`` of one batch, jitted) over ``batches`` on ``params``' float weights, the max per kernel of the
    NVFP4 ones; ``unrecorded`` says which layers record their input."""
    batches = list(batches)
    if not batches:
        raise ValueError("calibrate: no batches")
    host = _host(params)
    kernels, weights = set(nvfp4_kernels(host)), dequantize_params(host, dtype)
    if not kernels:  # float params: a W4A4 export needs the weights' NVFP4 form first
        raise ValueError("calibrate: params hold no NVFP4 Linear kernel (quantize them first: nv.quantize_params "
                         "or nv.shard_params with a policy)")
    out: Dict[str, np.ndarray] = {}
    for batch in batches:
        for path, v in jax.device_get(amaxes(weights, jax.tree.map(jnp.asarray, batch))).items():
            if path in kernels:
                out[path] = np.maximum(out[path], v) if path in out else np.asarray(v, np.float32)
    missing = sorted(kernels - set(out))
    if missing:
        raise ValueError(f"calibrate: no input recorded for the NVFP4 kernels {missing[:3]}: {unrecorded}")
    return {k: out[k] for k in sorted(out)}


def with_input_amax(variables: Mapping[str, Any], input_amax: Mapping[str, Any]) -> Dict[str, Any]:
    """``variables`` (a model's ``{"params": ..., ...}``) with each ``input_amax`` entry (``{param
    path of a kernel: amax}``, :func:`input_amax`'s result) put as float32 at the kernel's layer
    in the ``"nvfp4"`` collection, next to what that collection already holds; the variables
    :func:`quantized_inputs` reads."""
    collection = traverse_util.flatten_dict(dict(variables.get(NVFP4_COLLECTION, {})))
    collection.update({tuple(k.split("/")[:-1]) + (INPUT_AMAX,): jnp.asarray(v, jnp.float32)
                       for k, v in input_amax.items()})
    return {**variables, NVFP4_COLLECTION: traverse_util.unflatten_dict(collection)}


class InputAmax(nnx.Variable):
    """An ``nnx.Linear``'s calibrated input amax (:func:`with_input_amax_nnx`): float32, ``[]`` or
    ``[L]`` for a stack of layers made by ``nnx.vmap``."""


_NNX_HANDLERS = threading.local()  # this thread's handlers of nnx.Linear inputs, innermost last
_NNX_LOCK = threading.Lock()
_NNX_WRAPPED: Dict[str, Any] = {"users": 0, "call": None}  # the wrapper is installed while a context is open


@contextlib.contextmanager
def _nnx_linear_inputs(on_input: Callable[[Any, jax.Array], Optional[jax.Array]]) -> Iterator[None]:
    """Within this context, in this thread, every ``nnx.Linear`` call (also a subclass's ``super().__call__``)
    first gives ``on_input(layer, x as its matmul reads it, in float32)`` the input, and runs on what it returns
    (None: the input as it was). ``nnx.Linear.__call__`` is wrapped while any thread holds such a context; other
    threads' calls go through unchanged. A program traced within keeps what the wrapper did when it runs later."""
    with _NNX_LOCK:
        if not _NNX_WRAPPED["users"]:
            call = _NNX_WRAPPED["call"] = nnx.Linear.__call__

            @functools.wraps(call)
            def wrapped(self, inputs, *args, **kwargs):
                handlers = getattr(_NNX_HANDLERS, "stack", None)
                if not handlers:
                    return call(self, inputs, *args, **kwargs)
                bias = self.bias[...] if self.bias is not None else None
                read = self.promote_dtype((jnp.asarray(inputs), self.kernel[...], bias), dtype=self.dtype)[0]
                x = handlers[-1](self, _widened(read).astype(jnp.float32))
                return call(self, inputs if x is None else x.astype(read.dtype), *args, **kwargs)

            nnx.Linear.__call__ = wrapped
        _NNX_WRAPPED["users"] += 1
    stack = _NNX_HANDLERS.__dict__.setdefault("stack", [])
    stack.append(on_input)
    try:
        yield
    finally:
        stack.pop()
        with _NNX_LOCK:
            _NNX_WRAPPED["users"] -= 1
            if not _NNX_WRAPPED["users"]:
                nnx.Linear.__call__ = _NNX_WRAPPED["call"]


def input_amax_nnx(graphdef, params, batches: Iterable[Any], *, rest: Any = None,
                   call: Optional[Callable[[Any, Any], Any]] = None, dtype: Any = jnp.bfloat16) -> Dict[str, np.ndarray]:
    """:func:`input_amax` for an NNX model of ``nnx.Linear`` layers: ``graphdef`` and ``params`` (its
    ``nnx.Param`` state as a pure dict, ``nnx.to_pure_dict``, quantized, stored or sharded as the
    training step holds it). ``call(model, batch)`` runs the forward pass (default ``model(batch)``)
    on ``nnx.merge(graphdef, float_weights(params, dtype))`` under ``jit``. The same result: ``{param
    path of each NVFP4 Linear kernel: float32 amax}``, ``[L]`` for the kernel of a stack of layers
    (``nnx.vmap`` / ``nnx.scan``), the input of a subclass's ``super().__call__``; the same errors.
    ``rest``: the model's other state, merged with the params (``nnx.split(model, nnx.Param, ...)``'s
    last part: RNG streams of ``nnx.Dropout``, ``nnx.BatchNorm``'s statistics)."""
    call = call or (lambda model, batch: model(batch))

    def record(layer, x):
        layer.sow(nnx.Intermediate, INPUT_AMAX, nx.abs_max(x, axis=None),
                  init_fn=lambda: jnp.float32(0), reduce_fn=lambda a, b: nx.abs_max(jnp.stack([a, b]), axis=0))

    @jax.jit
    def amaxes(p, batch):
        with _nnx_linear_inputs(record):
            try:
                model = nnx.merge(graphdef, p) if rest is None else nnx.merge(graphdef, p, rest)
            except ValueError as e:
                if rest is not None:
                    raise
                raise ValueError(f"calibrate: nnx.merge(graphdef, params): {str(e).splitlines()[0]}: a graphdef of a "
                                 "model with more state than its params needs that state as rest= (nnx.split(model, "
                                 "nnx.Param, ...)'s last part)") from None
            _, sown = nnx.capture(call, nnx.Intermediate)(model, batch)
        flat = traverse_util.flatten_dict(nnx.to_pure_dict(sown))  # keys of an nnx.List are ints
        return {"/".join(map(str, k[:-1] + ("kernel",))): v for k, v in flat.items() if k[-1] == INPUT_AMAX}

    return _calibrated(amaxes, params, batches, dtype,
                       "only nnx.Linear layers record theirs (not nnx.LinearGeneral or nnx.Einsum)")


def with_input_amax_nnx(model, input_amax: Mapping[str, Any]):
    """``model`` (an NNX module, changed in place and returned) with each ``input_amax`` entry (``{param
    path of a kernel: amax}``) as an :class:`InputAmax` variable of the kernel's ``nnx.Linear``: what
    :func:`quantized_inputs` reads. KeyError naming a path that is no ``nnx.Linear`` kernel."""
    layers = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)}
    for key, value in input_amax.items():
        layer = layers.get(key[:-len("/kernel")] if key.endswith("/kernel") else None)
        if layer is None:
            raise KeyError(f"with_input_amax_nnx: {key!r} is not the kernel of an nnx.Linear of the model")
        setattr(layer, INPUT_AMAX, InputAmax(jnp.asarray(value, jnp.float32)))
    return model


def _quantize_nnx_input(layer, x):
    if not isinstance(getattr(layer, INPUT_AMAX, None), InputAmax):
        return None
    return _w4a4(x, getattr(layer, INPUT_AMAX)[...])


@contextlib.contextmanager
def quantized_inputs() -> Iterator[None]:
    """Within this context (``flax.linen.intercept_methods``), every ``NVFP4Dense`` or ``nn.Dense`` whose
    variables hold an :data:`INPUT_AMAX` (:func:`with_input_amax`) multiplies its input as a W4A4
    kernel does: ``x`` in the dtype the layer's matmul reads, quantized to NVFP4 in 1x16 groups with round to
    nearest and that amax (:func:`jax_nvfp4.quantize`), dequantized to float32, then the layer as
    written (a layer's own ``promote_dtype`` that changes values, not only their dtype, runs on the
    quantized input again). Other layers run as written::

        with nv.calibrate.quantized_inputs():
            y = model.apply(nv.calibrate.with_input_amax({"params": weights}, amax), x)

    Likewise every ``nnx.Linear`` with an :class:`InputAmax` (:func:`with_input_amax_nnx`), called
    in this thread, where the model is traced within the context (run eagerly, or by a function first
    traced within it: a jitted function traced before runs as it was traced, and one traced within
    keeps quantizing after)::

        with nv.calibrate.quantized_inputs():
            y = nv.calibrate.with_input_amax_nnx(nnx.merge(graphdef, weights), amax)(x)
    """
    with nn.intercept_methods(_quantize_inputs), _nnx_linear_inputs(_quantize_nnx_input):
        yield
