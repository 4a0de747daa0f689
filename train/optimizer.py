"""The optimizer a run trains with, from its config: the learning-rate schedule, the optax
optimizer (with fixed-order global-norm clipping) and the ``jax_nvfp4.master_weights`` wrapper
that keeps the float32 masters and re-quantizes the stored weights."""

from __future__ import annotations

from typing import Optional

import jax
import optax

import jax_nvfp4 as nv
from train.config import Config


def schedule_for(cfg: Config):
    # The schedule's own length (optim.schedule_steps, default train.steps): an extended run
    # keeps the length its checkpoint was trained with (see train.checkpoint.check_resume).
    o, steps = cfg.optim, cfg.schedule_steps()
    warm = min(o.warmup_steps, max(steps - 1, 0))  # only the default warmup can exceed the schedule (train.config)
    if o.schedule == "constant":
        decay = optax.constant_schedule(o.lr)
    elif o.schedule == "linear":
        decay = optax.linear_schedule(o.lr, 0.0, max(steps - warm, 1))
    else:
        decay = optax.cosine_decay_schedule(o.lr, max(steps - warm, 1), alpha=0.1)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warm), decay], [warm])


def inner_optimizer(cfg: Config, mesh=None, rules: Optional[nv.Rules] = None) -> optax.GradientTransformation:
    """The optax optimizer the wrapper applies to the masters. With ``mesh``, gradient
    clipping sums the global norm in a fixed order (:func:`clip_by_global_norm`)."""
    o = cfg.optim
    lr = schedule_for(cfg)
    if o.name == "adamw":
        opt = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    elif o.name == "adam":
        opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr, b1=o.b1, b2=o.b2)
    elif o.name == "lion":
        opt = optax.inject_hyperparams(optax.lion)(learning_rate=lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    else:
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=o.b1)
    if o.clip_norm > 0:
        opt = optax.chain(nv.optim.clip_by_global_norm(o.clip_norm, mesh, rules), opt)
    return opt


def make_optimizer(cfg: Config, rules: nv.Rules, policy: nv.Policy, mesh) -> optax.GradientTransformation:
    return nv.master_weights(
        inner_optimizer(cfg, mesh, rules),
        policy=policy,
        mesh=mesh,
        rules=rules,
        stochastic_rounding=cfg.nvfp4.stochastic_rounding,
        key=jax.random.key(cfg.train.seed + 1),
        cast_master_bf16=cfg.nvfp4.cast_master_bf16,
    )
