"""``python -m benchmarks convergence --text``: the NVFP4-vs-bf16 validation gap on real text.

The corpus is the Python standard library's own top-level modules (``*.py`` directly under
``sysconfig.get_paths()["stdlib"]``), present on every machine and read from local files only.
They are sorted by name; every ``HOLDOUT_EVERY``-th module (sorted index ``i`` with
``i % HOLDOUT_EVERY == HOLDOUT_OFFSET``) is held out whole, so the validation text comes from
modules the model never trains on. The two parts are concatenated (one newline after each
file) into ``train.txt`` and ``val.txt`` in the cache folder and read as bytes
(``data.source=file``, vocab 256, ``data.val_path``). The file lists, their byte counts and
the sha256 of both files go into the results.

Every run is ``train.loop.run`` on one device (sharding does not change the numbers) with
``train.seed = data.seed = seed``: the NVFP4 and bf16 runs of a seed see the same batches in
the same order and are evaluated on the same held-out windows (``train.eval_batches`` batches,
every ``train.eval_every`` steps and at the end). The metric is the final validation loss;
the gap is ``(NVFP4 - bf16) / bf16`` in percent, paired by seed.

Grid (:func:`grid`, defined with the sizes, lengths, variants and targets in
:mod:`benchmarks.convergence_grid`; the statistics are :mod:`benchmarks.stats`'s):

- sizes x lengths x seeds, ``nvfp4.weights=nvfp4`` (round to nearest, the default) and
  ``nvfp4.weights=bf16``;
- on the default model at its longest length, the levers one at a time:
  ``nvfp4.stochastic_rounding=true``, ``nvfp4.keep_last_blocks=1``,
  ``nvfp4.cast_master_bf16=true``, ``nvfp4.block=2d``, ``nvfp4.compute=nvfp4`` (the full
  recipe), and the full recipe with ``nvfp4.keep_last_blocks=1`` (the last block's GEMMs in
  bf16, as the published recipe keeps its last layers);
- once, the bf16 baseline re-implemented without the library (:func:`plain_bf16_run`).

``--recipe`` runs the full recipe's grid instead (:func:`recipe_grid`, reported by
:mod:`benchmarks.convergence_recipe` in ``CONVERGENCE_RECIPE.md``): 4-layer models of d_model
64 to 512, the recipe against bf16 with and without its last block in bf16, and the ablation,
one element of the recipe off at a time, at the widest width swept (``--ablation-at`` names
others). ``--length-sweep`` runs the length sweep instead (:func:`length_grid`, reported by
:mod:`benchmarks.convergence_length` in ``CONVERGENCE_LENGTH.md``): the 4-layer d_model 64 model
for ``--budgets`` tokens per non-embedding parameter (default 2,10,40, converted to steps from
the model's own count), bf16, weights-only NVFP4 and the full recipe with its last block bf16
(against bf16 with the same split), every run's cosine schedule decaying over its own length;
``--levers`` adds weights-only NVFP4 with one lever each at the longest budget (``--levers-at`` another).
``--rerun NAME`` trains one
finished run again and compares its losses with the recorded ones bit for bit; when they are,
the record takes the diagnostics it lacks from the retrained run (the same final weights).

``--recipe --seeds-at SIZE=FIRST-LAST`` adds the sweep's two pairs at SIZE for seeds FIRST..LAST
(:func:`~benchmarks.convergence_grid.seeds_at_grid`), reported in a section of their own: the
gaps' 95% t-intervals, whether each gap is below
:data:`~benchmarks.convergence_grid.SEEDS_AT_BOUND` once every seed is done, and the cost in
CPU hours done and to do. ``--train-seeds SEEDS`` trains only the runs of those seeds; the
report still covers every run of the grid.

Each finished run writes ``<cache>/runs/<name>.json``; a rerun skips those, so an interrupted
grid resumes. ``--from-results`` first writes every run the grid's results JSON in ``--out``
records (``runs``, less the training-loss trace, which only ``--rerun`` compares), and every
``--rerun`` verdict it records, into the cache, leaving those already there alone
(:func:`restore`): a fresh checkout continues from the committed results, and the report
aggregates the recorded runs with the new ones. Its runs must have been trained on the corpus
built here (same sha256). ``--workers N`` splits the runs over N processes (one by default), each
with :data:`WORKER_XLA_FLAGS` (one XLA thread: a run's numbers do not depend on the threading). A
run records the code it was trained by (:func:`source_state`: a hash of the sources as its process
loaded them, the commit, uncommitted changes); the report names every pair whose two runs ran
different code. After a change to the library or the stack, delete the runs it affects and rerun.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import arguments as A
from benchmarks import convergence_length as cl
from benchmarks import convergence_recipe as cr
from benchmarks.common import request_cpu_devices, source_state, use_compile_cache
from benchmarks.convergence_grid import (STORAGE_FORMATS, EVAL_BATCHES, HEADLINE_SEEDS, HEADLINE_VARIANTS, LENGTHS, LEVER_BASE,
                                         LENGTH_BUDGETS, LENGTH_SIZE, LEVER_NAMES, LEVER_SIZE, LEVERS, LR_HALF, RECIPE_LEVERS, RECIPE_SIZES,
                                         RECIPE_TARGET, SEEDS, SEEDS_AT_BOUND, SIZES, WEIGHTS_ONLY_TARGET, WEIGHTS_SIZES, grid,
                                         headline_seeds, length_grid, non_embedding_of, recipe_grid, run_config,
                                         run_name, size_shape)
from benchmarks.stats import (gap_curve, gaps, lever_effect, met_text, pct_text, run_meta, source_lines, stored_runs,
                              verdict)

DEFAULT_OUT = os.path.join("benchmarks", "results")
DEFAULT_CACHE = os.path.join("runs", "convergence-text")
HOLDOUT_EVERY = 10
HOLDOUT_OFFSET = 5


# ----------------------------------------------------------------------------- corpus
def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def split_modules(names: Sequence[str], every: int = HOLDOUT_EVERY, offset: int = HOLDOUT_OFFSET):
    """``(train, held_out)`` lists of the sorted ``names``: index ``i % every == offset`` is held out."""
    names = sorted(names)
    held = [n for i, n in enumerate(names) if i % every == offset]
    train = [n for i, n in enumerate(names) if i % every != offset]
    return train, held


def build_corpus(cache: str, src: Optional[str] = None, *, max_bytes: Optional[int] = None) -> Dict[str, Any]:
    """Write ``cache/corpus/{train,val}.txt`` from the stdlib's top-level modules; return the
    manifest (paths, module lists, byte counts, sha256). ``max_bytes`` caps each file (tests)."""
    src = src or stdlib_dir()
    names = sorted(f for f in os.listdir(src) if f.endswith(".py") and os.path.isfile(os.path.join(src, f)))
    if len(names) < HOLDOUT_EVERY:
        raise RuntimeError(f"{src}: {len(names)} *.py files, too few for a held-out split")
    train, held = split_modules(names)
    out = os.path.join(cache, "corpus")
    os.makedirs(out, exist_ok=True)
    manifest: Dict[str, Any] = {"stdlib": src, "python": platform.python_version(),
                                "holdout_rule": f"sorted index % {HOLDOUT_EVERY} == {HOLDOUT_OFFSET}",
                                "max_bytes": max_bytes}
    for part, files in (("train", train), ("val", held)):
        data = b"".join(open(os.path.join(src, f), "rb").read() + b"\n" for f in files)
        if max_bytes:
            data = data[:max_bytes]
        path = os.path.join(out, f"{part}.txt")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        manifest[part] = {"path": path, "files": len(files), "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest(), "modules": [f[:-3] for f in files]}
    return manifest


# ----------------------------------------------------------------------------- runs
def data_order_sha256(cfg) -> str:
    """sha256 of every training batch of the run, in order (what ``train.loop.run`` reads)."""
    from train import data as data_lib

    it = data_lib.make_data_iterator(cfg)
    h = hashlib.sha256()
    for s in range(cfg.train.steps):
        h.update(it.batch_at(s).astype("<i4").tobytes())
    return h.hexdigest()


def plain_bf16_run(cfg) -> Dict[str, Any]:
    """The bf16 baseline without the library's wrapper, gather or sharding: the same Flax
    model, init, batches, schedule, clipping and AdamW, applied by plain ``optax`` to float32
    params; the forward pass (training and evaluation) casts every param to bf16. That is what
    ``nvfp4.weights=bf16`` means in the stack (float32 masters, bf16 weights seen by the
    model); storing the params themselves in bf16 would also round every AdamW update to bf16,
    a weaker baseline than the one NVFP4 is compared with."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from train import data as data_lib
    from train.optimizer import schedule_for
    from train.model import cross_entropy, from_config

    model = from_config(cfg.model, cfg.nvfp4)
    o = cfg.optim
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(schedule_for(cfg), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))

    @jax.jit
    def init(key):  # the stack's init (train.loop): float32 params from the same key
        p = model.init({"params": key}, jnp.zeros((1, cfg.model.seq_len), jnp.int32))["params"]
        p = jax.tree.map(lambda a: a.astype(jnp.float32), p)
        return p, tx.init(p)

    params, opt_state = init(jax.random.key(cfg.train.seed))
    bf16 = lambda p: jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return cross_entropy(model.apply({"params": bf16(p)}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def evaluate(params, batch):
        logits = model.apply({"params": bf16(params)}, batch[:, :-1])
        return jax.vmap(cross_entropy)(logits, batch[:, 1:])

    it = data_lib.make_data_iterator(cfg)
    val = data_lib.eval_batches(cfg, data_lib.make_source(cfg.data, cfg.model, split="val"))
    losses, val_history, pending = [], [], []
    for s in range(cfg.train.steps):
        params, opt_state, loss = step(params, opt_state, it.batch_at(s))
        pending.append(loss)
        if (s + 1) % cfg.train.eval_every == 0 or s + 1 == cfg.train.steps:
            losses += [float(x) for x in jax.device_get(pending)]
            pending = []
            rows = [np.asarray(jax.device_get(evaluate(params, b)), np.float64) for b in val]
            val_history.append((s + 1, float(np.mean(np.concatenate(rows)))))
    tail = losses[-max(1, min(20, len(losses) // 5)):]  # as train.loop.run
    return {"final_loss": float(np.mean(tail)), "history": losses, "val_history": val_history,
            "final_val_loss": val_history[-1][1], "median_step_time_s": None, "skipped_steps": 0}


def host_cpu() -> str:
    """The CPU model this process runs on (``/proc/cpuinfo``'s model name, else the machine type):
    XLA:CPU compiles for the host's instruction set, so a run is bit-reproducible on the same kind
    of CPU, not across kinds."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def run_one(spec: Dict[str, Any], corpus: Dict[str, Any], cache: str, *, log=print) -> Dict[str, Any]:
    """Train one run of the grid (or read its result if ``<cache>/runs/<name>.json`` exists).
    ``spec`` may add ``extra`` overrides and ``export_hf: {step: folder}`` (bf16 Hugging Face
    checkpoints of the params after those steps)."""
    path = os.path.join(cache, "runs", spec["name"] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import jax

    from train import loop
    from train import mesh as mesh_lib

    source = source_state()
    cfg, overrides = run_config(spec["size"], spec["steps"], spec["seed"], spec["variant"], corpus,
                                spec.get("extra", ()))
    t0 = time.perf_counter()
    if spec["variant"] == "plain_bf16":
        r = plain_bf16_run(cfg)
    else:
        mesh = mesh_lib.build_mesh(cfg.mesh, jax.devices()[:1])
        r = loop.run(cfg, mesh, os.path.join(cache, "out", spec["name"]), progress=False, label=spec["name"],
                     hooks=loop.StepHooks(after_step=_exporter(cfg, spec.get("export_hf"))))
    wall = time.perf_counter() - t0
    res = {**spec, "overrides": overrides,
           "final_val_loss": r["final_val_loss"], "val_history": [list(v) for v in r["val_history"]],
           "final_train_loss": r["final_loss"],
           "train_loss_every_10": [round(x, 4) for x in r["history"][9::10]],
           "median_step_time_s": r["median_step_time_s"], "skipped_steps": r["skipped_steps"],
           "wall_s": round(wall, 1), "data_order_sha256": data_order_sha256(cfg),
           "corpus_sha256": [corpus["train"]["sha256"], corpus["val"]["sha256"]], "finished_unix": time.time(),
           "source": source, "xla_flags": os.environ.get("XLA_FLAGS", ""), "host_cpu": host_cpu()}
    if spec.get("diagnose") and spec["variant"] != "plain_bf16":
        res.update(weight_diagnostics(cfg, r))
    _write_json(path, res)
    log(f"  {spec['name']}: val {res['final_val_loss']:.4f}, train {res['final_train_loss']:.4f}, {wall:.0f} s")
    return res


def weight_diagnostics(cfg, r: Dict[str, Any]) -> Dict[str, Any]:
    """Where a weights-only gap comes from, on the run's own validation batches and model:
    ``val_loss_master`` (a run with NVFP4 weights: its float32 masters cast to bf16, no NVFP4) and
    ``val_loss_quantized`` (a bf16 run: its final weights quantized once as weights-only NVFP4 would
    store them, ``nvfp4.weights=nvfp4`` with the run's other settings) and ``val_loss_quantized_as``
    (the same weights quantized once in each other storage format of :data:`STORAGE_FORMATS`)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_nvfp4 as nv
    from jax_nvfp4.calibrate import float_weights
    from jax_nvfp4.tensor_parallel import TensorParallel
    from train.calibrate import calibration_batches
    from train.model import cross_entropy, from_config
    from train.plan import policy_for

    model = from_config(cfg.model, cfg.nvfp4).clone(compute="dequant", remat=None, tensor=TensorParallel())
    batches = calibration_batches(cfg, cfg.train.eval_batches)
    rows = jax.jit(lambda p, b: jax.vmap(cross_entropy)(model.apply({"params": p}, b[:, :-1]), b[:, 1:]))

    def loss(tree):
        return float(np.mean(np.concatenate([np.asarray(rows(tree, jnp.asarray(b)), np.float64) for b in batches])))

    if cfg.nvfp4.weights == "bf16":
        weights = float_weights(r["params"], jnp.float32)

        def stored(**fmt):
            policy = policy_for(dataclasses.replace(cfg, nvfp4=dataclasses.replace(cfg.nvfp4, weights="nvfp4", **fmt)))
            return loss(float_weights(nv.quantize_params(weights, policy)))

        return {"val_loss_quantized": stored(),
                "val_loss_quantized_as": {name: stored(**fmt) for name, fmt in STORAGE_FORMATS.items()}}
    state = nv.find_state(r["opt_state"])
    return {} if state is None else {"val_loss_master": loss(float_weights(state.master))}


def _exporter(cfg, at: Optional[Dict[int, str]]):
    """The ``after_step`` hook of a run whose spec has ``export_hf: {step: folder}``: a bf16 Hugging
    Face checkpoint of the params after each of those steps (what ``train.init_from`` reads);
    None without."""
    if not at:
        return None
    import shutil

    from jax_nvfp4.export import export_hf
    from train.hf_import import hf_config
    from train.model import HF_NAMES

    at = {int(k): v for k, v in at.items()}
    for d in at.values():
        shutil.rmtree(d, ignore_errors=True)  # a previous attempt's, interrupted before its result

    def on_step(step, params, opt_state, it):
        if step in at:
            export_hf(params, hf_config(cfg), at[step], fmt="bf16", names=HF_NAMES)

    return on_step


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(cache: str, name: str) -> bool:
    """Take run ``name`` for this process (``<cache>/claims/<name>`` holds the pid); False when
    a live process holds it. A claim whose process is gone is taken over.

    The claim file appears with its pid already in it (written to a file of this process's
    own, then hard-linked into place, which fails if the name exists): another process never
    reads a claim that is still empty and takes it for a dead one."""
    d = os.path.join(cache, "claims")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name)
    mine = f"{path}.{os.getpid()}.tmp"
    with open(mine, "w") as f:
        f.write(str(os.getpid()))
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                return True
            except FileExistsError:
                try:
                    with open(path) as f:
                        pid = int(f.read().strip())
                except (OSError, ValueError):
                    pid = 0
                if pid == os.getpid():
                    return True
                if pid and _alive(pid):
                    return False
                try:
                    os.remove(path)  # its process is gone
                except FileNotFoundError:
                    pass
        return False
    finally:
        os.remove(mine)


def work(specs: Sequence[Dict[str, Any]], corpus: Dict[str, Any], cache: str, log=print) -> None:
    """Train every run of ``specs`` in order that has no result yet and no live claim: any
    number of processes can share one grid."""
    for spec in specs:
        if os.path.exists(os.path.join(cache, "runs", spec["name"] + ".json")):
            continue
        if claim(cache, spec["name"]):
            run_one(spec, corpus, cache, log=log)


# ----------------------------------------------------------------------------- restoring recorded runs
RESULTS_JSON = {"recipe": "convergence_recipe.json", "length_sweep": "convergence_length.json",
                "text": "convergence_text.json"}
# What the reports read of a run (besides what its grid spec says), so what a restored run must hold.
RESTORED_KEYS = ("name", "size", "final_val_loss", "val_history", "data_order_sha256", "wall_s", "finished_unix")


def results_json(args) -> str:
    """The results JSON the grid of ``args`` (:func:`parse_args`) writes into ``--out``: what
    ``--from-results`` restores."""
    grid_kind = "recipe" if args.recipe else "length_sweep" if args.length_sweep else "text"
    return os.path.join(args.out, RESULTS_JSON[grid_kind])


def read_results(path: str) -> Dict[str, Any]:
    """The results JSON at ``path``, checked to hold runs a report can read (every key of
    :data:`RESTORED_KEYS`, filed under its own name); ValueError(why) otherwise."""
    if not os.path.isfile(path):
        raise ValueError("no such file (the results JSON this grid writes into --out)")
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"not readable as JSON ({type(e).__name__})") from None
    runs = payload.get("runs") if isinstance(payload, dict) else None
    if not isinstance(runs, dict):
        raise ValueError("records no 'runs': not a results JSON of this benchmark")
    for name, r in runs.items():
        lacks = [k for k in RESTORED_KEYS if not isinstance(r, dict) or k not in r]
        if lacks:
            raise ValueError(f"run {name!r} lacks {', '.join(lacks)}")
        if r["name"] != name:
            raise ValueError(f"run {name!r} is filed under another name ({r['name']!r})")
    return payload


def restore(payload: Dict[str, Any], path: str, cache: str, corpus: Dict[str, Any]) -> Dict[str, int]:
    """Write every run of ``payload`` (:func:`read_results` of ``path``) to ``<cache>/runs`` and
    every ``--rerun`` verdict it records to the reruns folder of ``cache``, leaving the ones
    already there as they are (``kept``; ``differ``: those whose final validation loss is not the
    recorded one). Refused (one line, exit 2) when its runs were trained on another corpus than
    ``corpus``: its gaps would not pair with runs trained here."""
    here = [corpus["train"]["sha256"], corpus["val"]["sha256"]]
    recorded = payload.get("corpus") or {}
    for name, r in payload["runs"].items():
        theirs = r.get("corpus_sha256") or [recorded.get(p, {}).get("sha256") for p in ("train", "val")]
        if list(theirs) != here:
            A.refuse("--from-results", path, f"run {name!r} was trained on another corpus (train sha256 "
                                             f"{str(theirs[0])[:16]}..., here {here[0][:16]}...)")
    counts = {"restored": 0, "kept": 0, "differ": 0, "reruns": 0}
    for name, record in payload["runs"].items():
        target = recorded_path(cache, name)
        if os.path.exists(target):
            counts["kept"] += 1
            with open(target) as f:
                counts["differ"] += json.load(f).get("final_val_loss") != record["final_val_loss"]
        else:
            counts["restored"] += _write_new(target, record)
    for record in payload.get("reruns") or []:
        counts["reruns"] += _write_new(os.path.join(cr.rerun_dir(cache), record["name"] + ".json"), record)
    return counts


def _write_new(path: str, record: Dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` unless a file is there (whole or not at all); whether it wrote."""
    if os.path.exists(path):
        return False
    _write_json(path, record)
    return True


def _write_json(path: str, record: Dict[str, Any]) -> None:
    """``record`` as ``path``, whole or not at all (a temporary file renamed into place)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- aggregation
def aggregate(results: Dict[str, Dict[str, Any]], seeds: Sequence[int], sizes: Sequence[str],
              lengths: Dict[str, List[int]], headline: Sequence[int] = ()) -> Dict[str, Any]:
    """Gaps per cell, levers and acceptance. The headline cell (the lever size's longest
    length) takes the ``headline`` seeds for :data:`HEADLINE_VARIANTS`, the others ``seeds``."""
    lever_size = LEVER_SIZE if LEVER_SIZE in sizes else sizes[0]
    top = max(lengths[lever_size])
    headline = sorted(set(seeds) | set(headline))
    seeds_of = lambda size, steps, v: headline if (size, steps) == (lever_size, top) and v in HEADLINE_VARIANTS else seeds
    table = []
    for size in sizes:
        for steps in sorted(lengths[size]):
            s = seeds_of(size, steps, "nvfp4")
            g = gaps(results, size, steps, s, "nvfp4")
            if g:
                g["curve"] = gap_curve(results, size, steps, s)
                table.append(g)
    levers = {}
    for v in ("nvfp4", *LEVERS):
        s = seeds_of(lever_size, top, v)
        g = gaps(results, lever_size, top, s, v, base=LEVER_BASE.get(v, "bf16"))
        if g:
            # Against the default weights-only run of the same seed as well.
            if v != "nvfp4":
                d = gaps(results, lever_size, top, s, v, base="nvfp4")
                g["vs_default_pct"] = d["gap_pct"] if d else None
            levers[v] = g
    plain = None
    a = results.get(run_name(lever_size, top, seeds[0], "plain_bf16"))
    b = results.get(run_name(lever_size, top, seeds[0], "bf16"))
    if a and b:
        plain = {"size": lever_size, "steps": top, "seed": seeds[0],
                 "plain_val": a["final_val_loss"], "wrapper_val": b["final_val_loss"],
                 "diff": b["final_val_loss"] - a["final_val_loss"],
                 "diff_pct": 100 * (b["final_val_loss"] - a["final_val_loss"]) / a["final_val_loss"],
                 "plain_train": a["final_train_loss"], "wrapper_train": b["final_train_loss"],
                 "same_data_order": a["data_order_sha256"] == b["data_order_sha256"]}
    return {"table": table, "levers": levers, "plain_baseline": plain, "acceptance": acceptance(levers),
            "lever_size": lever_size, "lever_steps": top}


# ----------------------------------------------------------------------------- report
def plot(agg: Dict[str, Any], sizes: Sequence[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(sizes))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, sharey=True)
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for ax, size in zip(axes[0], sizes):
        rows = [g for g in agg["table"] if g["size"] == size]
        for i, g in enumerate(rows):
            if not g["curve"]:
                continue
            steps = [s for s, _ in g["curve"]]
            vals = [v for _, v in g["curve"]]
            mean = [statistics.fmean(v) for v in vals]
            c = colors[i % len(colors)]
            ax.plot(steps, mean, "o-", color=c, ms=3, label=f"{g['steps']} steps (mean of {len(vals[0])} seeds)")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=c, alpha=0.2, lw=0)
        ax.axhline(0, color="k", lw=0.8)
        ax.axhline(WEIGHTS_ONLY_TARGET, color="k", ls=":", lw=0.8)
        ax.axhline(-WEIGHTS_ONLY_TARGET, color="k", ls=":", lw=0.8)
        ax.set_title(f"{size}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center")
    axes[0, 0].set_ylabel("val loss gap, % of bf16\n(NVFP4 - bf16; band: seed min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance(levers: Dict[str, Any]) -> Dict[str, Any]:
    """The verdicts of the headline cell's levers against their targets (:func:`benchmarks.stats.verdict`)."""
    return {"weights_only": verdict(levers.get("nvfp4"), WEIGHTS_ONLY_TARGET),
            "full_recipe": verdict(levers.get("compute_nvfp4"), RECIPE_TARGET),
            "full_recipe_keep_last": verdict(levers.get("compute_nvfp4_keep_last_blocks_1"), RECIPE_TARGET)}


def write_report(out: str, payload: Dict[str, Any]) -> str:
    agg, corpus, meta = payload["aggregate"], payload["corpus"], payload["meta"]
    L: List[str] = ["# Convergence on real text: NVFP4 vs bf16 validation loss", "",
                    f"Reproduce everything (corpus, grid, this report, the JSON and the plot): `{meta['command']}`.",
                    f"Grid run time: {meta['grid_wall_h']}, {meta['runs_done']} of {meta['runs_total']} runs "
                    f"({meta['where']}).",
                    "Rerunning the command resumes: finished runs are read back from the cache folder "
                    "(`runs/convergence-text/runs/*.json`); `--report-only` rebuilds this report from them.", ""]
    if meta["missing"]:
        L += [f"**Not run ({len(meta['missing'])} of {meta['runs_total']}):** "
              + ", ".join(f"`{m}`" for m in meta["missing"]) + ".", ""]
    L += ["## Corpus", "",
          f"Python {corpus['python']}'s standard library, top-level modules (`{corpus['stdlib']}/*.py`), sorted "
          f"by name; held out whole: {corpus['holdout_rule']}. Byte-level tokens (vocab 256, `data.source=file`).", "",
          "| part | modules | bytes | sha256 |", "|---|---:|---:|---|"]
    for part in ("train", "val"):
        c = corpus[part]
        L.append(f"| {part} | {c['files']} | {c['bytes']:,} | `{c['sha256'][:16]}...` |")
    L += ["", "Held-out modules: " + ", ".join(f"`{m}`" for m in corpus["val"]["modules"]) + ".", "",
          "## Setup", "",
          f"One device per run, `train.seed = data.seed = seed` for seeds {meta['seeds']} (the headline cell, "
          f"{agg['lever_size']} at {agg['lever_steps']} steps: seeds {meta.get('headline_seeds', meta['seeds'])} for "
          f"{', '.join(HEADLINE_VARIANTS)}): the NVFP4 and bf16 runs "
          f"of a seed read the same batches in the same order (checked: sha256 of every training batch, equal in "
          f"every pair: **{meta['same_data_order']}**) and are evaluated on the same {EVAL_BATCHES} held-out "
          f"batches, every tenth of the run and at the end. Metric: the final validation loss. Gap = (NVFP4 - bf16) "
          f"/ bf16, in % of the bf16 validation loss, paired by seed; shown as mean [min, max] (std) over seeds.", "",
          "| size | model | steps | tokens seen (per non-embedding parameter) | bf16 val loss (mean) | "
          "NVFP4 val loss (mean) | gap % of bf16 |",
          "|---|---|---:|---:|---:|---:|---|"]
    L[-2:-2] = source_lines(meta, agg)
    params = {size: non_embedding_of(m) for size, m in meta["models"].items()}
    for g in agg["table"]:
        m = meta["models"][g["size"]]
        tokens = g["steps"] * m["batch_size"] * m["seq_len"]
        L.append(f"| {g['size']} | {m['layers']} layers, d {m['d_model']}, MLP {m['mlp_hidden']}, "
                 f"{m['batch_size']}x{m['seq_len']} tokens/step | {g['steps']} | "
                 f"{tokens:,} ({tokens / params[g['size']]:.2f}) | {g['base_val']['mean']:.4f} | "
                 f"{g['val']['mean']:.4f} | {pct_text(g['gap_pct'])} |")
    L += ["", "![gap against steps](convergence_text.png)", ""]
    L += width_section(agg["table"], meta["models"])
    lv = agg["levers"]
    if lv:
        L += [f"## Levers ({agg['lever_size']} model, {agg['lever_steps']} steps, seeds {meta['seeds']}; "
              f"{', '.join(v for v in HEADLINE_VARIANTS if v != 'bf16')}: seeds "
              f"{meta.get('headline_seeds', meta['seeds'])})", "",
              "| setting | val loss (mean) | gap % of bf16 | minus default NVFP4, % |", "|---|---:|---|---|"]
        for v, g in lv.items():
            vs = g.get("vs_default_pct")
            own = " (vs bf16 with the same split)" if g["base"] != "bf16" else ""
            L.append(f"| {LEVER_NAMES[v]} | {g['val']['mean']:.4f} | {pct_text(g['gap_pct'])}{own} | "
                     f"{pct_text(vs) if vs else '-'} |")
        L.append("")
        if "keep_last_blocks_1" in lv:
            b = lv["keep_last_blocks_1"]["base_val"]["mean"]
            L += ["`nvfp4.keep_last_blocks=1` puts the last block in a scanned segment of its own, whose "
                  "params are drawn from other init keys: its gap is taken against bf16 weights with the same "
                  f"split (`nvfp4.weights=bf16 nvfp4.keep_last_blocks=1`, mean val loss {b:.4f}), and its "
                  "difference from the default NVFP4 run mixes the lever with a different init.", ""]
    p = agg["plain_baseline"]
    if p:
        L += ["## The bf16 baseline against plain optax", "",
              f"`plain_bf16`: the same Flax model, init, batches (same data-order hash: {p['same_data_order']}), "
              "schedule, clipping and AdamW, applied by plain `optax` to float32 params, every param cast to bf16 "
              "for the forward pass; no wrapper, gather or sharding. That is what `nvfp4.weights=bf16` means in the "
              "stack (float32 masters, bf16 weights seen by the model); keeping the params themselves in bf16 would "
              "also round every update to bf16, a weaker baseline.", "",
              f"| {p['size']}, {p['steps']} steps, seed {p['seed']} | validation loss | training loss (last 20 steps) |",
              "|---|---:|---:|",
              f"| stack, `nvfp4.weights=bf16` | {p['wrapper_val']:.4f} | {p['wrapper_train']:.4f} |",
              f"| plain optax + flax | {p['plain_val']:.4f} | {p['plain_train']:.4f} |",
              f"| difference | {p['diff']:+.4f} ({p['diff_pct']:+.3f}%) | {p['wrapper_train'] - p['plain_train']:+.4f} |",
              ""]
    a = acceptance(agg["levers"])  # judged by today's rule, also for a payload read back from its JSON
    L += ["## Acceptance", "",
          "Rule: mean gap <= target.", "",
          f"- Weights-only NVFP4 (default), {agg['lever_size']} model, {agg['lever_steps']} steps: target "
          f"{WEIGHTS_ONLY_TARGET}% -> **{met_text(a['weights_only'])}** ({a['weights_only']['why']}).",
          f"- Full recipe (`nvfp4.compute=nvfp4`): target {RECIPE_TARGET}% -> **{met_text(a['full_recipe'])}** "
          f"({a['full_recipe']['why']}).",
          *([f"- Full recipe with the last block's GEMMs in bf16 (`nvfp4.compute=nvfp4 nvfp4.keep_last_blocks=1`, "
             f"against bf16 with the same split): target {RECIPE_TARGET}% -> **{met_text(a['full_recipe_keep_last'])}** "
             f"({a['full_recipe_keep_last']['why']})."] if a.get("full_recipe_keep_last", {}).get("met") is not None
            else []), ""]
    L += findings(agg)
    text = "\n".join(L) + "\n"
    path = os.path.join(out, "CONVERGENCE_TEXT.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def findings(agg: Dict[str, Any]) -> List[str]:
    L = ["## Which levers help", "",
         f"Against the default weights-only NVFP4 run of the same seed ({agg['lever_size']} model, "
         f"{agg['lever_steps']} steps):", ""]
    p = agg.get("plain_baseline")
    noise = abs(p["diff_pct"]) if p else 0.0
    for v, g in agg["levers"].items():
        if v != "nvfp4":
            L.append(f"- {LEVER_NAMES[v]}: {lever_effect(g, noise)} "
                     f"({pct_text(g['vs_default_pct']) if g.get('vs_default_pct') else '-'}).")
    tried = [LEVER_NAMES[v] for v, g in agg["levers"].items()
             if v not in RECIPE_LEVERS and g["gap_pct"]["mean"] <= WEIGHTS_ONLY_TARGET]
    L += ["", "Weights-only settings whose mean gap is within the "
          f"{WEIGHTS_ONLY_TARGET}% target: " + (", ".join(tried) if tried else "none of those tried") + ".", ""]
    return L


def width_section(table: Sequence[Dict[str, Any]], models: Dict[str, Dict[str, Any]]) -> List[str]:
    """The gap against model width at the longest training length that three or more sizes
    share (the sizes differ only in width), each judged by the weights-only rule."""
    by_steps: Dict[int, List[Dict[str, Any]]] = {}
    for g in table:
        by_steps.setdefault(g["steps"], []).append(g)
    shared = [s for s, gs in by_steps.items() if len(gs) >= 3]
    if not shared:
        return []
    steps = max(shared)
    rows = sorted(by_steps[steps], key=lambda g: (models[g["size"]]["d_model"], models[g["size"]]["mlp_hidden"]))
    shape = {tuple(models[g["size"]][k] for k in ("layers", "seq_len", "batch_size")) for g in rows}
    same = ("The sizes share depth ({} layers), sequence length ({}) and batch ({}); ".format(*shape.pop())
            if len(shape) == 1 else "The sizes differ in more than width; ")
    L = [f"## Gap against width ({steps} steps)", "",
         same + f"the rule is the weights-only one of the acceptance below ({WEIGHTS_ONLY_TARGET}%).", "",
         "| size | d_model | MLP | gap % of bf16 | rule |", "|---|---:|---:|---|---|"]
    for g in rows:
        m, v = models[g["size"]], verdict(g, WEIGHTS_ONLY_TARGET)
        L.append(f"| {g['size']} | {m['d_model']} | {m['mlp_hidden']} | {pct_text(g['gap_pct'])} | {met_text(v)}: {v['why']} |")
    return L + [""]


# ----------------------------------------------------------------------------- driver
def one_device(cache: str) -> None:
    """What every run of the grid trains on: one (CPU) device, and the compile cache in ``cache``."""
    request_cpu_devices(1)
    use_compile_cache(os.path.join(cache, "jax-cache"))  # runs that differ only in their seed


def parse_args(argv: Sequence[str]):
    """The grid's arguments; a bad one is one line on stderr and exit 2 before anything is
    trained or written (:mod:`benchmarks.arguments`)."""
    p = A.Parser(prog="python -m benchmarks convergence --text",
                 description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--out", type=A.output_dir, default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT})")
    p.add_argument("--cache", type=A.output_dir, default=DEFAULT_CACHE,
                   help=f"corpus, per-run results and compile cache (default {DEFAULT_CACHE})")
    p.add_argument("--sizes", help=f"model sizes (default {','.join(WEIGHTS_SIZES)}; with --recipe "
                                   f"{','.join(RECIPE_SIZES)})")
    p.add_argument("--recipe", action="store_true",
                   help="the full recipe's width sweep and ablation instead (CONVERGENCE_RECIPE.md)")
    p.add_argument("--length-sweep", action="store_true",
                   help=f"the gap against training length instead (CONVERGENCE_LENGTH.md): size {LENGTH_SIZE} "
                        "unless --sizes says otherwise, budgets --budgets")
    p.add_argument("--budgets", type=A.int_list(minimum=1),
                   help="--length-sweep: training budgets in tokens per non-embedding parameter (default "
                        f"{','.join(map(str, LENGTH_BUDGETS))})")
    p.add_argument("--levers", action="store_true",
                   help="--length-sweep: also weights-only NVFP4 with each lever (bf16 last block, 2d tiles, "
                        "stochastic rounding of the re-quantization, 4/6 scales) at the longest budget (or "
                        "--levers-at)")
    p.add_argument("--levers-at", metavar="BUDGET", type=A.positive_int,
                   help="--levers: the budget (of --budgets) the levers run at, if not the longest")
    p.add_argument("--lever-seeds", metavar="SEEDS", type=A.seed_list,
                   help="--levers: more seeds for the levers and the runs they are judged against (bf16, the "
                        "default weights-only run, bf16 with the last block's split), at the levers' budget only")
    p.add_argument("--ablation-at", metavar="SIZES",
                   help="--recipe: the sizes (of --sizes) the ablation runs at (default: the widest; "
                        "'none': no ablation)")
    p.add_argument("--lr-check", metavar="SEEDS", type=A.int_list(minimum=0, empty=True), default="",
                   help=f"--recipe: at every size, the last-block-bf16 pair again at optim.lr={LR_HALF} "
                        "for these seeds (default none)")
    p.add_argument("--seeds-at", metavar="SIZE=FIRST-LAST", type=A.seed_ranges(list(RECIPE_SIZES), "size"),
                   help="--recipe: also the sweep's two pairs at SIZE (of --sizes) for seeds FIRST..LAST, reported "
                        f"in a section of their own (is the gap below {SEEDS_AT_BOUND:g}%%?), e.g. l4-d256=0-7")
    p.add_argument("--train-seeds", metavar="SEEDS", type=A.seed_list,
                   help="train only the runs of these seeds (the report still covers every run of the grid)")
    p.add_argument("--from-results", action="store_true",
                   help="first restore every run (and --rerun verdict) the grid's results JSON in --out records "
                        "into the cache, leaving those already there: finished runs are not trained again")
    p.add_argument("--rerun", metavar="NAME",
                   help="train the finished run NAME of this grid again (in <cache>/reruns) and compare its "
                        "losses with the recorded ones bit for bit")
    p.add_argument("--only", help=argparse.SUPPRESS)  # train only these runs (comma-separated names)
    p.add_argument("--seeds", type=A.seed_list, default=",".join(map(str, SEEDS)), help="seeds (default 0,1,2)")
    p.add_argument("--headline-seeds", type=A.nonnegative_int, default=HEADLINE_SEEDS,
                   help=f"the default model's longest cell (NVFP4, bf16, 2d tiles) also runs seeds 0..N-1 "
                        f"(default {HEADLINE_SEEDS})")
    p.add_argument("--lengths", type=A.lengths_map(list(SIZES)), help="override lengths, e.g. tiny=20:40,default=40")
    p.add_argument("--no-levers", action="store_true", help="skip the lever runs")
    p.add_argument("--no-plain", action="store_true", help="skip the plain-optax baseline")
    p.add_argument("--workers", type=A.positive_int, default=1, help="processes training runs in parallel (default 1)")
    p.add_argument("--shard", type=A.shard, help=argparse.SUPPRESS)  # i/N: one of N worker processes
    p.add_argument("--max-bytes", type=A.positive_int, help=argparse.SUPPRESS)  # cap the corpus (tests)
    p.add_argument("--report-only", action="store_true", help="aggregate the finished runs, train nothing")
    args = p.parse_args(list(argv))
    if args.length_sweep and args.recipe:
        p.error("--length-sweep and --recipe are two grids: one at a time")
    if args.budgets is not None and not args.length_sweep:
        p.error(f"--budgets {','.join(map(str, args.budgets))}: belongs to --length-sweep")
    args.budgets = list(args.budgets or LENGTH_BUDGETS)
    allowed = list(RECIPE_SIZES if args.recipe or args.length_sweep else WEIGHTS_SIZES)
    what = "--recipe size" if args.recipe else "--length-sweep size" if args.length_sweep else "size"
    args.sizes = (A.checked(p, "--sizes", A.name_list(allowed, what), args.sizes) if args.sizes is not None
                  else [LENGTH_SIZE] if args.length_sweep else allowed)
    if args.ablation_at is not None:
        raw = args.ablation_at
        args.ablation_at = [] if raw == "none" else [s for s in raw.split(",") if s]
        if not args.recipe:
            p.error(f"--ablation-at {A.show(raw)}: belongs to --recipe")
        for s in args.ablation_at:
            if s not in args.sizes:
                p.error(f"--ablation-at {A.show(raw)}: {s!r}: the ablation runs at sizes of --sizes "
                        f"({', '.join(args.sizes)})")
    if args.levers and not args.length_sweep:
        p.error("--levers: belongs to --length-sweep (the other grids run their levers unless --no-levers)")
    if args.lever_seeds is not None:
        raw = ",".join(map(str, args.lever_seeds))
        if not args.levers:
            p.error(f"--lever-seeds {raw}: belongs to --levers")
        if not set(args.lever_seeds) - set(args.seeds):
            p.error(f"--lever-seeds {raw}: every seed is in --seeds already ({','.join(map(str, args.seeds))})")
    if args.levers_at is not None and (not args.levers or args.levers_at not in args.budgets):
        p.error(f"--levers-at {args.levers_at}: " + ("belongs to --levers" if not args.levers else
                f"not one of --budgets ({','.join(map(str, args.budgets))})"))
    if args.lr_check and not args.recipe:
        p.error(f"--lr-check {','.join(map(str, args.lr_check))}: belongs to --recipe")
    if args.seeds_at is not None:
        raw = ",".join(f"{k}={v[0]}-{v[-1]}" for k, v in args.seeds_at.items())
        if not args.recipe:
            p.error(f"--seeds-at {raw}: belongs to --recipe")
        for size in args.seeds_at:
            if size not in args.sizes:
                p.error(f"--seeds-at {raw}: {size!r}: the pairs run at sizes of --sizes ({', '.join(args.sizes)})")
    args.restore = None
    if args.from_results:
        path = results_json(args)
        try:
            args.restore = read_results(path)
        except ValueError as e:
            p.error(f"--from-results {A.show(path)}: {e}")
    args.headline = headline_seeds(args.seeds, args.headline_seeds)
    lengths = {k: list(v) for k, v in LENGTHS.items()}
    lengths.update(args.lengths or {})
    args.lengths_map = lengths
    specs = specs_of(args)
    names = {s["name"] for s in specs}
    for flag, value in (("--rerun", args.rerun), ("--only", args.only)):
        for name in (value or "").split(","):
            if name and name not in names:
                p.error(f"{flag} {A.show(value)}: {name!r} is not a run of this grid")
    if args.train_seeds is not None:
        raw = ",".join(map(str, args.train_seeds))
        for flag, on in (("--report-only", args.report_only), ("--rerun", args.rerun)):
            if on:
                p.error(f"--train-seeds {raw}: {flag} trains " + ("nothing" if flag == "--report-only" else "one run"))
        have = sorted({s["seed"] for s in specs})
        for seed in args.train_seeds:
            if seed not in have:
                p.error(f"--train-seeds {raw}: no run of this grid has seed {seed} (its seeds: "
                        f"{', '.join(map(str, have))})")
    return args


def specs_of(args) -> List[Dict[str, Any]]:
    """The runs of the grid ``args`` (:func:`parse_args`) asks for, in training order."""
    if args.recipe:
        return recipe_grid(args.sizes, args.seeds, args.ablation_at, args.lr_check, args.seeds_at)
    if args.length_sweep:
        if getattr(args, "shapes", None) is None:
            args.shapes = {size: size_shape(size) for size in args.sizes}
        return length_grid(args.shapes, args.budgets, args.seeds, levers=args.levers, levers_at=args.levers_at,
                           lever_seeds=args.lever_seeds or ())
    return grid(args.sizes, args.seeds, args.lengths_map, levers=not args.no_levers, plain=not args.no_plain,
                headline=args.headline)


def without(argv: Sequence[str], opt: str) -> List[str]:
    """``argv`` less ``opt VALUE`` / ``opt=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == opt:
            skip = True
        elif not a.startswith(opt + "="):
            out.append(a)
    return out


def _command(argv: Sequence[str]) -> str:
    """The command that makes the grid of ``argv`` from scratch: less what says which runs this
    invocation trains and where the finished ones come from."""
    keep = [a for a in without(without(argv, "--shard"), "--train-seeds")
            if a not in ("--report-only", "--from-results")]
    return " ".join(["python -m benchmarks convergence --text", *keep])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    specs = specs_of(args)
    if (args.rerun and not os.path.exists(recorded_path(args.cache, args.rerun))
            and args.rerun not in (args.restore or {}).get("runs", {})):
        A.refuse("--rerun", args.rerun, f"not finished yet ({recorded_path(args.cache, args.rerun)} does not exist)")
    if args.only:
        specs = [s for s in specs if s["name"] in args.only.split(",")]
    train = [s for s in specs if args.train_seeds is None or s["seed"] in args.train_seeds]
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)
    corpus_path = os.path.join(args.cache, "corpus.json")
    if args.shard:
        with open(corpus_path) as f:
            corpus = json.load(f)
        one_device(args.cache)
        work(train, corpus, args.cache, log)
        return 0
    corpus = build_corpus(args.cache, max_bytes=args.max_bytes)
    os.makedirs(args.cache, exist_ok=True)
    with open(corpus_path, "w") as f:
        json.dump(corpus, f, indent=1)
    log(f"corpus: {corpus['train']['files']} train modules ({corpus['train']['bytes']:,} bytes), "
        f"{corpus['val']['files']} held out ({corpus['val']['bytes']:,} bytes); {len(specs)} runs"
        + (f", {len(train)} of them of seeds {','.join(map(str, args.train_seeds))}" if args.train_seeds else ""))
    if args.restore:
        n = restore(args.restore, results_json(args), args.cache, corpus)
        differ = f" ({n['differ']} of them with another final validation loss than the recorded one)"
        log(f"--from-results {results_json(args)}: {n['restored']} runs and {n['reruns']} rerun verdicts restored, "
            f"{n['kept']} runs already in the cache kept" + (differ if n["differ"] else ""))
    if args.rerun:
        return rerun(args, argv, specs, corpus, log)
    if not args.report_only:
        # Runs train with WORKER_XLA_FLAGS, whatever the number of workers: XLA's threading changes
        # a run's numbers. This process trains them itself only where it has those flags already.
        if args.workers > 1 or WORKER_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            codes = _spawn(without(argv, "--workers"), args.workers)
            if any(codes):
                log(f"workers exited with {codes}; the finished runs are kept, rerun to resume")
        else:
            one_device(args.cache)
            work(train, corpus, args.cache, log)
    results = {}
    for spec in specs:
        path = os.path.join(args.cache, "runs", spec["name"] + ".json")
        if os.path.exists(path):
            with open(path) as f:
                results[spec["name"]] = json.load(f)
            results[spec["name"]].setdefault("finished_unix", os.path.getmtime(path))
    wall = time.perf_counter() - t_start
    if args.recipe:
        path = cr.write(args.out, cr.assemble(results, specs, corpus, args, _command(argv), wall, args.cache))
        log(f"wrote {path}, convergence_recipe.json and convergence_recipe.png ({len(results)}/{len(specs)} runs)")
        return 0 if len(results) == len(specs) else 1
    if args.length_sweep:
        path = cl.write(args.out, cl.assemble(results, specs, corpus, args, _command(argv), wall, args.cache))
        log(f"wrote {path} and convergence_length.json ({len(results)}/{len(specs)} runs)")
        return 0 if len(results) == len(specs) else 1
    payload = assemble(results, specs, corpus, args, argv, wall)
    os.makedirs(args.out, exist_ok=True)
    plot(payload["aggregate"], args.sizes, os.path.join(args.out, "convergence_text.png"))
    with open(os.path.join(args.out, "convergence_text.json"), "w") as f:
        json.dump(payload, f, indent=1)
    path = write_report(args.out, payload)
    for g in payload["aggregate"]["table"]:
        log(f"{g['size']:>8} {g['steps']:>5} steps: gap {pct_text(g['gap_pct'])}")
    log(f"wrote {path}, convergence_text.json and convergence_text.png ({len(results)}/{len(specs)} runs)")
    return 0 if len(results) == len(specs) else 1


# The worker processes' XLA flags: one thread each (runs in parallel share the cores).
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _spawn(argv: Sequence[str], n: int) -> List[int]:
    """Run ``n`` worker processes (``--shard=i/n``) of this grid; their exit codes."""
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + WORKER_XLA_FLAGS).strip()}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.convergence_text", *argv, f"--shard={i}/{n}"],
                              cwd=os.getcwd(), env=env) for i in range(n)]
    return [p.wait() for p in procs]


def recorded_path(cache: str, name: str) -> str:
    """Where run ``name``'s result is kept once it finished."""
    return os.path.join(cache, "runs", name + ".json")


def lacking_diagnostics(recorded: Dict[str, Any], again: Dict[str, Any]):
    """``(record, names)``: ``recorded`` with the diagnostics (``val_loss_*``) of ``again`` it lacks,
    keys and entries of a mapping such as ``val_loss_quantized_as`` (a format added later); what it
    has is kept as recorded."""
    out, added = dict(recorded), []
    for k, v in again.items():
        if not k.startswith("val_loss_"):
            continue
        if k not in out:
            out[k] = v
            added.append(k)
        elif isinstance(v, dict) and isinstance(out[k], dict):
            new = {kk: vv for kk, vv in v.items() if kk not in out[k]}
            if new:
                out[k] = {**out[k], **new}
                added += [f"{k}.{kk}" for kk in new]
    return out, sorted(added)


def rerun(args, argv, specs, corpus, log) -> int:
    """``--rerun NAME``: train run NAME again in a worker process (the grid's own flags) into
    ``<cache>/reruns/cache``, compare its losses with the recorded run's and write the verdict
    to ``<cache>/reruns/NAME.json`` (the report lists it). Exit 0 when bit for bit identical."""
    name = args.rerun
    if name not in {s["name"] for s in specs}:
        log(f"--rerun {name}: not a run of this grid")
        return 2
    if not os.path.exists(recorded_path(args.cache, name)):
        log(f"--rerun {name}: not finished yet ({recorded_path(args.cache, name)} does not exist)")
        return 2
    with open(recorded_path(args.cache, name)) as f:
        recorded = json.load(f)
    scratch = os.path.join(cr.rerun_dir(args.cache), "cache")
    fresh = os.path.join(scratch, "runs", name + ".json")
    for p in (fresh, os.path.join(scratch, "claims", name)):
        if os.path.exists(p):
            os.remove(p)
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, "corpus.json"), "w") as f:
        json.dump(corpus, f, indent=1)
    base = without(without(without(argv, "--rerun"), "--cache"), "--workers")
    codes = _spawn([*base, f"--cache={scratch}", f"--only={name}"], 1)
    if codes != [0] or not os.path.exists(fresh):
        log(f"--rerun {name}: the worker exited with {codes}")
        return 1
    with open(fresh) as f:
        again = json.load(f)
    verdict = cr.compare(name, recorded, again)
    with open(os.path.join(cr.rerun_dir(args.cache), name + ".json"), "w") as f:
        json.dump(verdict, f, indent=1)
    log(f"{name}: recorded val {recorded['final_val_loss']!r}, retrained {again['final_val_loss']!r}: "
        + ("bit for bit identical" if verdict["identical"] else f"DIFFERENT ({verdict['fields']})")
        + (f"; not recorded, so not compared: {', '.join(verdict['not_recorded'])}"
           if verdict.get("not_recorded") else ""))
    merged, added = lacking_diagnostics(recorded, again)
    if verdict["identical"] and added:
        # The same final weights bit for bit: the diagnostics the record lacks (it was trained by code
        # that did not compute them) are the record's own.
        _write_json(recorded_path(args.cache, name), merged)
        log(f"{name}: the record takes the retrained run's {', '.join(added)}")
    return 0 if verdict["identical"] else 1


def assemble(results, specs, corpus, args, argv, wall: float) -> Dict[str, Any]:
    from benchmarks.train_step import model_summary

    agg = aggregate(results, args.seeds, args.sizes, args.lengths_map, args.headline)
    models = {}
    for size in args.sizes:
        cfg, _ = run_config(size, 10, 0, "nvfp4", corpus)
        models[size] = model_summary(cfg)
    meta = {"seeds": list(args.seeds), "headline_seeds": list(args.headline), "sizes": list(args.sizes),
            "lengths": args.lengths_map, "models": models, **run_meta(results, specs, _command(argv), wall)}
    return {"meta": meta, "corpus": corpus, "aggregate": agg, "runs": stored_runs(results)}


if __name__ == "__main__":
    sys.exit(main())
