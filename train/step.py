"""The train step and evaluation: one ``shard_map`` manual over every mesh axis, FSDP one layer at a
time times Megatron tensor and sequence parallelism. Every cross-device float sum is a movement of
bits then a fixed-order sum on each device, so any process layout of a mesh trains bit-identically."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from train.config import Config
from train.model import cross_entropy


def _options(cfg: Config) -> dict:
    """How the library's step gathers this run's weights (the model writes its own tensor collectives)."""
    wdtype = jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else jnp.bfloat16
    return dict(dtype=wdtype, packed=cfg.nvfp4.param_gather == "packed", tensor="manual")


def loss_fn_for(cfg: Config, model, mesh, rules: nv.Rules):
    """``loss(params, rows, key) -> scalar``: the mean next-token cross entropy of this device's
    ``rows``, the model run for manual tensor parallelism (:mod:`jax_nvfp4.tensor_parallel`), its
    blocks rematerialised per ``train.remat``; ``key`` drives the recipe GEMMs' stochastic rounding."""
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"
    tensor = nv.step.tensor_parallel(mesh, rules)
    fmodel = model.clone(remat=cfg.train.remat, tensor=tensor)

    def loss_fn(params, rows, key):
        logits = fmodel.apply({"params": params}, rows[:, :-1], rngs={"rounding": key} if nvfp4_compute else None)
        return cross_entropy(logits, rows[:, 1:], tensor)
    return loss_fn


def make_step(cfg: Config, model, tx, rules: nv.Rules, mesh, loss_fn=None):
    """``step(params, opt_state, batch, key)``: :func:`jax_nvfp4.make_step` on :func:`loss_fn_for`,
    or on ``loss_fn(params, rows, key, *args)``, whose extra arguments the step takes after ``key``."""
    loss_fn = loss_fn or loss_fn_for(cfg, model, mesh, rules)
    return nv.make_step(loss_fn, tx, mesh, rules, grad_accum=cfg.optim.grad_accum, **_options(cfg))


def make_eval(cfg: Config, model, rules: nv.Rules, mesh, batch_sharding):
    """``evaluate(params, batch) -> [batch] float32``, each row's mean next-token loss, replicated
    (:func:`jax_nvfp4.make_eval`: the step's per-layer gathers, forward only, round to nearest)."""
    tensor = nv.step.tensor_parallel(mesh, rules)
    fmodel = model.clone(remat=None, tensor=tensor)

    def row_losses(params, rows):
        logits = fmodel.apply({"params": params}, rows[:, :-1])
        return jax.vmap(lambda l, t: cross_entropy(l, t, tensor))(logits, rows[:, 1:])
    evaluate = nv.make_eval(row_losses, mesh, rules, **_options(cfg))
    return jax.jit(evaluate, in_shardings=(None, batch_sharding), out_shardings=NamedSharding(mesh, P()))


def validation_loss(eval_fn, params, batches) -> float:
    """Mean loss over the validation ``batches``, summed on the host in order (independent of the mesh)."""
    rows = [np.asarray(jax.device_get(eval_fn(params, b)), np.float64) for b in batches]
    return float(np.mean(np.concatenate(rows)))
