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
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4.collectives import LOSS_SCOPE
from train.config import Config
from train.model import cross_entropy
from train.plan import batch_axes


def _tensor(mesh, rules: nv.Rules) -> nv.TensorParallel:
    """The mesh's tensor axis as the model sees it inside the step's ``shard_map``."""
    size = nv.rules.axis_size(mesh, rules.tensor_axis)
    return nv.TensorParallel(rules.tensor_axis if size > 1 else None, size)


def _sharded_model(cfg: Config, model, rules: nv.Rules, mesh, *, train: bool):
    """``(forward, tensor)``: ``forward(params, masters, tokens, rngs)`` -> this device's
    logits (its vocabulary columns), to run inside a ``shard_map`` manual over every mesh
    axis (its specs: ``nv.partition_specs``), and the tensor axis the model runs with.

    Every parameter reaches the model as a :class:`jax_nvfp4.nn.ParamShard`; the layer that
    uses it all-gathers its packed bytes over the data axes there, inside the scan over
    layers. A weight split over the tensor axis is this rank's own tile-major matrix: its
    gather crosses the data axes only (1/t of the layer's bytes). ``masters=None``
    (evaluation): forward only."""
    wdtype = jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else jnp.bfloat16
    tensor = _tensor(mesh, rules)
    gather_cfg = nv.GatherConfig(rules.data_axis, wdtype, packed=cfg.nvfp4.param_gather == "packed",
                                 replica_axis=rules.replica_axis, tensor_axis=tensor.axis)
    fmodel = model.clone(remat=cfg.train.remat if train else None, tensor=tensor)

    def forward(params, masters, tokens, rngs=None):
        if masters is None:
            masters = jax.tree.map(lambda _: None, params, is_leaf=nv.is_tiled)
        shards = jax.tree.map(lambda s, m: nv.ParamShard(s, m, gather_cfg), params, masters, is_leaf=nv.is_tiled)
        return fmodel.apply({"params": shards}, tokens, rngs=rngs)

    return forward, tensor


def make_step(cfg: Config, model, tx, rules, mesh):
    """The train step ``step(params, opt_state, batch, key, loss_scale=None)``: FSDP one
    layer at a time, times Megatron tensor parallelism with sequence parallelism.

    The loss and its gradients are computed inside one ``shard_map`` manual over every mesh
    axis (rack, data, tensor): each data shard runs its own rows, each tensor rank its part
    of every layer (:mod:`jax_nvfp4.tensor_parallel`: heads and MLP columns, the vocabulary
    of the embedding, head and loss; the residual stream split along the sequence between
    blocks). Every parameter reaches the model as a :class:`jax_nvfp4.nn.ParamShard`; the
    layer that uses it all-gathers its packed bytes over the data axes there, inside the scan
    over layers, and the scanned blocks are rematerialised, so no device holds more than one
    layer's weights (a tensor-split weight: its 1/t). The gather's VJP reduce-scatters each
    layer's weight gradient straight into this device's master shard, summed in a fixed
    order over the data axes (and over the tensor axis for weights every tensor rank holds,
    e.g. norm scales): bit-identical for any process layout of the same mesh. Then the
    ``master_weights`` optimizer updates and re-quantizes each shard in place.

    ``loss_scale`` (step argument): a float32 scalar multiplying the loss, 1.0 in training; a
    fault-injection hook (NaN/Inf make that step's gradients non-finite).

    A step whose loss or gradients are not all finite changes nothing and is counted in
    ``metrics["skipped"]`` (``master_weights``); the host decides what to do about it.
    """
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"
    accum = cfg.optim.grad_accum
    data_axes = batch_axes(mesh, rules)
    forward, tensor = _sharded_model(cfg, model, rules, mesh, train=True)

    def local(params, masters, rows, key, loss_scale):
        key = jax.random.fold_in(key, jax.lax.axis_index(data_axes))
        if tensor.on:  # stochastic rounding draws differ between tensor ranks' operands
            key = jax.random.fold_in(key, tensor.index())
        inputs, targets = rows[:, :-1], rows[:, 1:]

        def loss_fn(masters, inp, tgt, k):
            logits = forward(params, masters, inp, {"rounding": k} if nvfp4_compute else None)
            return cross_entropy(logits, tgt, tensor) * loss_scale

        grad_fn = jax.value_and_grad(loss_fn)
        if accum == 1:
            loss, grads = grad_fn(masters, inputs, targets, key)
        else:
            b = inputs.shape[0] // accum
            micro = lambda a: a.reshape(accum, b, *a.shape[1:])

            def body(carry, xs):
                i, inp, tgt = xs
                l, g = grad_fn(masters, inp, tgt, jax.random.fold_in(key, i))
                return jax.tree.map(jnp.add, carry, (l, g)), None

            zero = jax.tree.map(jnp.zeros_like, (jnp.zeros([], jnp.float32), masters))
            (loss, grads), _ = jax.lax.scan(body, zero, (jnp.arange(accum), micro(inputs), micro(targets)))
            loss, grads = loss / accum, jax.tree.map(lambda g: g / np.float32(accum), grads)
        with jax.named_scope(LOSS_SCOPE):
            return nv.ordered_mean(loss, data_axes), grads

    def step(params, opt_state, batch, key, loss_scale=None):
        scale = jnp.float32(1) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
        masters = nv.find_state(opt_state).master
        m_specs = nv.partition_specs(masters)
        loss, grads = jax.shard_map(
            local, mesh=mesh, in_specs=(nv.partition_specs(params), m_specs, P(data_axes), P(), P()), out_specs=(P(), m_specs),
            check_vma=False,
        )(params, masters, batch, key, scale)
        # A non-finite loss is a non-finite step even where its gradients are finite (e.g. a
        # target id past the vocabulary): master_weights skips and counts a step whose
        # gradients are not all finite, so the loss's verdict is folded into them.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "skipped": nv.find_state(opt_state).skipped}

    return step


# ----------------------------------------------------------------------------- evaluation
def make_eval(cfg: Config, model, rules: nv.Rules, mesh, batch_sharding):
    """``evaluate(params, batch) -> [batch] float32``: each row's mean next-token loss.

    Its own jitted program with the train step's per-layer machinery (one ``shard_map``
    manual over every mesh axis; each layer gathers its packed bytes inside the scan, so no
    device ever holds the whole model), forward only, with the recipe's GEMMs when
    ``nvfp4.compute=nvfp4`` (round to nearest: no rounding key). The per-row losses are
    all-gathered (as bits) and come back replicated; the host averages them in a fixed
    order, so the validation loss does not depend on how devices or processes sum.
    """
    data_axes = batch_axes(mesh, rules)
    forward, tensor = _sharded_model(cfg, model, rules, mesh, train=False)

    def local(params, rows):
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits = forward(params, None, inputs)
        losses = jax.vmap(lambda l, t: cross_entropy(l, t, tensor))(logits, targets)
        with jax.named_scope(LOSS_SCOPE):
            return nv.all_gather_bits(losses, data_axes, tiled=True)

    def evaluate(params, batch):
        return jax.shard_map(local, mesh=mesh, in_specs=(nv.partition_specs(params), P(data_axes)), out_specs=P(),
                             check_vma=False)(params, batch)

    return jax.jit(evaluate, in_shardings=(None, batch_sharding), out_shardings=NamedSharding(mesh, P()))


def validation_loss(eval_fn, params, batches) -> float:
    """Mean loss over the validation ``batches`` (global arrays), summed on the host in order."""
    rows = [np.asarray(jax.device_get(eval_fn(params, b)), np.float64) for b in batches]
    return float(np.mean(np.concatenate(rows)))
