"""The training loop: state creation, the jitted step, logging, outputs.

One screen of logic on top of the library's public API:
``quantize_params`` -> ``master_weights`` -> ``shardings`` -> a jitted step that ``gather``\\ s
packed bytes, dequantizes, runs the model and hands the gradients to the wrapper.

Reproducibility: by default every cross-device sum of floats in the step (gradients, the loss,
the global gradient norm) is a pure data movement (all-to-all / all-gather of the values' bits)
followed by a sum in a fixed order on each device (``grad_reduce="ordered"``). Results then do
not depend on how the runtime implements its reductions, so one process with 8 devices and two
processes with 4 each (gloo) train bit-identically. (Tensor-parallel partial sums inside the
model stay XLA all-reduces; keep each tensor group inside one process for the same guarantee.)
Checkpoints (``train.checkpoint``) make a stopped run resume bit-identically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from train import checkpoint as checkpoint_lib
from train import data as data_lib
from train.config import Config, validate_for_devices
from train.model import TENSOR_RULES, cross_entropy, from_config, nvfp4_collection


# ----------------------------------------------------------------------------- components
def policy_for(cfg: Config) -> nv.Policy:
    """Which params are NVFP4: everything the default policy takes, except the kept parts."""
    if cfg.nvfp4.weights == "bf16":
        return nv.Policy(keep=(".*",), keep_dtype=jnp.bfloat16)
    keep = tuple(cfg.nvfp4.keep_bf16) + ("^blocks_first/", "^blocks_last/")
    return nv.Policy(keep=keep, keep_dtype=jnp.bfloat16)


def rules_for(cfg: Config) -> nv.Rules:
    # Large bf16 leaves (embeddings, head, the bf16 baseline's weights) are stored sharded and
    # gathered like the NVFP4 ones, so the two weight formats are compared like for like.
    return nv.Rules(data_axis="data", tensor_axis="tensor", tensor=TENSOR_RULES, shard_params=True)


def schedule_for(cfg: Config):
    o, steps = cfg.optim, cfg.train.steps
    warm = min(o.warmup_steps, max(steps - 1, 0))
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
        opt = optax.chain(clip_by_global_norm(o.clip_norm, mesh, rules), opt)
    return opt


def make_optimizer(cfg: Config, rules: nv.Rules, policy: nv.Policy, mesh) -> optax.GradientTransformation:
    return nv.master_weights(
        inner_optimizer(cfg, mesh, rules),
        policy=policy,
        mesh=mesh,
        rules=rules,
        nonfinite=cfg.nvfp4.nonfinite,
        stochastic_rounding=cfg.nvfp4.stochastic_rounding,
        key=jax.random.key(cfg.train.seed + 1),
        cast_master_bf16=cfg.nvfp4.cast_master_bf16,
        grad_dtype=jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else None,
    )


# ----------------------------------------------------------------------------- ordered sums
def _axis_size(mesh, name: Optional[str]) -> int:
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)) if (mesh is not None and name) else 1


def _is_master(x) -> bool:
    return isinstance(x, nv.MasterArray)


# Name scope of the ordered reductions: their gathers move gradients, not parameters, and
# gather_accounting tells them apart by it (HLO op_name metadata).
REDUCE_SCOPE = "ordered_reduce"


def move_bits(x: jax.Array, sharding) -> jax.Array:
    """Reshard ``x`` as its bits (:func:`jax_nvfp4.sharding.reshard_bits`): the collective
    moves bytes only, so XLA can neither make it a reduction nor widen it, and every sum stays
    on the device in the order the program says."""
    return nv.sharding.reshard_bits(x, sharding)


def ordered_mean(stacked, masters, mesh, rules: nv.Rules):
    """Mean over the data shards of per-shard gradients, straight into the master layout.

    ``stacked``: params-structured tree of ``[n_data, *shape]`` gradients (row ``i`` from data
    shard ``i``, stored on it); ``masters``: the matching tree of :class:`MasterArray`.
    Each leaf is zero-padded to the master's padded shape, moved by an all-to-all so that each
    device holds every shard's rows of its own master shard (a reduce-scatter without the
    arithmetic), and summed over the shards in index order in float32.
    Returns a tree of ``MasterArray`` gradients, which ``master_weights(...).update`` accepts.
    """
    n = _axis_size(mesh, rules.data_axis)
    leaves_m, treedef = jax.tree.flatten(masters, is_leaf=_is_master)
    leaves_s = treedef.flatten_up_to(nv.partition_specs(masters, mesh, rules))
    leaves_g = treedef.flatten_up_to(stacked)
    out = []
    with jax.named_scope(REDUCE_SCOPE):
        for g, mw, ms in zip(leaves_g, leaves_m, leaves_s):
            out.append(_ordered_mean_leaf(g, mw, ms, n, mesh, rules))
    return treedef.unflatten(out)


def _ordered_mean_leaf(g, mw, ms, n: int, mesh, rules: nv.Rules):
    spec = tuple(ms.value)
    pad = [(0, 0)] + [(0, p - s) for p, s in zip(mw.value.shape, g.shape[1:])]
    if any(b for _, b in pad):
        g = jnp.pad(g, pad)
    src = P(rules.data_axis, *[None if e == rules.data_axis else e for e in spec])
    g = jax.lax.with_sharding_constraint(g, NamedSharding(mesh, src))
    # All-to-all into the master layout (an all-gather for masters kept replicated).
    g = move_bits(g, NamedSharding(mesh, P(None, *spec)))
    total = jnp.sum(g.astype(jnp.float32), axis=0) / np.float32(n)
    total = jax.lax.with_sharding_constraint(total, NamedSharding(mesh, P(*spec)))
    return nv.MasterArray(total, mw.shape, mw.data_dim, mw.tensor_dim, mw.nvfp4)


def _shard_sum_of_squares(mw, mesh, rules: nv.Rules) -> jax.Array:
    """``sum(value**2)`` of a master leaf: one partial sum per (data, tensor) shard, computed
    where the shard lives, then gathered (as bits) and added in a fixed order."""
    v = mw.value.astype(jnp.float32)
    split = {}
    for dim, ax in ((mw.data_dim, rules.data_axis), (mw.tensor_dim, rules.tensor_axis)):
        k = _axis_size(mesh, ax)
        if dim is not None and k > 1 and v.shape[dim] % k == 0:
            split[dim % v.ndim] = (ax, k)
    shape, spec, keep = [], [], []
    for d, s in enumerate(v.shape):
        if d in split:
            ax, k = split[d]
            keep.append(len(shape))
            shape += [k, s // k]
            spec += [ax, None]
        else:
            shape.append(s)
            spec.append(None)
    x = jax.lax.with_sharding_constraint(jnp.square(v).reshape(shape), NamedSharding(mesh, P(*spec)))
    part = jnp.sum(x, axis=tuple(i for i in range(len(shape)) if i not in keep))
    if keep:
        part = jax.lax.with_sharding_constraint(part, NamedSharding(mesh, P(*[spec[i] for i in keep])))
        part = move_bits(part, NamedSharding(mesh, P()))
    return jnp.sum(part)


def clip_by_global_norm(max_norm: float, mesh=None, rules: Optional[nv.Rules] = None) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` whose norm is summed in a fixed order across devices
    (for trees of :class:`MasterArray`, as the master-weight wrapper's inner transform sees);
    without ``mesh``, optax's own."""
    if mesh is None:
        return optax.clip_by_global_norm(max_norm)
    rules = rules or nv.Rules()

    def update_fn(updates, state, params=None):
        del params
        leaves = jax.tree.leaves(updates, is_leaf=_is_master)
        with jax.named_scope(REDUCE_SCOPE):
            sq = [_shard_sum_of_squares(x, mesh, rules) if _is_master(x) else jnp.sum(jnp.square(x.astype(jnp.float32)))
                  for x in leaves]
            g_norm = jnp.sqrt(sum(sq[1:], sq[0])) if sq else jnp.zeros([], jnp.float32)
        trigger = g_norm < max_norm
        clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


@dataclasses.dataclass
class Trainer:
    """Everything a run needs, built once from a config and a mesh."""

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


def _state_fn(cfg: Config, model, policy, tx):
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)

    def create(key):
        fp32 = model.init({"params": key}, tokens)["params"]
        fp32 = jax.tree.map(lambda a: a.astype(jnp.float32), fp32)
        return nv.quantize_params(fp32, policy), tx.init(fp32)

    return create


def abstract_state(cfg: Config, mesh, model, policy, rules, tx):
    """``((params, opt_state) as ShapeDtypeStructs, (param_shardings, state_shardings))``,
    without computing anything: what :func:`init_state` would create, and where."""
    create = _state_fn(cfg, model, policy, tx)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(create, jax.random.key(cfg.train.seed))
    shard = (nv.shardings(abstract[0], mesh, rules=rules), nv.shardings(abstract[1], mesh, rules=rules))
    return abstract, shard


def init_state(cfg: Config, mesh, model, policy, rules, tx):
    """Float32 init -> NVFP4 params and master-weight state, sharded (jit with out_shardings,
    so no unsharded copy of the state is materialised on one device)."""
    _, shard = abstract_state(cfg, mesh, model, policy, rules, tx)
    with jax.set_mesh(mesh):
        params, opt_state = jax.jit(_state_fn(cfg, model, policy, tx), out_shardings=shard)(jax.random.key(cfg.train.seed))
    return params, opt_state, shard


def build(cfg: Config, mesh, *, init: bool = True, grad_reduce: str = "ordered") -> tuple:
    """``(trainer, params, opt_state)``; with ``init=False`` the state is only planned
    (``trainer.abstract_params`` / ``abstract_state``) and ``params``/``opt_state`` are None,
    e.g. to restore a checkpoint into."""
    validate_for_devices(cfg, mesh.size)
    model = from_config(cfg.model, cfg.nvfp4)
    policy, rules = policy_for(cfg), rules_for(cfg)
    tx = make_optimizer(cfg, rules, policy, mesh)
    (a_params, a_state), (p_sh, s_sh) = abstract_state(cfg, mesh, model, policy, rules, tx)
    params = opt_state = None
    if init:
        params, opt_state, _ = init_state(cfg, mesh, model, policy, rules, tx)
    batch_sharding = NamedSharding(mesh, P("data"))
    step = make_step(cfg, model, tx, rules, mesh, grad_reduce=grad_reduce)
    step = jax.jit(
        step,
        in_shardings=(p_sh, s_sh, batch_sharding, None, None),
        out_shardings=(p_sh, s_sh, None),
        donate_argnums=(0, 1),
    )
    trainer = Trainer(cfg, mesh, model, policy, rules, tx, p_sh, s_sh, step, batch_sharding, a_params, a_state)
    return trainer, params, opt_state


def make_step(cfg: Config, model, tx, rules, mesh, *, grad_reduce: str = "auto"):
    """The train step ``step(params, opt_state, batch, key, loss_scale=None)``.

    Args:
      grad_reduce: how gradients and the loss are summed across the data axis.
        ``"ordered"`` (what :func:`build` uses): each data shard's gradients are computed on
        their own (``vmap`` over the shards), then moved by an all-to-all into the master
        layout and summed in shard order on the device (:func:`ordered_mean`): bit-identical
        results for any process layout and collective implementation.
        ``"auto"``: XLA's own all-reduces, placed inside the backward pass (layer by layer).
      loss_scale (step argument): a float32 scalar multiplying the loss, 1.0 in training; a
        fault-injection hook (NaN/Inf make that step's gradients non-finite).
    """
    if grad_reduce not in ("ordered", "auto"):
        raise ValueError(f"grad_reduce must be 'ordered' or 'auto', got {grad_reduce!r}")
    packed = cfg.nvfp4.param_gather == "packed"
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"
    # Gradients take the dtype of the weights they are taken against: float32 weights (cast
    # to bf16 inside the layers) make the cross-device gradient sum float32.
    wdtype = jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else jnp.bfloat16
    accum = cfg.optim.grad_accum
    n_data = _axis_size(mesh, rules.data_axis)

    def loss_fn(weights, qweights, inputs, targets, key, loss_scale):
        variables = {"params": weights}
        if qweights is not None:
            variables["nvfp4"] = qweights
        rngs = {"rounding": key} if (nvfp4_compute and key is not None) else None
        logits = model.apply(variables, inputs, rngs=rngs)
        loss = cross_entropy(logits, targets)
        return loss if loss_scale is None else loss * loss_scale

    def grads_of(weights, qweights, rows, key, loss_scale):
        """Mean loss over ``rows [b, seq_len + 1]`` and its gradients (accumulated over
        ``accum`` micro-batches)."""
        inputs, targets = rows[:, :-1], rows[:, 1:]
        grad_fn = jax.value_and_grad(loss_fn)
        if accum == 1:
            return grad_fn(weights, qweights, inputs, targets, key, loss_scale)
        b = inputs.shape[0] // accum
        micro = lambda a: a.reshape(accum, b, *a.shape[1:])

        def body(carry, xs):
            i, (inp, tgt) = xs
            l, g = grad_fn(weights, qweights, inp, tgt, jax.random.fold_in(key, i), loss_scale)
            return jax.tree.map(jnp.add, carry, (l, jax.tree.map(lambda x: x.astype(jnp.float32), g))), None

        zero = (jnp.zeros([], jnp.float32), jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights))
        (loss, grads), _ = jax.lax.scan(body, zero, (jnp.arange(accum), (micro(inputs), micro(targets))))
        return loss / accum, jax.tree.map(lambda g: g / accum, grads)

    def step(params, opt_state, batch, key, loss_scale=None):
        if packed:
            gathered = nv.gather(params, mesh, rules=rules)
            weights = nv.dequantize_params(gathered, wdtype)
        else:
            gathered = nv.gather(params, mesh, rules=rules) if nvfp4_compute else None
            weights = nv.gather_dequantized(params, wdtype, mesh, rules=rules)
        qweights = nvfp4_collection(gathered) if nvfp4_compute else None
        if grad_reduce == "auto":
            loss, grads = grads_of(weights, qweights, batch, key, loss_scale)
        else:
            rows = batch.reshape(n_data, batch.shape[0] // n_data, *batch.shape[1:])
            rows = jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, P(rules.data_axis)))
            shard_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_data))
            losses, stacked = jax.vmap(grads_of, in_axes=(None, None, 0, 0, None))(
                weights, qweights, rows, shard_keys, loss_scale)
            with jax.named_scope(REDUCE_SCOPE):
                losses = jax.lax.with_sharding_constraint(losses, NamedSharding(mesh, P(rules.data_axis)))
                loss = jnp.sum(move_bits(losses, NamedSharding(mesh, P()))) / np.float32(n_data)
            grads = ordered_mean(stacked, nv.find_state(opt_state).master, mesh, rules)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        mw = nv.find_state(opt_state)
        metrics = {"loss": loss, "skipped": mw.skipped, "grad_finite": jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))}
        return params, opt_state, metrics

    return step


# ----------------------------------------------------------------------------- evaluation
def make_eval(cfg: Config, model, rules: nv.Rules, mesh, batch_sharding):
    """``evaluate(params, batch) -> [batch] float32``: each row's mean next-token loss.

    Its own jitted function, apart from the train step: the stored params are gathered
    (``nv.gather``: packed bytes for NVFP4 leaves), dequantized to bf16 and run forward, with
    the recipe's GEMMs when ``nvfp4.compute=nvfp4`` (round to nearest: no rounding key).
    Per-row losses come back replicated and the host averages them in a fixed order, so the
    validation loss does not depend on how devices or processes sum.
    """
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"

    def evaluate(params, batch):
        gathered = nv.gather(params, mesh, rules=rules)
        variables = {"params": nv.dequantize_params(gathered, jnp.bfloat16)}
        if nvfp4_compute:
            variables["nvfp4"] = nvfp4_collection(gathered)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model.apply(variables, inputs)
        return jax.vmap(cross_entropy)(logits, targets)

    return jax.jit(evaluate, in_shardings=(None, batch_sharding), out_shardings=NamedSharding(mesh, P()))


def validation_loss(eval_fn, params, batches) -> float:
    """Mean loss over the validation ``batches`` (global arrays), summed on the host in order."""
    rows = [np.asarray(jax.device_get(eval_fn(params, b)), np.float64) for b in batches]
    return float(np.mean(np.concatenate(rows)))


# ----------------------------------------------------------------------------- accounting
def gather_accounting(trainer: Trainer, params, opt_state, batch) -> Dict[str, Any]:
    """Bytes per step read from the compiled step's HLO, and the bf16-gather equivalent.

    ``all_gather_bytes`` counts parameter gathers; the gathers of the ordered gradient/loss
    reductions (scope ``REDUCE_SCOPE``: small replicated leaves, per-shard partial sums) are
    ``reduce_gather_bytes``. ``collectives`` lists every collective."""
    compiled = trainer.step_fn.lower(params, opt_state, batch, jax.random.key(0), np.float32(1)).compile()
    text = compiled.as_text()
    counts = nv.collective_bytes(text)
    reduce_text = "\n".join(line for line in text.splitlines() if f"/{REDUCE_SCOPE}/" in line)
    reduce_gathered = nv.total_bytes(nv.collective_bytes(reduce_text), "all-gather") if reduce_text else 0
    gathered = nv.total_bytes(counts, "all-gather") - reduce_gathered
    n_data = dict(zip(trainer.mesh.axis_names, trainer.mesh.axis_sizes))["data"]
    sizes = dict(zip(trainer.mesh.axis_names, trainer.mesh.axis_sizes))
    bf16_equiv = nvfp4_bf16_equiv = 0
    specs = nv.partition_specs(params, trainer.mesh, trainer.rules)
    for leaf, spec in zip(jax.tree.leaves(params, is_leaf=nv.is_nvfp4), jax.tree.leaves(specs, is_leaf=nv.is_nvfp4)):
        s = [a for a in (spec.data if nv.is_nvfp4(leaf) else spec) if a is not None]
        if n_data > 1 and "data" in s:
            # Per device, a gather yields the whole tensor's share of this device's tensor shard.
            nbytes = 2 * math.prod(leaf.shape) // (sizes.get("tensor", 1) if "tensor" in s else 1)
            bf16_equiv += nbytes
            if nv.is_nvfp4(leaf):
                nvfp4_bf16_equiv += nbytes
    mem = compiled.memory_analysis()
    return {
        "collectives": {f"{op}:{dt}": b for (op, dt), b in counts.items()},
        "all_gather_bytes": gathered,
        "reduce_gather_bytes": reduce_gathered,
        "bf16_gather_bytes": bf16_equiv,
        "nvfp4_gather_bytes": sum(v for (op, dt), v in counts.items() if op == "all-gather" and dt == "u8"),
        "nvfp4_bf16_gather_bytes": nvfp4_bf16_equiv,
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None) if mem is not None else None,
    }


# ----------------------------------------------------------------------------- the loop
def global_batch(trainer: Trainer, local: np.ndarray):
    global_shape = (trainer.cfg.data.batch_size, local.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, local, global_shape)


def _resume_metrics(path: str, step: int) -> list:
    """The records of ``metrics.jsonl`` up to ``step`` (a resumed run continues after them);
    the file is rewritten without later records, which a run stopped after its last
    checkpoint had written."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if r.get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    os.replace(tmp, path)
    return recs


def run(
    cfg: Config,
    mesh,
    out_dir: str,
    *,
    progress: bool = True,
    label: str = "",
    on_step=None,
    on_start=None,
    inject_nonfinite: Optional[Dict[int, float]] = None,
) -> Dict[str, Any]:
    """Train ``cfg`` on ``mesh``; write ``metrics.jsonl`` into ``out_dir``; return a summary.

    With ``cfg.checkpoint.dir``, the run resumes from the latest checkpoint there (metrics.jsonl
    continues after its step), saves every ``checkpoint.every`` steps and at the end.

    Args:
      on_step: ``on_step(step, params, opt_state, data_iterator)`` after each step (and its
        checkpoint); ``step`` counts from 1.
      on_start: called once the state is built or restored, before anything is written.
      inject_nonfinite: fault-injection hook for tests, not a config key: ``{step: value}``
        multiplies the loss of that step (counted from 1) by ``value`` (NaN or Inf), which
        makes its gradients non-finite.
    """
    inject = {int(k): float(v) for k, v in (inject_nonfinite or {}).items()}
    ckpt = None
    if cfg.checkpoint.dir:
        ckpt = checkpoint_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                           async_save=cfg.checkpoint.async_save)
    fh = bar = None
    try:
        start = ckpt.latest_step() if ckpt is not None else None
        trainer, params, opt_state = build(cfg, mesh, init=start is None)
        source = data_lib.make_source(cfg.data, cfg.model)
        it = data_lib.make_data_iterator(cfg, process_index=jax.process_index(), process_count=jax.process_count(), source=source)
        val_batches, eval_fn = [], None
        if cfg.train.eval_every:
            val_source = data_lib.make_source(cfg.data, cfg.model, split="val")
            val_batches = [global_batch(trainer, b) for b in data_lib.eval_batches(
                cfg, val_source, process_index=jax.process_index(), process_count=jax.process_count())]
            eval_fn = make_eval(cfg, trainer.model, trainer.rules, mesh, trainer.batch_sharding)
        base_key = jax.random.key(cfg.train.seed + 2)
        if start is not None:
            r = ckpt.restore(start, trainer.abstract_params, trainer.abstract_state,
                             trainer.param_shardings, trainer.state_shardings)
            params, opt_state, base_key = r.params, r.opt_state, r.base_key
            it.set_state(r.data_state)
        start = start or 0
        if on_start is not None:
            on_start()

        batch0 = global_batch(trainer, it.batch_at(0))
        acct = gather_accounting(trainer, params, opt_state, batch0)
        is_main = jax.process_index() == 0
        metrics_path = os.path.join(out_dir, "metrics.jsonl")
        history = []
        if is_main:
            os.makedirs(out_dir, exist_ok=True)
            history = _resume_metrics(metrics_path, start) if start else []
            fh = open(metrics_path, "a" if start else "w")
        if progress and is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps),
                       desc=label or cfg.nvfp4.weights, dynamic_ncols=True)
        tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        times = []
        skipped_before = int(nv.find_state(opt_state).skipped)
        for step in range(start, cfg.train.steps):
            batch = global_batch(trainer, next(it))
            scale = np.float32(inject.get(step + 1, 1.0))
            t0 = time.perf_counter()
            params, opt_state, m = trainer.step_fn(params, opt_state, batch, jax.random.fold_in(base_key, step), scale)
            loss = float(m["loss"])  # syncs: the time below is the whole step
            dt = time.perf_counter() - t0
            skipped = int(m["skipped"])
            if cfg.nvfp4.nonfinite == "error" and skipped > skipped_before:
                # Before any checkpoint of this step: the state on disk stays the last good one.
                nv.raise_if_skipped(opt_state, skipped_before)
            skipped_before = skipped
            if step > start:
                times.append(dt)
            rec = {"step": step + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "gathered_bytes": acct["all_gather_bytes"], "skipped": skipped}
            if eval_fn is not None and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
                rec["val_loss"] = validation_loss(eval_fn, params, val_batches)
            history.append(rec)
            if fh:
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
            if bar is not None:
                bar.update(1)
                shown = [h["val_loss"] for h in history if "val_loss" in h]
                bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{shown[-1]:.3f}"} if shown else {}), tok_s=f"{rec['tokens_per_s']:.0f}",
                                gather=f"{acct['all_gather_bytes'] / 1e6:.2f}MB", skipped=skipped, refresh=False)
            if ckpt is not None and ((cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0)
                                     or step + 1 == cfg.train.steps):
                ckpt.save(step + 1, params, opt_state, mesh=mesh, rules=trainer.rules, base_key=base_key,
                          data_state=it.get_state())
            if on_step is not None:
                on_step(step + 1, params, opt_state, it)
    finally:
        if fh:
            fh.close()
        if bar is not None:
            bar.close()
        if ckpt is not None:
            ckpt.close()  # waits for an asynchronous save of the last good step
    losses = [h["loss"] for h in history]
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    tail = losses[-max(1, min(20, len(losses) // 5)):]
    return {
        "label": label or cfg.nvfp4.weights,
        "steps": cfg.train.steps,
        "start_step": start,
        "final_loss": float(np.mean(tail)) if tail else float("nan"),
        "last_loss": losses[-1] if losses else float("nan"),
        "final_val_loss": val[-1][1] if val else None,
        "val_history": val,
        "entropy_floor": source.entropy_rate(),
        "median_step_time_s": float(np.median(times)) if times else None,
        "skipped_steps": skipped_before,
        "history": losses,
        **acct,
        "params": params,
        "opt_state": opt_state,
        "data_state": it.get_state(),
    }


def plot_losses(runs, path: str, floor: Optional[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        line, = ax.plot(np.arange(1, len(r["history"]) + 1), r["history"], label=f"{r['label']} (train)")
        if r.get("val_history"):
            steps, vals = zip(*r["val_history"])
            ax.plot(steps, vals, "o--", color=line.get_color(), ms=6, mec="k", lw=1.5, zorder=3,
                    label=f"{r['label']} (validation)")
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"entropy floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(runs, out_dir: str) -> Dict[str, Any]:
    """Write summary.json (+ loss.png); return the summary without arrays."""
    keep = ("label", "steps", "final_loss", "last_loss", "final_val_loss", "val_history", "entropy_floor", "median_step_time_s",
            "skipped_steps", "all_gather_bytes", "bf16_gather_bytes", "nvfp4_gather_bytes",
            "nvfp4_bf16_gather_bytes", "collectives", "temp_bytes")
    summary = {"runs": [{k: r[k] for k in keep} for r in runs]}
    first = runs[0]
    if first["bf16_gather_bytes"]:
        summary["gather_vs_bf16"] = first["all_gather_bytes"] / first["bf16_gather_bytes"]
    if first["nvfp4_bf16_gather_bytes"]:
        summary["nvfp4_gather_vs_bf16"] = first["nvfp4_gather_bytes"] / first["nvfp4_bf16_gather_bytes"]
    if len(runs) == 2:
        a, b = runs
        if a.get("final_val_loss") is not None and b.get("final_val_loss") is not None:
            summary["final_val_loss_gap"] = a["final_val_loss"] - b["final_val_loss"]
        summary["final_loss_gap"] = a["final_loss"] - b["final_loss"]
        if b["all_gather_bytes"]:
            summary["gathered_bytes_ratio"] = a["all_gather_bytes"] / b["all_gather_bytes"]
        if a["median_step_time_s"] and b["median_step_time_s"]:
            summary["step_time_ratio"] = a["median_step_time_s"] / b["median_step_time_s"]
    if jax.process_index() == 0:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_losses(runs, os.path.join(out_dir, "loss.png"), first["entropy_floor"])
    return summary
