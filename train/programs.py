"""The run's programs, built once per process: the state init, train step and evaluation (:mod:`train.step`) of a
config on a mesh, with the policy and layout of its state (:mod:`train.plan`), cached by :func:`program_key`; and the
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
from train.attention import check_cudnn
from train.config import Config, config_keys, validate_for_devices
from train.model import from_config
from train.optimizer import make_optimizer
from train.plan import policy_for, rules_for
from train.step import make_eval, make_step


@dataclasses.dataclass
class Trainer:
    """Everything a run needs, built once from a config and a mesh: the model, where its state lives, the jitted state
    init (``init_fn(key) -> (params, opt_state)``), train step and evaluation (:func:`train.step.make_eval`)."""

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
    # Derived once from the programs (accounting.compiled_step, faults.scaled_step), shared by the plan's trainers.
    derived: Dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


def program_key(cfg: Config) -> tuple:
    """``(section.key, value)`` of every key the compiled programs depend on (``train.config.setting``'s
    ``program_key``; ``optim.schedule_steps`` resolved stands for ``train.steps``): equal keys on one mesh build the
    same programs."""
    resolved = {"optim.schedule_steps": cfg.schedule_steps()}
    return tuple((k.key, resolved[k.key] if k.key in resolved else getattr(getattr(cfg, k.section), k.name))
                 for k in config_keys(type(cfg)) if k.program_key)


_PLANS: "collections.OrderedDict[tuple, Trainer]" = collections.OrderedDict()  # by (program_key, mesh), LRU first
PLANS_KEPT = 16


def _plan(cfg: Config, mesh) -> Trainer:
    """The programs of ``cfg`` on ``mesh``, jitted once per process: a resumed run or the next run of a sweep reuses
    their traces and executables."""
    key = (program_key(cfg), mesh)
    if key in _PLANS:
        _PLANS.move_to_end(key)
        return _PLANS[key]
    model = from_config(cfg.model, cfg.nvfp4)
    policy, rules = policy_for(cfg), rules_for(cfg, nv.rules.axis_size(mesh, "tensor"))
    tx = make_optimizer(cfg, rules, policy, mesh)
    tokens, state = jnp.zeros((1, cfg.model.seq_len), jnp.int32), nv.optim.state_init(tx, mesh, rules, policy)

    def create(rng):
        return state(jax.tree.map(lambda a: a.astype(jnp.float32), model.init({"params": rng}, tokens)["params"]))

    with jax.set_mesh(mesh):  # shapes and shardings only; the trace is cached for the jit below
        a_params, a_state = jax.eval_shape(create, jax.random.key(0))
    p_sh, s_sh = nv.shardings(a_params, mesh), nv.shardings(a_state, mesh)
    # jit with out_shardings: no unsharded copy of the state is materialised on one device.
    init_fn = jax.jit(create, out_shardings=(p_sh, s_sh))
    batch_sharding = NamedSharding(mesh, P(nv.step.batch_axes(mesh, rules)))
    step = jit_step(make_step(cfg, model, tx, rules, mesh), p_sh, s_sh, batch_sharding)
    _PLANS[key] = Trainer(cfg, mesh, model, policy, rules, tx, p_sh, s_sh, step, batch_sharding, a_params, a_state,
                          init_fn, make_eval(cfg, model, rules, mesh, batch_sharding))
    while len(_PLANS) > PLANS_KEPT:
        _PLANS.popitem(last=False)
    return _PLANS[key]


def jit_step(step, param_shardings, state_shardings, batch_sharding, *, extra_args: int = 0):
    """``step(params, opt_state, batch, key, *args)`` jitted where the run's state lives: params and optimizer state
    donated and returned in their shardings, the batch split, the key and ``extra_args`` more arguments replicated."""
    return jax.jit(step, in_shardings=(param_shardings, state_shardings, batch_sharding, None, *[None] * extra_args),
                   out_shardings=(param_shardings, state_shardings, None), donate_argnums=(0, 1))


def build(cfg: Config, mesh, *, init: bool = True) -> tuple:
    """``(trainer, params, opt_state)``, the state initialised from ``train.seed`` and sharded; with ``init=False`` only
    planned (``trainer.abstract_params`` / ``abstract_state``, e.g. to restore into) and ``params``/``opt_state`` are
    None. The programs are shared by every build with the same :func:`program_key` and mesh in this process."""
    validate_for_devices(cfg, mesh.size)
    if cfg.model.attention == "cudnn":
        check_cudnn(cfg.model.head_dim)
    trainer = dataclasses.replace(_plan(cfg, mesh), cfg=cfg)
    params = opt_state = None
    if init:
        with jax.set_mesh(mesh):
            params, opt_state = trainer.init_fn(jax.random.key(cfg.train.seed))
    return trainer, params, opt_state


def global_batch(trainer: Trainer, local: np.ndarray):
    global_shape = (trainer.cfg.data.batch_size, local.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, local, global_shape)
