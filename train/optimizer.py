"""The optimizer a run trains with, from its config: the learning-rate schedule, the optax optimizer
(with fixed-order global-norm clipping) and ``jax_nvfp4.master_weights`` around it."""

from __future__ import annotations

import jax
import optax

import jax_nvfp4 as nv
from train.config import Config


def schedule_for(cfg: Config):
    """The learning rate over ``optim.schedule_steps`` (default train.steps): an extended run keeps
    its checkpoint's length (train.checkpoint.check_resume)."""
    o, steps = cfg.optim, cfg.schedule_steps()
    warm = min(o.warmup_steps, max(steps - 1, 0))  # only the default warmup can exceed the schedule (train.config)
    n = max(steps - warm, 1)
    decay = {"constant": optax.constant_schedule(o.lr), "linear": optax.linear_schedule(o.lr, 0.0, n)}.get(
        o.schedule, optax.cosine_decay_schedule(o.lr, n, alpha=0.1))
    return decay if warm == 0 else optax.join_schedules([optax.linear_schedule(0.0, o.lr, warm), decay], [warm])


def make_optimizer(cfg: Config, rules: nv.Rules, policy: nv.Policy, mesh) -> optax.GradientTransformation:
    """``optim``'s optax optimizer (clipping sums the global norm in a fixed order over ``mesh``), applied to the
    masters of :func:`jax_nvfp4.master_weights`."""
    o = cfg.optim
    make, kw = {"adamw": (optax.adamw, dict(b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)),
                "adam": (optax.adam, dict(b1=o.b1, b2=o.b2)),
                "lion": (optax.lion, dict(b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))}.get(
        o.name, (optax.sgd, dict(momentum=o.b1)))
    opt = optax.inject_hyperparams(make)(learning_rate=schedule_for(cfg), **kw)
    if o.clip_norm > 0:
        opt = optax.chain(nv.optim.clip_by_global_norm(o.clip_norm, mesh, rules), opt)
    return nv.master_weights(opt, policy=policy, mesh=mesh, rules=rules,
                             stochastic_rounding=cfg.nvfp4.stochastic_rounding, key=jax.random.key(cfg.train.seed + 1),
                             cast_master_bf16=cfg.nvfp4.cast_master_bf16)
