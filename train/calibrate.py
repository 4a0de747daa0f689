"""W4A4 calibration: :func:`calibrate` records each NVFP4 Linear's input amax (max ``|x|`` over validation batches,
compressed-tensors' ``static_minmax``) for ``export_hf(..., input_amax=...)``; :func:`validation_losses` says what
W4A4 costs. The model runs as evaluation does, on one device, under Flax interceptors on its ``NVFP4Dense`` layers;
the values cross the scanned blocks in the ``"nvfp4"`` collection (``nn.scan`` stacks it; the layers never read it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
    whole = lambda x: (multihost_utils.process_allgather(x, tiled=True)
                       if isinstance(x, jax.Array) and not x.is_fully_addressable else x)
    return jax.tree.map(lambda x: np.asarray(whole(x)), nv.sharding.logical(tree))


def nvfp4_kernels(params) -> List[str]:
    """The param paths of the Linear kernels stored in NVFP4 (``blocks/attn/q/kernel``...)."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: is_nvfp4(x) or nv.layout.is_tiled(x))[0]
    return [path_str(p) for p, leaf in flat
            if isinstance(leaf, (nv.NVFP4Array, nv.TiledNVFP4)) and is_linear(path_str(p))]


def _eval_model(model):
    """``model`` as evaluation runs it on one device: dequantized weights, no remat or tensor axis."""
    return model.clone(compute="dequant", remat=None, tensor=TensorParallel())


def _input(context, args) -> Optional[jax.Array]:
    """An ``NVFP4Dense`` call's input in float32 exactly as the layer's dtype holds it (None for other calls): bf16
    through its bits, as XLA may simplify a bf16 -> f32 convert pair away, keeping the excess precision."""
    if context.method_name != "__call__" or not isinstance(context.module, NVFP4Dense) or not args:
        return None
    x = jnp.asarray(args[0]).astype(context.module.dtype)
    if x.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(jnp.float32)


def _record(next_fun, args, kwargs, context):
    """Writes ``max |x|`` of the layer's input (in its dtype, as its matmul reads it)."""
    x = _input(context, args)
    if x is not None:
        context.module.put_variable(NVFP4_COLLECTION, INPUT_AMAX, nx.abs_max(x, axis=None))
    return next_fun(*args, **kwargs)


def _quantize_inputs(next_fun, args, kwargs, context):
    """A layer with an ``input_amax`` gets its input quantized (dequantized into its matmul) as W4A4 kernels do."""
    if context.module.has_variable(NVFP4_COLLECTION, INPUT_AMAX) and (x := _input(context, args)) is not None:
        a = context.module.get_variable(NVFP4_COLLECTION, INPUT_AMAX)
        return next_fun(dequantize(quantize(x, block=BLOCK_1D, amax=a), jnp.float32), *args[1:], **kwargs)
    return next_fun(*args, **kwargs)


def calibrate(model, params, batches: Sequence[np.ndarray]) -> Dict[str, np.ndarray]:
    """``{param path of each NVFP4 Linear kernel: [*layers] float32}``: the largest ``|x|`` entering it (in its
    dtype) over every token of ``batches`` (``[batch, seq_len + 1]`` token rows), run by ``model`` (a
    ``train.model.Llama``, run as evaluation runs it) with ``params`` (stored or logical)."""
    if not batches:
        raise ValueError("calibrate: no batches")
    host = _host(params)
    kernels, fmodel, weights = set(nvfp4_kernels(host)), _eval_model(model), nv.dequantize_params(host, jnp.bfloat16)

    @jax.jit
    def amaxes(p, rows):
        with nn.intercept_methods(_record):
            _, state = fmodel.apply({"params": p}, rows[:, :-1], mutable=[NVFP4_COLLECTION])
        flat = traverse_util.flatten_dict(state[NVFP4_COLLECTION], sep="/")
        return {k[:-len(INPUT_AMAX)] + "kernel": v for k, v in flat.items() if k.endswith("/" + INPUT_AMAX)}

    out: Dict[str, np.ndarray] = {}
    for rows in batches:
        for path, v in jax.device_get(amaxes(weights, jnp.asarray(rows))).items():
            if path in kernels:
                out[path] = np.maximum(out[path], v) if path in out else np.asarray(v, np.float32)
    missing = sorted(kernels - set(out))
    if missing:
        raise ValueError(f"calibrate: no input recorded for the NVFP4 kernels {missing[:3]} (not NVFP4Dense layers?)")
    return {k: out[k] for k in sorted(out)}


def validation_losses(model, params, input_amax: Dict[str, Any], batches: Sequence[np.ndarray], *,
                      master=None) -> Dict[str, Optional[float]]:
    """Mean next-token loss on ``batches`` (row means averaged in float64): ``"bf16"`` with the float ``master``
    weights (None without), ``"w4a16"`` with the NVFP4 weights (as the run evaluates), ``"w4a4"`` with each NVFP4
    Linear's input also quantized as a W4A4 kernel does (1x16 groups, round to nearest, its ``input_amax``)."""
    fmodel = _eval_model(model)

    @functools.partial(jax.jit, static_argnums=0)
    def row_losses(interceptor, variables, rows):
        with nn.intercept_methods(interceptor) if interceptor else contextlib.nullcontext():
            logits = fmodel.apply(variables, rows[:, :-1])
        return jax.vmap(cross_entropy)(logits, rows[:, 1:])

    def mean(interceptor, variables):
        rows = [np.asarray(jax.device_get(row_losses(interceptor, variables, jnp.asarray(b))), np.float64)
                for b in batches]
        return float(np.mean(np.concatenate(rows)))

    weights = nv.dequantize_params(_host(params), jnp.bfloat16)
    amax_tree = traverse_util.unflatten_dict({tuple(k.split("/")[:-1]) + (INPUT_AMAX,): jnp.asarray(v, jnp.float32)
                                              for k, v in input_amax.items()})
    out = {"bf16": None, "w4a16": mean(None, {"params": weights}),
           "w4a4": mean(_quantize_inputs, {"params": weights, NVFP4_COLLECTION: amax_tree})}
    if master is not None:
        out["bf16"] = mean(None, {"params": jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), _host(master))})
    return out


def calibration_batches(cfg, n: int) -> List[np.ndarray]:
    """The first ``n`` of the run's evaluation batches (``data.batch_size`` rows each, every process all of them)."""
    from train import data as data_lib
    if n < 1:
        raise ValueError(f"calibration needs at least one batch, got {n}")
    source = data_lib.make_source(cfg.data, cfg.model, split="val")
    return data_lib.eval_batches(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=n)), source)


def for_run(cfg, run: Dict[str, Any], n: int) -> Tuple[Dict[str, np.ndarray], Dict[str, Optional[float]]]:
    """``(input_amax, losses)`` of a finished ``train.loop.run`` of ``cfg``, on ``n`` validation batches."""
    from train.model import from_config
    model = from_config(cfg.model, cfg.nvfp4)
    batches = calibration_batches(cfg, n)
    amax = calibrate(model, run["params"], batches)
    state = nv.find_state(run.get("opt_state"))
    return amax, validation_losses(model, run["params"], amax, batches, master=None if state is None else state.master)
