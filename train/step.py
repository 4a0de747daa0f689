"""The compiled train step and what it is built from: which params are NVFP4 and where the
state lives (policy and rules), the state itself, the FSDP step, evaluation, and the bytes its
compiled HLO moves.

Reproducibility: every cross-device sum of floats in the step (gradients, the loss, the global
gradient norm) is a pure data movement (all-to-all / all-gather of the values' bits) followed
by a sum in a fixed order on each device. Results then do not depend on how the runtime
implements its reductions, so one process with 8 devices and two processes with 4 each (gloo)
train bit-identically. (Tensor-parallel partial sums inside the model stay XLA all-reduces;
keep each tensor group inside one process for the same guarantee.)
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4.collectives import LOSS_SCOPE
from train.config import Config, NVFP4Config, validate_for_devices
from train.model import KEPT_SEGMENTS, cross_entropy, from_config, tensor_rules
from train.optimizer import make_optimizer


# nvfp4.block: one scale per 16x16 tile, or per 16 consecutive inputs of an [in, out] kernel.
BLOCKS = {"2d": nv.BLOCK_2D, "1d": nv.BLOCK_COLUMN}


def policy_for(cfg: Config) -> nv.Policy:
    """Which params are NVFP4: everything the default policy takes, except the kept parts."""
    if cfg.nvfp4.weights == "bf16":
        return nv.Policy(keep=(".*",), keep_dtype=jnp.bfloat16)
    keep = tuple(cfg.nvfp4.keep_bf16) + tuple(f"^{seg}/" for seg in KEPT_SEGMENTS)
    return nv.Policy(keep=keep, keep_dtype=jnp.bfloat16, block=BLOCKS[cfg.nvfp4.resolved_block()])


def rules_for(cfg: Config, tensor: int = 1) -> nv.Rules:
    """Where the state lives. Scanned segments stack layers on axis 0. Large bf16 leaves
    (embeddings, head, the bf16 baseline's weights) are stored sharded and gathered like the
    NVFP4 ones, so the two weight formats are compared like for like.

    With ``mesh.layout: gb200`` (axes rack, data, tensor): ``mesh.sharding: fsdp`` shards the
    state over ``("data", "rack")``, racks minor, so a weight gather crosses racks first on
    1/I of the bytes and a gradient is summed inside the rack first; ``hsdp`` shards it over
    ``data`` (inside the rack) and replicates it across racks. ``tensor``: the tensor axis's
    size (which kernels it splits: :func:`train.model.tensor_rules`)."""
    common = dict(tensor_axis="tensor", tensor=tensor_rules(cfg.model.n_kv_heads, tensor), stacked=(r"^blocks",))
    if cfg.mesh.layout != "gb200":
        return nv.Rules(data_axis="data", **common)
    if cfg.mesh.sharding == "hsdp":
        return nv.Rules(data_axis="data", replica_axis="rack", **common)
    return nv.Rules(data_axis=("data", "rack"), **common)


def batch_axes(mesh, rules: nv.Rules) -> tuple:
    """The mesh axes the batch rows are split over, in mesh order (racks first: each
    process's devices hold consecutive rows)."""
    return tuple(a for a in mesh.axis_names if a in rules.batch_axes)


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
    everything but what only the host loop reads (the data's source, files, split and seed;
    logging, evaluation cadence, output; checkpoints; what the host does about skipped steps:
    a non-finite step is skipped on the device either way; the number of steps, where the
    learning-rate schedule's length is the same). Equal keys on one mesh build the same
    programs."""
    host = NVFP4Config()
    nvfp4 = dataclasses.replace(cfg.nvfp4, nonfinite=host.nonfinite, max_skipped_in_a_row=host.max_skipped_in_a_row)
    optim = dataclasses.replace(cfg.optim, schedule_steps=cfg.schedule_steps())
    return (cfg.model, cfg.mesh, optim, nvfp4, cfg.data.batch_size, cfg.train.seed, cfg.train.remat)


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
    policy, rules = policy_for(cfg), rules_for(cfg, nv.layout.axis_size(mesh, "tensor"))
    tx = make_optimizer(cfg, rules, policy, mesh)
    create = _state_fn(cfg, model, policy, rules, tx, mesh)
    (a_params, a_state), (p_sh, s_sh) = abstract_state(create, mesh)
    # jit with out_shardings: no unsharded copy of the state is materialised on one device.
    init_fn = jax.jit(create, out_shardings=(p_sh, s_sh))
    batch_sharding = NamedSharding(mesh, P(batch_axes(mesh, rules)))
    step = jax.jit(
        make_step(cfg, model, tx, rules, mesh),
        in_shardings=(p_sh, s_sh, batch_sharding, None, None),
        out_shardings=(p_sh, s_sh, None),
        donate_argnums=(0, 1),
    )
    _PLANS[key] = Trainer(cfg, mesh, model, policy, rules, tx, p_sh, s_sh, step, batch_sharding, a_params, a_state,
                          init_fn, make_eval(cfg, model, rules, mesh, batch_sharding))
    while len(_PLANS) > PLANS_KEPT:
        _PLANS.popitem(last=False)
    return _PLANS[key]


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


def _tensor(mesh, rules: nv.Rules) -> nv.TensorParallel:
    """The mesh's tensor axis as the model sees it inside the step's ``shard_map``."""
    size = nv.layout.axis_size(mesh, rules.tensor_axis)
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


# ----------------------------------------------------------------------------- accounting
def abstract_step_args(trainer: Trainer) -> tuple:
    """``(params, opt_state, batch, key)`` of ``trainer.step_fn`` as sharded ShapeDtypeStructs:
    with the loss scale the caller appends (a float32, or ``None`` for the constant 1), enough
    to lower and compile the run's step ahead of time without allocating anything."""
    sds = lambda t, s: jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t, s)
    cfg = trainer.cfg
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    return (sds(trainer.abstract_params, trainer.param_shardings), sds(trainer.abstract_state, trainer.state_shardings),
            batch, jax.eval_shape(lambda: jax.random.key(0)))


def compiled_step(trainer: Trainer) -> Dict[str, Any]:
    """What the compiled step is, read once per plan and shared by every run of it (the CLI's
    accounting, the benchmarks): ``text`` (its HLO), ``program`` (that text parsed by
    :func:`jax_nvfp4.comm.parse` with the trainer's mesh: each collective's mesh axes) and
    ``memory`` (``compiled.memory_analysis()`` per device: ``temp``, ``argument``, ``output``
    and ``alias`` bytes, None where the backend does not say). The step is lowered from
    :func:`abstract_step_args` with a float32 loss scale: the program the loop runs."""
    if "step" not in trainer.derived:
        compiled = trainer.step_fn.lower(*abstract_step_args(trainer), np.float32(1)).compile()
        text = compiled.as_text()
        mem = compiled.memory_analysis()
        trainer.derived["step"] = {
            "text": text,
            "program": nv.comm.parse(text, trainer.mesh, data_axes=trainer.rules.batch_axes),
            "memory": {k: (getattr(mem, f"{k}_size_in_bytes", None) if mem is not None else None)
                       for k in ("temp", "argument", "output", "alias")},
        }
    return trainer.derived["step"]


def gather_accounting(trainer: Trainer) -> Dict[str, Any]:
    """Bytes per step read from the compiled step's HLO, per device: the weight gathers
    (``jax_nvfp4.comm.Program.weight_gathers``), every collective by ``op:dtype``, and XLA's
    temporary buffer size; ``step_program``: the compiled step read by
    :func:`jax_nvfp4.comm.parse` with the mesh (each collective's mesh axes, groups, scopes)."""
    step = compiled_step(trainer)
    program = step["program"]
    return {
        **program.weight_gathers(),
        "collectives": {f"{op}:{dt}": b for (op, dt), b in program.by("op", "dtype").items()},
        "temp_bytes": step["memory"]["temp"],
        "step_program": program,
    }


# ----------------------------------------------------------------------------- batches
def global_batch(trainer: Trainer, local: np.ndarray):
    global_shape = (trainer.cfg.data.batch_size, local.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, local, global_shape)
