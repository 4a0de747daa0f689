"""W4A4 calibration of a run's Llama on :mod:`jax_nvfp4.calibrate`: :func:`calibrate` records each NVFP4 Linear's
input amax over validation batches for ``export_hf(..., input_amax=...)``; :func:`validation_losses` says what W4A4
costs. The model runs as evaluation does, on one device."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as nv
from jax_nvfp4 import calibrate as w4a4
from jax_nvfp4.tensor_parallel import TensorParallel
from train import data as data_lib
from train.model import cross_entropy, from_config
from train.step import validation_loss

__all__ = ["calibrate", "calibration_batches", "for_run", "validation_losses"]


def _eval_model(model):
    """``model`` as evaluation runs it on one device: dequantized weights, no remat or tensor axis."""
    return model.clone(compute="dequant", remat=None, tensor=TensorParallel())


def calibrate(model, params, batches: Sequence[np.ndarray]) -> Dict[str, np.ndarray]:
    """``{param path of each NVFP4 Linear kernel: [*layers] float32}``: the largest ``|x|`` entering it (in its
    dtype) over every token of ``batches`` (``[batch, seq_len + 1]`` token rows), run by ``model`` (a
    ``train.model.Llama``, run as evaluation runs it) with ``params`` (stored or logical)."""
    apply = _eval_model(model).apply
    return w4a4.input_amax(lambda variables, rows, **kw: apply(variables, rows[:, :-1], **kw), params, batches)


def validation_losses(model, params, input_amax: Dict[str, Any], batches: Sequence[np.ndarray], *,
                      master=None) -> Dict[str, Optional[float]]:
    """Mean next-token loss on ``batches`` (row means averaged in float64): ``"bf16"`` with the float ``master``
    weights (None without), ``"w4a16"`` with the NVFP4 weights (as the run evaluates), ``"w4a4"`` with each NVFP4
    Linear's input also quantized as a W4A4 kernel does (1x16 groups, round to nearest, its ``input_amax``)."""
    fmodel = _eval_model(model)

    @functools.partial(jax.jit, static_argnums=0)
    def row_losses(quantized, variables, rows):
        with w4a4.quantized_inputs() if quantized else contextlib.nullcontext():
            logits = fmodel.apply(variables, rows[:, :-1])
        return jax.vmap(cross_entropy)(logits, rows[:, 1:])

    def mean(quantized, variables):
        return validation_loss(functools.partial(row_losses, quantized), variables, [jnp.asarray(b) for b in batches])

    weights = w4a4.float_weights(params)
    return {"bf16": None if master is None else mean(False, {"params": w4a4.float_weights(master)}),
            "w4a16": mean(False, {"params": weights}),
            "w4a4": mean(True, w4a4.with_input_amax({"params": weights}, input_amax))}


def calibration_batches(cfg, n: int) -> List[np.ndarray]:
    """The first ``n`` of the run's evaluation batches (``data.batch_size`` rows each, every process all of them);
    ``n`` < 1 raises ``train.eval_batches``' ConfigError."""
    source = data_lib.make_source(cfg.data, cfg.model, split="val")
    return data_lib.eval_batches(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=n)), source)


def for_run(cfg, run: Dict[str, Any], n: int) -> Tuple[Dict[str, np.ndarray], Dict[str, Optional[float]]]:
    """``(input_amax, losses)`` of a finished ``train.loop.run`` of ``cfg``, on ``n`` validation batches."""
    model = from_config(cfg.model, cfg.nvfp4)
    batches = calibration_batches(cfg, n)
    amax = calibrate(model, run["params"], batches)
    state = nv.find_state(run.get("opt_state"))
    return amax, validation_losses(model, run["params"], amax, batches, master=None if state is None else state.master)
