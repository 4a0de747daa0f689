"""The train step and evaluation: one ``shard_map`` manual over every mesh axis, FSDP one
layer at a time times Megatron tensor and sequence parallelism.

Reproducibility: every cross-device sum of floats in the step (gradients, the loss, the global
gradient norm, the tensor-parallel activations) is a pure data movement (all-to-all /
all-gather of the values' bits) followed by a sum in a fixed order on each device. Results
then do not depend on how the runtime implements its reductions, so one process with 8 devices
and two processes with 4 each (gloo) train bit-identically, with or without a tensor axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from train.config import Config
from train.model import cross_entropy


def _options(cfg: Config) -> dict:
    """How the library's step gathers this run's weights: dtype, packed or dequantized, and
    manual tensor parallelism (the model writes its own Megatron collectives)."""
    wdtype = jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else jnp.bfloat16
    return dict(dtype=wdtype, packed=cfg.nvfp4.param_gather == "packed", tensor="manual")


def loss_fn_for(cfg: Config, model, mesh, rules: nv.Rules):
    """The run's loss ``loss(params, rows, key) -> scalar``: the mean next-token cross entropy
    of this device's ``rows`` (each row's tokens predict the next), the ``loss_fn`` that
    :func:`make_step` differentiates. The model runs written for manual tensor parallelism:
    each tensor rank runs its part of every layer (:mod:`jax_nvfp4.tensor_parallel`: heads and
    MLP columns, the vocabulary of the embedding, head and loss; the residual stream split
    along the sequence between blocks), its scanned blocks rematerialised (``train.remat``);
    ``key`` drives the recipe GEMMs' stochastic rounding (``nvfp4.compute=nvfp4``)."""
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"
    tensor = nv.step.tensor_parallel(mesh, rules)
    fmodel = model.clone(remat=cfg.train.remat, tensor=tensor)

    def loss_fn(params, rows, key):
        logits = fmodel.apply({"params": params}, rows[:, :-1], rngs={"rounding": key} if nvfp4_compute else None)
        return cross_entropy(logits, rows[:, 1:], tensor)

    return loss_fn


def make_step(cfg: Config, model, tx, rules: nv.Rules, mesh, loss_fn=None):
    """The train step ``step(params, opt_state, batch, key)``: the library's sharded step
    (:func:`jax_nvfp4.make_step`: FSDP one layer at a time, the gathers' VJPs reducing each
    layer's weight gradient into this device's master tiles in a fixed order) on the run's
    loss (:func:`loss_fn_for`), or on ``loss_fn(params, rows, key, *args)``, whose extra
    arguments the step then takes after ``key``."""
    if loss_fn is None:
        loss_fn = loss_fn_for(cfg, model, mesh, rules)
    return nv.make_step(loss_fn, tx, mesh, rules, grad_accum=cfg.optim.grad_accum, **_options(cfg))


# ----------------------------------------------------------------------------- evaluation
def make_eval(cfg: Config, model, rules: nv.Rules, mesh, batch_sharding):
    """``evaluate(params, batch) -> [batch] float32``: each row's mean next-token loss.

    The library's evaluation (:func:`jax_nvfp4.make_eval`: the step's per-layer gathers,
    forward only, so no device ever holds the whole model), with the recipe's GEMMs when
    ``nvfp4.compute=nvfp4`` (round to nearest: no rounding key). The per-row losses come back
    replicated; the host averages them in a fixed order, so the validation loss does not
    depend on how devices or processes sum.
    """
    tensor = nv.step.tensor_parallel(mesh, rules)
    fmodel = model.clone(remat=None, tensor=tensor)

    def row_losses(params, rows):
        logits = fmodel.apply({"params": params}, rows[:, :-1])
        return jax.vmap(lambda l, t: cross_entropy(l, t, tensor))(logits, rows[:, 1:])

    evaluate = nv.make_eval(row_losses, mesh, rules, **_options(cfg))
    return jax.jit(evaluate, in_shardings=(None, batch_sharding), out_shardings=NamedSharding(mesh, P()))


def validation_loss(eval_fn, params, batches) -> float:
    """Mean loss over the validation ``batches`` (global arrays), summed on the host in order."""
    rows = [np.asarray(jax.device_get(eval_fn(params, b)), np.float64) for b in batches]
    return float(np.mean(np.concatenate(rows)))
