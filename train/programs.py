"""The run's programs, built once per process: the state init, the train step and evaluation
(:mod:`train.step`) of a config on a mesh, with the policy and layout of its state
(:mod:`train.plan`), cached by what the programs depend on (:func:`program_key`); and the
global batch a process's rows make."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from train.config import Config, NVFP4Config, validate_for_devices
from train.model import from_config
from train.optimizer import make_optimizer
from train.plan import batch_axes, policy_for, rules_for
from train.step import make_eval, make_step


@dataclasses.dataclass
class Trainer:
    """Everything a run needs, built once from a config and a mesh: the model, where its state
    lives, the jitted state init (``init_fn(key) -> (params, opt_state)``), train step and
    evaluation (``eval_fn``, see :func:`make_eval`)."""

    cfg: Config
    mesh: Any
    model: Any
    policy: nv.Policy
    rules: nv.Rules
    tx: Any
    param_shardings: Any
    state_shardings: Any
    step_fn: Any
    batch_sharding: Any
    abstract_params: Any = None
    abstract_state: Any = None
    init_fn: Any = None
    eval_fn: Any = None
    # What is read once from the compiled programs (:func:`compiled_step`), shared by every
    # trainer of the same plan.
    derived: Dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


def _state_fn(cfg: Config, model, policy, rules, tx, mesh):
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)

    def create(key):
        fp32 = model.init({"params": key}, tokens)["params"]
        fp32 = jax.tree.map(lambda a: a.astype(jnp.float32), fp32)
        params = nv.shard_params(nv.quantize_params(fp32, policy), mesh, rules)
        return params, tx.init(fp32)

    return create


def abstract_state(create, mesh):
    """``((params, opt_state) as ShapeDtypeStructs, (param_shardings, state_shardings))`` of
    the state init ``create`` (:func:`_state_fn`), without computing anything: what it creates,
    and where. Its trace is cached: jitting the same ``create`` does not trace it again."""
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(create, jax.random.key(0))
    shard = (nv.shardings(abstract[0], mesh), nv.shardings(abstract[1], mesh))
    return abstract, shard


def program_key(cfg: Config) -> tuple:
    """The part of ``cfg`` that the compiled programs (init, step, evaluation) depend on:
    ``(section.key, value)`` of each key ``train.config`` declares part of it (its trajectory
    and program keys), that is everything but what only the host loop reads (the data's source,
    files, split and seed; the weights a run starts from; logging, evaluation cadence, output;
    checkpoints; what the host does about skipped steps: a non-finite step is skipped on the
    device either way; the number of steps, where the learning-rate schedule's length is the
    same: ``optim.schedule_steps`` resolved stands for it) and the XLA flags of the process.
    Equal keys on one mesh build the same programs."""
    from train.config import config_keys

    resolved = {"optim.schedule_steps": cfg.schedule_steps()}
    return tuple((k.key, resolved[k.key] if k.key in resolved else getattr(getattr(cfg, k.section), k.name))
                 for k in config_keys(type(cfg)) if k.program_key)


# The programs built in this process, by (program_key, mesh), least recently used first.
_PLANS: "collections.OrderedDict[tuple, Trainer]" = collections.OrderedDict()
PLANS_KEPT = 16


def _plan(cfg: Config, mesh) -> Trainer:
    """The programs of ``cfg`` on ``mesh``, jitted once per process: a run that builds them
    again (a resumed run, the next run of a sweep) reuses their traces and compiled
    executables instead of tracing, lowering and compiling them anew."""
    key = (program_key(cfg), mesh)
    if key in _PLANS:
        _PLANS.move_to_end(key)
        return _PLANS[key]
    model = from_config(cfg.model, cfg.nvfp4)
    policy, rules = policy_for(cfg), rules_for(cfg, nv.rules.axis_size(mesh, "tensor"))
    tx = make_optimizer(cfg, rules, policy, mesh)
    create = _state_fn(cfg, model, policy, rules, tx, mesh)
    (a_params, a_state), (p_sh, s_sh) = abstract_state(create, mesh)
    # jit with out_shardings: no unsharded copy of the state is materialised on one device.
    init_fn = jax.jit(create, out_shardings=(p_sh, s_sh))
    batch_sharding = NamedSharding(mesh, P(batch_axes(mesh, rules)))
    step = jit_step(make_step(cfg, model, tx, rules, mesh), p_sh, s_sh, batch_sharding)
    _PLANS[key] = Trainer(cfg, mesh, model, policy, rules, tx, p_sh, s_sh, step, batch_sharding, a_params, a_state,
                          init_fn, make_eval(cfg, model, rules, mesh, batch_sharding))
    while len(_PLANS) > PLANS_KEPT:
        _PLANS.popitem(last=False)
    return _PLANS[key]


def jit_step(step, param_shardings, state_shardings, batch_sharding, *, extra_args: int = 0):
    """``step(params, opt_state, batch, key, *args)`` (:func:`train.step.make_step`) jitted
    where the run's state lives: params and optimizer state donated and returned in their
    shardings, the batch split over the batch axes, the key and the ``extra_args`` further
    arguments replicated."""
    return jax.jit(step, in_shardings=(param_shardings, state_shardings, batch_sharding, None, *[None] * extra_args),
                   out_shardings=(param_shardings, state_shardings, None), donate_argnums=(0, 1))


def build(cfg: Config, mesh, *, init: bool = True) -> tuple:
    """``(trainer, params, opt_state)``: float32 init -> stored NVFP4 params and master-weight
    state (from ``train.seed``), sharded. With ``init=False`` the state is only planned
    (``trainer.abstract_params`` / ``abstract_state``) and ``params``/``opt_state`` are None,
    e.g. to restore a checkpoint into. The programs are shared by every build with the same
    :func:`program_key` and mesh in this process."""
    validate_for_devices(cfg, mesh.size)
    trainer = dataclasses.replace(_plan(cfg, mesh), cfg=cfg)
    params = opt_state = None
    if init:
        with jax.set_mesh(mesh):
            params, opt_state = trainer.init_fn(jax.random.key(cfg.train.seed))
    return trainer, params, opt_state


def global_batch(trainer: Trainer, local: np.ndarray):
    global_shape = (trainer.cfg.data.batch_size, local.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, local, global_shape)
