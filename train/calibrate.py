"""Activation calibration of a trained model for W4A4 (NVFP4 weights and activations) exports.

The model trains with bf16 activations entering its NVFP4 layers (``compute: dequant``), so a
weight-only export (NVFP4A16) is what it was trained as. Serving engines' W4A4 kernels also
quantize the activation entering each NVFP4 Linear: 1x16 groups with E4M3 scales computed at
run time, under a float32 global scale the checkpoint stores, computed from the activation's
calibrated amax. :func:`calibrate` records that amax: the largest ``|x|`` of the activation
entering each NVFP4 layer over a few validation batches (compressed-tensors' ``static_minmax``
observer), which ``jax_nvfp4.export.export_hf(..., input_amax=...)`` writes as
``input_global_scale`` (compressed-tensors) or ``input_scale`` (ModelOpt).
:func:`validation_losses` says what serving W4A4 costs: the loss with bf16 weights, with the
NVFP4 weights (W4A16) and with the activations quantized too (W4A4), on the same batches.

The model runs unchanged, on one device, as evaluation runs it (weights dequantized to bf16,
GEMMs in the activation dtype), under Flax method interceptors on its ``NVFP4Dense`` layers. The values
cross the scanned blocks through the ``"nvfp4"`` variable collection, the one collection
besides the params that ``train.model``'s ``nn.scan`` stacks per layer: the interceptor writes
(calibration) or reads (W4A4) a variable ``input_amax`` there, which the layers themselves
never read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import jax_nvfp4 as nv
from jax_nvfp4 import numerics as nx
from jax_nvfp4.array import BLOCK_1D, dequantize, is_nvfp4, quantize
from jax_nvfp4.export import is_linear
from jax_nvfp4.nn import NVFP4_COLLECTION, NVFP4Dense
from jax_nvfp4.params import path_str
from jax_nvfp4.tensor_parallel import TensorParallel
from train.model import cross_entropy

__all__ = ["INPUT_AMAX", "calibrate", "calibration_batches", "for_run", "nvfp4_kernels", "validation_losses"]

# The variable (in the "nvfp4" collection, at each NVFP4Dense) that carries a layer's input amax.
INPUT_AMAX = "input_amax"


def _host(tree):
    """Host copies of ``tree``'s leaves in their logical form (sharded leaves gathered)."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    return jax.tree.map(one, nv.sharding.logical(tree))


def nvfp4_kernels(params) -> List[str]:
    """The param paths of the Linear kernels stored in NVFP4 (``blocks/attn/q/kernel``...)."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: is_nvfp4(x) or nv.layout.is_tiled(x))[0]
    return [path_str(p) for p, leaf in flat
            if isinstance(leaf, (nv.NVFP4Array, nv.TiledNVFP4)) and is_linear(path_str(p))]


def _eval_model(model):
    """``model`` as evaluation runs it on one device: dequantized weights, no remat or tensor axis."""
    return model.clone(compute="dequant", remat=None, tensor=TensorParallel())


def _as_float32(x) -> jax.Array:
    """``x`` in float32 exactly as its dtype holds it: bf16 through its bits (a plain
    convert pair bf16 -> f32 may be simplified away by XLA, which keeps the excess precision
    of the value before its rounding to bf16)."""
    if x.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(jnp.float32)


def _is_dense_call(context, args) -> bool:
    return context.method_name == "__call__" and isinstance(context.module, NVFP4Dense) and len(args) >= 1


def _record(next_fun, args, kwargs, context):
    """Writes ``max |x|`` of the layer's input (in its dtype, as its matmul reads it)."""
    if _is_dense_call(context, args):
        m = context.module
        x = _as_float32(jnp.asarray(args[0]).astype(m.dtype))
        m.put_variable(NVFP4_COLLECTION, INPUT_AMAX, nx.abs_max(x, axis=None))
    return next_fun(*args, **kwargs)


def _quantize_inputs(next_fun, args, kwargs, context):
    """A layer with an ``input_amax`` gets its input quantized as a W4A4 kernel does: 1x16
    groups along the inputs, round to nearest, the calibrated global amax; then dequantized
    into the layer's own matmul (in its dtype, as for W4A16)."""
    if _is_dense_call(context, args) and context.module.has_variable(NVFP4_COLLECTION, INPUT_AMAX):
        m = context.module
        x = _as_float32(jnp.asarray(args[0]).astype(m.dtype))
        a = m.get_variable(NVFP4_COLLECTION, INPUT_AMAX)
        x = dequantize(quantize(x, block=BLOCK_1D, amax=a), jnp.float32)
        return next_fun(x, *args[1:], **kwargs)
    return next_fun(*args, **kwargs)


def _module_tree(values: Dict[str, Any]) -> Dict[str, Any]:
    """``{"blocks/attn/q/kernel": v}`` -> the nested ``{"blocks": {"attn": {"q": {INPUT_AMAX: v}}}}``."""
    flat = {tuple(path.split("/")[:-1]) + (INPUT_AMAX,): v for path, v in values.items()}
    return traverse_util.unflatten_dict(flat)


def calibrate(model, params, batches: Sequence[np.ndarray]) -> Dict[str, np.ndarray]:
    """The input amax of every NVFP4 Linear of ``model`` with ``params`` over ``batches``:
    ``{param path of the kernel: [*layers] float32}``, the largest ``|x|`` of the activation
    entering that layer (in the layer's dtype) over every token of every batch, each stacked
    layer its own.

    Args:
      model: a ``train.model.Llama`` (its ``compute``, ``remat`` and tensor axis do not matter:
        it runs as evaluation does, on one device).
      params: its params, stored or logical (NVFP4 kernels as trained).
      batches: ``[batch, seq_len + 1]`` token rows (the inputs are ``rows[:, :-1]``).
    """
    if not batches:
        raise ValueError("calibrate: no batches")
    host = _host(params)
    kernels = set(nvfp4_kernels(host))
    fmodel = _eval_model(model)
    weights = nv.dequantize_params(host, jnp.bfloat16)

    @jax.jit
    def amaxes(p, rows):
        with nn.intercept_methods(_record):
            _, state = fmodel.apply({"params": p}, rows[:, :-1], mutable=[NVFP4_COLLECTION])
        flat = traverse_util.flatten_dict(state[NVFP4_COLLECTION], sep="/")
        return {k[:-len(INPUT_AMAX)] + "kernel": v for k, v in flat.items() if k.endswith("/" + INPUT_AMAX)}

    out: Dict[str, np.ndarray] = {}
    for rows in batches:
        got = jax.device_get(amaxes(weights, jnp.asarray(rows)))
        for path, v in got.items():
            if path in kernels:
                out[path] = np.maximum(out[path], v) if path in out else np.asarray(v, np.float32)
    missing = sorted(kernels - set(out))
    if missing:
        raise ValueError(f"calibrate: no input recorded for the NVFP4 kernels {missing[:3]} (not NVFP4Dense layers?)")
    return {k: out[k] for k in sorted(out)}


def validation_losses(model, params, input_amax: Dict[str, Any], batches: Sequence[np.ndarray], *,
                      master=None) -> Dict[str, Optional[float]]:
    """Mean next-token loss on ``batches`` (each row's mean, averaged over every row in float64)
    three ways: ``"bf16"`` with the float ``master`` weights (the optimizer's masters, or any
    float params; None without them), ``"w4a16"`` with the NVFP4 weights as trained (what the
    run's evaluation computes), ``"w4a4"`` with the activation entering each NVFP4 Linear in
    ``input_amax`` also quantized (1x16 groups, round to nearest, that global amax), as a W4A4
    serving kernel computes it."""
    host = _host(params)
    fmodel = _eval_model(model)

    def row_losses(interceptor):
        @jax.jit
        def f(variables, rows):
            if interceptor is None:
                logits = fmodel.apply(variables, rows[:, :-1])
            else:
                with nn.intercept_methods(interceptor):
                    logits = fmodel.apply(variables, rows[:, :-1])
            return jax.vmap(cross_entropy)(logits, rows[:, 1:])
        return f

    def mean(f, variables):
        rows = [np.asarray(jax.device_get(f(variables, jnp.asarray(b))), np.float64) for b in batches]
        return float(np.mean(np.concatenate(rows)))

    plain, w4a4 = row_losses(None), row_losses(_quantize_inputs)
    weights = nv.dequantize_params(host, jnp.bfloat16)
    amax_tree = _module_tree({k: jnp.asarray(v, jnp.float32) for k, v in input_amax.items()})
    out = {"bf16": None, "w4a16": mean(plain, {"params": weights}),
           "w4a4": mean(w4a4, {"params": weights, NVFP4_COLLECTION: amax_tree})}
    if master is not None:
        out["bf16"] = mean(plain, {"params": jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), _host(master))})
    return out


def calibration_batches(cfg, n: int) -> List[np.ndarray]:
    """``n`` validation batches of ``cfg`` (``data.batch_size`` rows each, every process the
    whole batch): the first of the ones the run's evaluation reads (``train.eval_batches``)."""
    from train import data as data_lib

    if n < 1:
        raise ValueError(f"calibration needs at least one batch, got {n}")
    source = data_lib.make_source(cfg.data, cfg.model, split="val")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=n))
    return data_lib.eval_batches(cfg, source)


def for_run(cfg, run: Dict[str, Any], n: int) -> Tuple[Dict[str, np.ndarray], Dict[str, Optional[float]]]:
    """``(input_amax, losses)`` of a finished ``train.loop.run`` of ``cfg`` over ``n``
    validation batches: :func:`calibrate`, then :func:`validation_losses` on the same batches
    (bf16: the run's float32 master weights)."""
    from train.model import from_config

    model = from_config(cfg.model, cfg.nvfp4)
    batches = calibration_batches(cfg, n)
    amax = calibrate(model, run["params"], batches)
    state = nv.find_state(run.get("opt_state"))
    losses = validation_losses(model, run["params"], amax, batches, master=None if state is None else state.master)
    return amax, losses
