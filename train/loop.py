"""The training loop: state creation, the jitted step, logging, outputs.

One screen of logic on top of the library's public API:
``quantize_params`` -> ``master_weights`` -> ``shardings`` -> a jitted step that ``gather``\\ s
packed bytes, dequantizes, runs the model and hands the gradients to the wrapper.
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


def inner_optimizer(cfg: Config) -> optax.GradientTransformation:
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
        opt = optax.chain(optax.clip_by_global_norm(o.clip_norm), opt)
    return opt


def make_optimizer(cfg: Config, rules: nv.Rules, policy: nv.Policy, mesh) -> optax.GradientTransformation:
    return nv.master_weights(
        inner_optimizer(cfg),
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


def init_state(cfg: Config, mesh, model, policy, rules, tx):
    """Float32 init -> NVFP4 params and master-weight state, sharded (jit with out_shardings,
    so no unsharded copy of the state is materialised on one device)."""
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)

    def create(key):
        fp32 = model.init({"params": key}, tokens)["params"]
        fp32 = jax.tree.map(lambda a: a.astype(jnp.float32), fp32)
        return nv.quantize_params(fp32, policy), tx.init(fp32)

    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(create, jax.random.key(cfg.train.seed))
        shard = (nv.shardings(abstract[0], mesh, rules=rules), nv.shardings(abstract[1], mesh, rules=rules))
        params, opt_state = jax.jit(create, out_shardings=shard)(jax.random.key(cfg.train.seed))
    return params, opt_state, shard


def build(cfg: Config, mesh) -> tuple:
    validate_for_devices(cfg, mesh.size)
    model = from_config(cfg.model, cfg.nvfp4)
    policy, rules = policy_for(cfg), rules_for(cfg)
    tx = make_optimizer(cfg, rules, policy, mesh)
    params, opt_state, (p_sh, s_sh) = init_state(cfg, mesh, model, policy, rules, tx)
    batch_sharding = NamedSharding(mesh, P("data"))
    step = make_step(cfg, model, tx, rules, mesh)
    step = jax.jit(
        step,
        in_shardings=(p_sh, s_sh, batch_sharding, None),
        out_shardings=(p_sh, s_sh, None),
        donate_argnums=(0, 1),
    )
    trainer = Trainer(cfg, mesh, model, policy, rules, tx, p_sh, s_sh, step, batch_sharding)
    return trainer, params, opt_state


def make_step(cfg: Config, model, tx, rules, mesh):
    packed = cfg.nvfp4.param_gather == "packed"
    nvfp4_compute = cfg.nvfp4.weights == "nvfp4" and cfg.nvfp4.compute == "nvfp4"
    # Gradients take the dtype of the weights they are taken against: float32 weights (cast
    # to bf16 inside the layers) make the cross-device gradient sum float32.
    wdtype = jnp.float32 if cfg.nvfp4.grad_reduce_dtype == "float32" else jnp.bfloat16
    accum = cfg.optim.grad_accum

    def loss_fn(weights, qweights, inputs, targets, key):
        variables = {"params": weights}
        if qweights is not None:
            variables["nvfp4"] = qweights
        rngs = {"rounding": key} if (nvfp4_compute and key is not None) else None
        logits = model.apply(variables, inputs, rngs=rngs)
        return cross_entropy(logits, targets)

    def step(params, opt_state, batch, key):
        if packed:
            gathered = nv.gather(params, mesh, rules=rules)
            weights = nv.dequantize_params(gathered, wdtype)
        else:
            gathered = nv.gather(params, mesh, rules=rules) if nvfp4_compute else None
            weights = nv.gather_dequantized(params, wdtype, mesh, rules=rules)
        qweights = nvfp4_collection(gathered) if nvfp4_compute else None
        inputs, targets = batch[:, :-1], batch[:, 1:]
        grad_fn = jax.value_and_grad(loss_fn)
        if accum == 1:
            loss, grads = grad_fn(weights, qweights, inputs, targets, key)
        else:
            b = inputs.shape[0] // accum
            micro = lambda a: a.reshape(accum, b, *a.shape[1:])

            def body(carry, xs):
                i, (inp, tgt) = xs
                l, g = grad_fn(weights, qweights, inp, tgt, jax.random.fold_in(key, i))
                return jax.tree.map(jnp.add, carry, (l, jax.tree.map(lambda x: x.astype(jnp.float32), g))), None

            zero = (jnp.zeros([], jnp.float32), jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights))
            (loss, grads), _ = jax.lax.scan(body, zero, (jnp.arange(accum), (micro(inputs), micro(targets))))
            loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        mw = nv.find_state(opt_state)
        metrics = {"loss": loss, "skipped": mw.skipped, "grad_finite": jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))}
        return params, opt_state, metrics

    return step


# ----------------------------------------------------------------------------- accounting
def gather_accounting(trainer: Trainer, params, opt_state, batch) -> Dict[str, Any]:
    """Bytes per step read from the compiled step's HLO, and the bf16-gather equivalent."""
    compiled = trainer.step_fn.lower(params, opt_state, batch, jax.random.key(0)).compile()
    counts = nv.collective_bytes(compiled.as_text())
    gathered = nv.total_bytes(counts, "all-gather")
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
        "bf16_gather_bytes": bf16_equiv,
        "nvfp4_gather_bytes": sum(v for (op, dt), v in counts.items() if op == "all-gather" and dt == "u8"),
        "nvfp4_bf16_gather_bytes": nvfp4_bf16_equiv,
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None) if mem is not None else None,
    }


# ----------------------------------------------------------------------------- the loop
def global_batch(trainer: Trainer, local: np.ndarray):
    global_shape = (trainer.cfg.data.batch_size, local.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, local, global_shape)


def run(
    cfg: Config,
    mesh,
    out_dir: str,
    *,
    progress: bool = True,
    label: str = "",
    on_step=None,
) -> Dict[str, Any]:
    """Train ``cfg`` on ``mesh``; write ``metrics.jsonl`` into ``out_dir``; return a summary."""
    os.makedirs(out_dir, exist_ok=True)
    trainer, params, opt_state = build(cfg, mesh)
    source = data_lib.make_source(cfg.data, cfg.model)
    it = data_lib.make_data_iterator(cfg, process_index=jax.process_index(), process_count=jax.process_count(), source=source)
    base_key = jax.random.key(cfg.train.seed + 2)

    batch0 = global_batch(trainer, it.batch_at(0))
    acct = gather_accounting(trainer, params, opt_state, batch0)
    is_main = jax.process_index() == 0
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    fh = open(metrics_path, "w") if is_main else None
    bar = None
    if progress and is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.train.steps, desc=label or cfg.nvfp4.weights, dynamic_ncols=True)
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
    history, times = [], []
    skipped_before = 0
    try:
        for step in range(cfg.train.steps):
            batch = global_batch(trainer, next(it))
            t0 = time.perf_counter()
            params, opt_state, m = trainer.step_fn(params, opt_state, batch, jax.random.fold_in(base_key, step))
            loss = float(m["loss"])  # syncs: the time below is the whole step
            dt = time.perf_counter() - t0
            skipped = int(m["skipped"])
            if cfg.nvfp4.nonfinite == "error" and skipped > skipped_before:
                nv.raise_if_skipped(opt_state, skipped_before)
            skipped_before = skipped
            if step > 0:
                times.append(dt)
            rec = {"step": step + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "gathered_bytes": acct["all_gather_bytes"], "skipped": skipped}
            history.append(rec)
            if fh:
                fh.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                gather=f"{acct['all_gather_bytes'] / 1e6:.2f}MB", skipped=skipped, refresh=False)
            if on_step is not None:
                on_step(step + 1, params, opt_state, it)
    finally:
        if fh:
            fh.close()
        if bar is not None:
            bar.close()
    tail = [h["loss"] for h in history[-max(1, min(20, len(history) // 5)):]]
    return {
        "label": label or cfg.nvfp4.weights,
        "steps": cfg.train.steps,
        "final_loss": float(np.mean(tail)),
        "last_loss": history[-1]["loss"],
        "entropy_floor": source.entropy_rate(),
        "median_step_time_s": float(np.median(times)) if times else None,
        "skipped_steps": skipped_before,
        "history": [h["loss"] for h in history],
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
        ax.plot(np.arange(1, len(r["history"]) + 1), r["history"], label=r["label"])
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
    keep = ("label", "steps", "final_loss", "last_loss", "entropy_floor", "median_step_time_s",
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
