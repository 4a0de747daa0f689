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
    """Where the state lives. Scanned segments stack layers on axis 0. Large bf16 leaves
    (embeddings, head, the bf16 baseline's weights) are stored sharded and gathered like the
    NVFP4 ones, so the two weight formats are compared like for like.

    With ``mesh.layout: gb200`` (axes rack, data, tensor): ``mesh.sharding: fsdp`` shards the
    state over ``("data", "rack")``, racks minor, so a weight gather crosses racks first on
    1/I of the bytes and a gradient is summed inside the rack first; ``hsdp`` shards it over
    ``data`` (inside the rack) and replicates it across racks."""
    common = dict(tensor_axis="tensor", tensor=TENSOR_RULES, stacked=(r"^blocks",))
    if cfg.mesh.layout != "gb200":
        return nv.Rules(data_axis="data", **common)
    if cfg.mesh.sharding == "hsdp":
        return nv.Rules(data_axis="data", replica_axis="rack", **common)
    return nv.Rules(data_axis=("data", "rack"), **common)


def batch_axes(mesh, rules: nv.Rules) -> tuple:
    """The mesh axes the batch rows are split over, in mesh order (racks first: each
    process's devices hold consecutive rows)."""
    return tuple(a for a in mesh.axis_names if a in rules.batch_axes)


def schedule_for(cfg: Config):
    # The schedule's own length (optim.schedule_steps, default train.steps): an extended run
    # keeps the length its checkpoint was trained with (see train.checkpoint.check_resume).
    o, steps = cfg.optim, cfg.schedule_steps()
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
        opt = optax.chain(nv.clip_by_global_norm(o.clip_norm, mesh, rules), opt)
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


def _state_fn(cfg: Config, model, policy, rules, tx, mesh):
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)

    def create(key):
        fp32 = model.init({"params": key}, tokens)["params"]
        fp32 = jax.tree.map(lambda a: a.astype(jnp.float32), fp32)
        params = nv.shard_params(nv.quantize_params(fp32, policy), mesh, rules)
        return params, tx.init(fp32)

    return create


def abstract_state(cfg: Config, mesh, model, policy, rules, tx):
    """``((params, opt_state) as ShapeDtypeStructs, (param_shardings, state_shardings))``,
    without computing anything: what :func:`init_state` would create, and where."""
    create = _state_fn(cfg, model, policy, rules, tx, mesh)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(create, jax.random.key(cfg.train.seed))
    shard = (nv.shardings(abstract[0], mesh), nv.shardings(abstract[1], mesh))
    return abstract, shard


def init_state(cfg: Config, mesh, model, policy, rules, tx):
    """Float32 init -> stored NVFP4 params and master-weight state, sharded (jit with
    out_shardings, so no unsharded copy of the state is materialised on one device)."""
    _, shard = abstract_state(cfg, mesh, model, policy, rules, tx)
    with jax.set_mesh(mesh):
        create = _state_fn(cfg, model, policy, rules, tx, mesh)
        params, opt_state = jax.jit(create, out_shardings=shard)(jax.random.key(cfg.train.seed))
    return params, opt_state, shard


def build(cfg: Config, mesh, *, init: bool = True) -> tuple:
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
    batch_sharding = NamedSharding(mesh, P(batch_axes(mesh, rules)))
    step = jax.jit(
        make_step(cfg, model, tx, rules, mesh),
        in_shardings=(p_sh, s_sh, batch_sharding, None, None),
        out_shardings=(p_sh, s_sh, None),
        donate_argnums=(0, 1),
    )
    trainer = Trainer(cfg, mesh, model, policy, rules, tx, p_sh, s_sh, step, batch_sharding, a_params, a_state)
    return trainer, params, opt_state


def _manual(spec: P, axes) -> P:
    """``spec`` keeping only the mesh axes a ``shard_map`` is manual over."""
    out = []
    for e in spec:
        if isinstance(e, tuple):
            kept = tuple(a for a in e if a in axes)
            out.append(kept if len(kept) > 1 else (kept[0] if kept else None))
        else:
            out.append(e if e in axes else None)
    return P(*out)


def make_step(cfg: Config, model, tx, rules, mesh):
    """The train step ``step(params, opt_state, batch, key, loss_scale=None)`` (FSDP, one
    layer at a time).

    The loss and its gradients are computed inside a ``shard_map`` over the data axis, each
    device on its own rows. Every parameter reaches the model as a
    :class:`jax_nvfp4.nn.ParamShard`; the layer that uses it all-gathers its packed bytes
    there, inside the scan over layers, and the scanned blocks are rematerialised, so no
    device holds more than one layer's weights. The gather's VJP reduce-scatters each layer's
    weight gradient straight into this device's master shard, summed in a fixed order
    (:func:`jax_nvfp4.gather_weight`): bit-identical for any process layout. Then the
    ``master_weights`` optimizer updates and re-quantizes each shard in place.

    ``loss_scale`` (step argument): a float32 scalar multiplying the loss, 1.0 in training; a
    fault-injection hook (NaN/Inf make that step's gradients non-finite).
    """
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"
    # Gradients take the dtype of the weights they are taken against: float32 weights (cast
    # to bf16 inside the layers) make the cross-device gradient sum float32.
    wdtype = jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else jnp.bfloat16
    gather_cfg = nv.GatherConfig(rules.data_axis, wdtype, packed=cfg.nvfp4.param_gather == "packed",
                                 replica_axis=rules.replica_axis)
    accum = cfg.optim.grad_accum
    fmodel = model.clone(remat=cfg.train.remat)
    data_axes = batch_axes(mesh, rules)
    tensor_on = rules.tensor_axis in mesh.axis_names and mesh.shape[rules.tensor_axis] > 1
    # Manual over the batch axes; a tensor axis of size > 1 stays with XLA (Megatron-style
    # splits inside the layers, propagated from the weights' shardings).
    manual = set(data_axes) if tensor_on else set(mesh.axis_names)
    is_node = lambda x: nv.is_tiled(x)

    def local(params, masters, rows, key, loss_scale):
        key = jax.random.fold_in(key, jax.lax.axis_index(data_axes))
        inputs, targets = rows[:, :-1], rows[:, 1:]

        def loss_fn(masters, inp, tgt, k):
            shards = jax.tree.map(lambda s, m: nv.nn.ParamShard(s, m, gather_cfg), params, masters, is_leaf=is_node)
            rngs = {"rounding": k} if nvfp4_compute else None
            logits = fmodel.apply({"params": shards}, inp, rngs=rngs)
            return cross_entropy(logits, tgt) * loss_scale

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
        return nv.ordered_mean(loss, data_axes), grads

    def step(params, opt_state, batch, key, loss_scale=None):
        scale = jnp.float32(1) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
        masters = nv.find_state(opt_state).master
        p_specs = jax.tree.map(lambda s: _manual(s, manual), nv.partition_specs(params), is_leaf=lambda x: isinstance(x, P))
        m_specs = jax.tree.map(lambda s: _manual(s, manual), nv.partition_specs(masters), is_leaf=lambda x: isinstance(x, P))
        loss, grads = jax.shard_map(
            local, mesh=mesh, axis_names=manual,
            in_specs=(p_specs, m_specs, P(data_axes), P(), P()), out_specs=(P(), m_specs), check_vma=False,
        )(params, masters, batch, key, scale)
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
    """Bytes per step read from the compiled step's HLO, per device: the weight gathers
    (``jax_nvfp4.comm.Program.weight_gathers``), every collective by ``op:dtype``, and XLA's
    temporary buffer size."""
    compiled = trainer.step_fn.lower(params, opt_state, batch, jax.random.key(0), np.float32(1)).compile()
    program = nv.comm.parse(compiled.as_text())
    mem = compiled.memory_analysis()
    return {
        **program.weight_gathers(),
        "collectives": {f"{op}:{dt}": b for (op, dt), b in program.by("op", "dtype").items()},
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None) if mem is not None else None,
    }


# ----------------------------------------------------------------------------- the loop
def global_batch(trainer: Trainer, local: np.ndarray):
    global_shape = (trainer.cfg.data.batch_size, local.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, local, global_shape)


def json_record(rec: Dict[str, Any]) -> str:
    """``rec`` as one line of strict JSON: non-finite floats (a skipped step's NaN loss)
    become null, which every JSON reader accepts (``NaN`` is not JSON)."""
    return json.dumps(_finite_or_none(rec), allow_nan=False)


def _finite_or_none(x):
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


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
        f.writelines(json_record(r) + "\n" for r in recs)
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

    With ``cfg.checkpoint.dir``, the run resumes from the newest checkpoint there once its
    content hashes are verified (``checkpoint.fallback``: the newest intact one) and its config
    matches (:func:`train.checkpoint.check_resume`); metrics.jsonl continues after its step. It
    saves every ``checkpoint.every`` steps and at the end.

    Raises:
      FloatingPointError: a non-finite step with ``nvfp4.nonfinite="error"``, or
        ``nvfp4.max_skipped_in_a_row`` skipped steps in a row; the message names the step.
      train.checkpoint.CheckpointError: a corrupt or incompatible checkpoint
        (``CheckpointWriteError``: one that cannot be written).

    Args:
      on_step: ``on_step(step, params, opt_state, data_iterator)`` after each step (and its
        checkpoint); ``step`` counts from 1.
      on_start: called once the state is built or restored, before anything is written.
      inject_nonfinite: fault-injection hook for tests, not a config key: ``{step: value}``
        multiplies the loss of that step (counted from 1) by ``value`` (NaN or Inf), which
        makes its gradients non-finite.
    """
    inject = {int(k): float(v) for k, v in (inject_nonfinite or {}).items()}
    is_main = jax.process_index() == 0
    ckpt = None
    if cfg.checkpoint.dir:
        ckpt = checkpoint_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                           async_save=cfg.checkpoint.async_save)
    fh = bar = None
    try:
        start = ckpt.restorable_step(cfg.checkpoint.fallback) if ckpt is not None else None
        if start is not None:
            checkpoint_lib.check_resume(os.path.join(ckpt.directory, str(start)), ckpt.read_meta(start), cfg)
        name = label or cfg.nvfp4.weights
        t_compile = time.perf_counter()
        if is_main:
            # Building the state and compiling the step take a while before the first step.
            print(f"{name}: compiling the train step...", flush=True)
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
            if is_main and start < cfg.train.steps:
                print(f"resuming from step {start} of {cfg.train.steps} ({ckpt.directory})", flush=True)
            elif is_main:
                print(f"checkpoint {ckpt.directory} is at step {start} = train.steps: the run is already finished, "
                      f"nothing to train (raise train.steps to continue it; see README, Checkpoints)", flush=True)
        start = start or 0
        if on_start is not None:
            on_start()

        batch0 = global_batch(trainer, it.batch_at(0))
        acct = gather_accounting(trainer, params, opt_state, batch0)
        if is_main:
            print(f"{name}: compiled in {time.perf_counter() - t_compile:.1f} s", flush=True)
        metrics_path = os.path.join(out_dir, "metrics.jsonl")
        history = []
        if is_main:
            os.makedirs(out_dir, exist_ok=True)
            history = _resume_metrics(metrics_path, start) if start else []
            fh = open(metrics_path, "a" if start else "w")
        if progress and is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps),
                       desc=name, dynamic_ncols=True)
        tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        times = []
        skipped_before = int(nv.find_state(opt_state).skipped)
        in_a_row, limit = 0, cfg.nvfp4.max_skipped_in_a_row
        run_id = checkpoint_lib.run_identity(cfg)
        # The host reads metrics every train.log_every steps (and at checkpoints, evaluations,
        # the first and last step, every step with nvfp4.nonfinite=error or an on_step hook):
        # between those, steps are dispatched without waiting for the previous one.
        pending = []
        t_mark = time.perf_counter()
        for step in range(start, cfg.train.steps):
            batch = global_batch(trainer, next(it))
            scale = np.float32(inject.get(step + 1, 1.0))
            params, opt_state, m = trainer.step_fn(params, opt_state, batch, jax.random.fold_in(base_key, step), scale)
            pending.append((step, m))
            last = step + 1 == cfg.train.steps
            ckpt_due = ckpt is not None and ((cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or last)
            eval_due = eval_fn is not None and ((step + 1) % cfg.train.eval_every == 0 or last)
            if not (last or ckpt_due or eval_due or on_step is not None or step == start
                    or cfg.nvfp4.nonfinite == "error" or (step + 1) % cfg.train.log_every == 0):
                continue
            fetched = jax.device_get([pm for _, pm in pending])  # waits for the steps in flight
            now = time.perf_counter()
            dt = (now - t_mark) / len(pending)  # the mean step time since the last read
            t_mark = now
            for (s, _), mm in zip(pending, fetched):
                loss, skipped = float(mm["loss"]), int(mm["skipped"])
                if cfg.nvfp4.nonfinite == "error" and skipped > skipped_before:
                    # Read every step in this mode, before any checkpoint of this step: the
                    # state on disk stays the last good one.
                    try:
                        nv.raise_if_skipped(opt_state, skipped_before)
                    except FloatingPointError as e:
                        raise FloatingPointError(f"step {s + 1}: {e}") from None
                in_a_row = in_a_row + 1 if skipped > skipped_before else 0
                skipped_before = skipped
                if s > start:
                    times.append(dt)
                rec = {"step": s + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                       "gathered_bytes": acct["all_gather_bytes"], "skipped": skipped}
                if s == step and eval_due:
                    rec["val_loss"] = validation_loss(eval_fn, params, val_batches)
                history.append(rec)
                if fh:
                    fh.write(json_record(rec) + "\n")
                if bar is not None:
                    bar.update(1)
                    shown = [h["val_loss"] for h in history if "val_loss" in h]
                    bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{shown[-1]:.3f}"} if shown else {}),
                                    tok_s=f"{rec['tokens_per_s']:.0f}",
                                    gather=f"{acct['all_gather_bytes'] / 1e6:.2f}MB", skipped=skipped, refresh=False)
                if limit and in_a_row >= limit:
                    # Diverged: every step is being thrown away. Stop before checkpointing it.
                    raise FloatingPointError(
                        f"step {s + 1}: {in_a_row} steps in a row skipped for non-finite gradients (loss {loss}); "
                        f"the run has diverged (nvfp4.max_skipped_in_a_row={limit}; 0 = no limit)")
            pending.clear()
            if fh:
                fh.flush()
            if ckpt_due:
                ckpt.save(step + 1, params, opt_state, mesh=mesh, rules=trainer.rules, base_key=base_key,
                          data_state=it.get_state(), run=run_id)
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
        "final_loss": float(np.mean(tail)) if tail else float("nan"),  # mean of the last final_loss_steps
        "final_loss_steps": len(tail),
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


def plot_losses(runs, path: str, floor: Optional[float]):
    """``loss.png``: the training (and validation) loss of each run against the step, on a log
    axis with plain tick labels; with two runs (``--compare``) a second panel shows their
    difference per step (first run - second: NVFP4 - bf16), since the curves overlap. Returns
    the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    two = len(runs) == 2
    fig, axes = plt.subplots(2 if two else 1, 1, figsize=(7, 6.5 if two else 4), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]} if two else None)
    ax = axes[0, 0]
    styles = [dict(color="tab:blue", ls="-", lw=1.4), dict(color="tab:orange", ls="--", lw=1.4),
              dict(color="tab:purple", ls="-.", lw=1.4), dict(color="tab:red", ls=(0, (1, 1)), lw=1.4)]
    for i, r in enumerate(runs):
        st = styles[i % len(styles)]
        ax.plot(np.arange(1, len(r["history"]) + 1), r["history"], label=f"{r['label']} (train)", **st)
        if r.get("val_history"):
            steps, vals = zip(*r["val_history"])
            ax.plot(steps, vals, "osD^"[i % 4], ls=":", color=st["color"], ms=6, mec="k", lw=1.2, zorder=3,
                    label=f"{r['label']} (validation)")
    if floor is not None:
        ax.axhline(floor, color="k", ls=":", lw=1, label=f"entropy floor {floor:.3f}")
    ax.set_ylabel("loss (nats/token)")
    ax.set_yscale("log")
    # Ticks at 1.5, 2, 3, ... labelled as such rather than 2x10^0 (a log axis's default).
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    if two:
        a, b = runs
        n = min(len(a["history"]), len(b["history"]))
        diff = np.asarray(a["history"][:n], np.float64) - np.asarray(b["history"][:n], np.float64)
        dx = axes[1, 0]
        dx.plot(np.arange(1, n + 1), diff, color="tab:green", lw=1, label=f"{a['label']} - {b['label']} (train, per step)")
        if a.get("val_history") and b.get("val_history"):
            vb = dict(b["val_history"])
            pts = [(s, v - vb[s]) for s, v in a["val_history"] if s in vb]
            if pts:
                dx.plot(*zip(*pts), "D", color="k", ms=5, label="validation difference")
        dx.axhline(0, color="k", lw=0.8)
        dx.set_ylabel("loss difference (nats)")
        dx.legend(fontsize=8)
        dx.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def summarize(runs, out_dir: str) -> Dict[str, Any]:
    """Write summary.json (+ loss.png); return the summary without arrays."""
    keep = ("label", "steps", "final_loss", "final_loss_steps", "last_loss", "final_val_loss", "val_history", "entropy_floor", "median_step_time_s",
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
            json.dump(_finite_or_none(summary), f, indent=2, allow_nan=False)
        plot_losses(runs, os.path.join(out_dir, "loss.png"), first["entropy_floor"])
    return summary
