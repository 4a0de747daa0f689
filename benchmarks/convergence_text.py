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

Grid (:func:`grid`):

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
others). ``--rerun NAME`` trains one
finished run again and compares its losses with the recorded ones bit for bit.

Each finished run writes ``<cache>/runs/<name>.json``; a rerun skips those, so an interrupted
grid resumes. ``--workers N`` splits the runs over N processes. A run records the code it was
trained by (:func:`source_state`: a hash of the sources as its process loaded them, the commit,
uncommitted changes); the report names every pair whose two runs ran different code. After a
change to the library or the stack, delete the runs it affects and rerun.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.common import ROOT, SOURCES, git_commit, request_cpu_devices, source_state, use_compile_cache

DEFAULT_OUT = os.path.join("benchmarks", "results")
DEFAULT_CACHE = os.path.join("runs", "convergence-text")
HOLDOUT_EVERY = 10
HOLDOUT_OFFSET = 5
EVAL_BATCHES = 32
SEEDS = (0, 1, 2)
# The headline cell (the default model's longest runs: NVFP4, bf16 and the 2d-tile lever) runs
# seeds 0..7: one seed moves the gap by about 1% of the loss, so three cannot resolve the 0.5%
# target, nor the block lever.
HEADLINE_SEEDS = 8
HEADLINE_VARIANTS = ("nvfp4", "bf16", "block_2d")

# Model sizes (train/configs plus overrides). small.yaml (4 layers, d_model 128, 32 x 128
# tokens per step) costs ~1.6 s a step on one shared CPU core, 20x the tiny model, so the
# larger sizes here widen the default model and keep its depth, sequence length and batch:
# "wide" at small.yaml's width (d_model 128, 4 heads, MLP 352), "wider" at d_model 256 (8
# heads of 32, MLP 704 = 16 x 44): how the gap moves with width at one training length.
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": {"config": "tiny.yaml", "overrides": []},
    "default": {"config": "default.yaml", "overrides": []},
    "wide": {"config": "default.yaml",
             "overrides": ["model.d_model=128", "model.heads=4", "model.mlp_hidden=352"]},
    "wider": {"config": "default.yaml",
              "overrides": ["model.d_model=256", "model.heads=8", "model.mlp_hidden=704"]},
}
# The full recipe's width sweep (``--recipe``): the default model at 4 layers (so a bf16 last
# block is a quarter of the blocks' linear layers, the nearest 4 layers come to the published
# ~16%), widened as above with 32-wide heads; 2000 steps.
RECIPE_SIZES: Dict[str, Dict[str, Any]] = {
    f"l4-d{d}": {"config": "default.yaml",
                 "overrides": [f"model.d_model={d}", f"model.heads={d // 32}", f"model.mlp_hidden={h}", "model.layers=4"]}
    for d, h in ((64, 192), (128, 352), (256, 704), (512, 1408))
}
SIZES.update(RECIPE_SIZES)
RECIPE_STEPS = 2000
# Training lengths per size, shortest first; the longest of the smallest model >= 2000 steps.
LENGTHS: Dict[str, List[int]] = {"tiny": [500, 2000], "default": [500, 2000], "wide": [150, 600, 2000],
                                 "wider": [2000]}
LENGTHS.update({size: [RECIPE_STEPS] for size in RECIPE_SIZES})
WEIGHTS_SIZES = ("tiny", "default", "wide", "wider")
LEVER_SIZE = "default"

VARIANTS: Dict[str, List[str]] = {
    "bf16": ["nvfp4.weights=bf16"],
    "nvfp4": ["nvfp4.weights=nvfp4"],
    "block_2d": ["nvfp4.weights=nvfp4", "nvfp4.block=2d"],
    "stochastic_rounding": ["nvfp4.weights=nvfp4", "nvfp4.stochastic_rounding=true"],
    "keep_last_blocks_1": ["nvfp4.weights=nvfp4", "nvfp4.keep_last_blocks=1"],
    "cast_master_bf16": ["nvfp4.weights=nvfp4", "nvfp4.cast_master_bf16=true"],
    "compute_nvfp4": ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4"],
    # The published recipe keeps the last layers' GEMMs in high precision.
    "compute_nvfp4_keep_last_blocks_1": ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4", "nvfp4.keep_last_blocks=1"],
    "plain_bf16": [],  # no wrapper: plain optax on float32 params, bf16 forward
    # keep_last_blocks splits the scanned blocks into two segments, whose params are drawn
    # from other init keys: its bf16 baseline has the same split (the same init).
    "bf16_keep_last_blocks_1": ["nvfp4.weights=bf16", "nvfp4.keep_last_blocks=1"],
}
# The recipe sweep: the full recipe against bf16, with and without the bf16 last block (each
# against bf16 with the same split), in the order a seed's runs are trained.
RECIPE_VARIANTS = ("bf16_keep_last_blocks_1", "compute_nvfp4_keep_last_blocks_1", "bf16", "compute_nvfp4")
RECIPE_PAIRS = {"compute_nvfp4": "bf16", "compute_nvfp4_keep_last_blocks_1": "bf16_keep_last_blocks_1"}
# The ablation (at the sweep's widest width unless --ablation-at says otherwise): the full recipe with its last block in bf16, one
# element switched off at a time.
_RECIPE_KL = ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4", "nvfp4.keep_last_blocks=1"]
ABLATIONS: Dict[str, List[str]] = {
    "recipe_1d_weights": [*_RECIPE_KL, "nvfp4.block=1d"],
    "recipe_nearest_grads": [*_RECIPE_KL, "nvfp4.grad_rounding=nearest"],
    "recipe_no_hadamard": [*_RECIPE_KL, "nvfp4.wgrad_hadamard=false"],
    "recipe_bf16_activations": [*_RECIPE_KL, "nvfp4.activations=bf16"],
}
VARIANTS.update(ABLATIONS)
# The learning-rate check: the last-block-bf16 pair again at half the default model's
# learning rate (optim.lr 3e-3 -> 1.5e-3), at every width: whether a gap is measured against a
# bf16 baseline the learning rate holds back (a wider model wants a smaller one).
LR_HALF = 1.5e-3
LR_CHECK: Dict[str, List[str]] = {
    f"{v}_lr_half": [*VARIANTS[v], f"optim.lr={LR_HALF}"]
    for v in ("bf16_keep_last_blocks_1", "compute_nvfp4_keep_last_blocks_1")}
VARIANTS.update(LR_CHECK)
ABLATION_NAMES = {
    "recipe_1d_weights": "2D weights -> 1D (`nvfp4.block=1d`)",
    "recipe_nearest_grads": "no stochastic rounding (`nvfp4.grad_rounding=nearest`)",
    "recipe_no_hadamard": "no Hadamard transform (`nvfp4.wgrad_hadamard=false`)",
    "recipe_bf16_activations": "activations in bf16 (`nvfp4.activations=bf16`)",
}
# The bf16 run a lever is compared with: the same model, init and batches.
LEVER_BASE = {"keep_last_blocks_1": "bf16_keep_last_blocks_1",
              "compute_nvfp4_keep_last_blocks_1": "bf16_keep_last_blocks_1"}
LEVERS = ("block_2d", "stochastic_rounding", "keep_last_blocks_1", "cast_master_bf16", "compute_nvfp4",
          "compute_nvfp4_keep_last_blocks_1")
# The levers that quantize activations and gradients too (judged by RECIPE_TARGET).
RECIPE_LEVERS = ("compute_nvfp4", "compute_nvfp4_keep_last_blocks_1")
LEVER_NAMES = {
    "nvfp4": "1d blocks, round to nearest (default weights-only)",
    "block_2d": "`nvfp4.block=2d` (16x16 tiles)",
    "stochastic_rounding": "`nvfp4.stochastic_rounding=true`",
    "keep_last_blocks_1": "`nvfp4.keep_last_blocks=1`",
    "cast_master_bf16": "`nvfp4.cast_master_bf16=true`",
    "compute_nvfp4": "`nvfp4.compute=nvfp4` (full recipe)",
    "compute_nvfp4_keep_last_blocks_1": "`nvfp4.compute=nvfp4 nvfp4.keep_last_blocks=1` (full recipe, last block bf16)",
}
WEIGHTS_ONLY_TARGET = 0.5  # % of the bf16 validation loss
RECIPE_TARGET = 1.5


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
def run_name(size: str, steps: int, seed: int, variant: str) -> str:
    return f"{size}-{steps}-s{seed}-{variant}"


def headline_seeds(seeds: Sequence[int], n: int = HEADLINE_SEEDS) -> List[int]:
    """The seeds of the headline cell: ``seeds`` and 0..n-1."""
    return sorted(set(seeds) | set(range(n)))


def grid(sizes: Sequence[str] = WEIGHTS_SIZES, seeds: Sequence[int] = SEEDS,
         lengths: Optional[Dict[str, List[int]]] = None, levers: bool = True, plain: bool = True,
         headline: Sequence[int] = ()) -> List[Dict[str, Any]]:
    """The runs, most important first: the default model's longest pairs, the plain baseline,
    the levers (seed by seed), the headline cell's further seeds (``headline``), then the other
    sizes and lengths (short runs first)."""
    lengths = lengths or LENGTHS
    specs: List[Dict[str, Any]] = []
    add = lambda size, steps, seed, v: specs.append(
        {"size": size, "steps": steps, "seed": seed, "variant": v, "name": run_name(size, steps, seed, v)})
    lever_size = LEVER_SIZE if LEVER_SIZE in sizes else sizes[0]
    top = max(lengths[lever_size])
    for seed in seeds:
        add(lever_size, top, seed, "nvfp4")
        add(lever_size, top, seed, "bf16")
    if plain:
        add(lever_size, top, seeds[0], "plain_bf16")
    if levers:
        for seed in seeds:
            add(lever_size, top, seed, LEVER_BASE["keep_last_blocks_1"])  # seed-major: a grid stopped early still has every lever on some seeds
        for seed in seeds:
            for lever in LEVERS:
                add(lever_size, top, seed, lever)
    for seed in headline:
        if seed not in seeds:
            for v in HEADLINE_VARIANTS:
                if levers or v != "block_2d":
                    add(lever_size, top, seed, v)
    for rank in range(max(len(v) for v in lengths.values())):
        for size in sizes:
            if rank < len(lengths[size]):
                steps = sorted(lengths[size])[rank]
                for seed in seeds:
                    for v in ("nvfp4", "bf16"):
                        if (size, steps) != (lever_size, top):
                            add(size, steps, seed, v)
    return specs


def by_width(sizes: Sequence[str]) -> List[str]:
    """Recipe sizes, narrowest first."""
    return sorted(sizes, key=lambda s: list(RECIPE_SIZES).index(s))


def recipe_grid(sizes: Sequence[str], seeds: Sequence[int] = SEEDS,
                ablation_sizes: Optional[Sequence[str]] = None, lr_seeds: Sequence[int] = ()) -> List[Dict[str, Any]]:
    """The recipe sweep's runs: per size (narrowest first) and seed, :data:`RECIPE_VARIANTS`;
    per size, :data:`LR_CHECK` for each of ``lr_seeds``; then, at each of
    ``ablation_sizes`` (default: the widest size; ``()``: none), narrowest first, the
    :data:`ABLATIONS` seed by seed."""
    order = by_width(sizes)
    at = by_width(order[-1:] if ablation_sizes is None else ablation_sizes)
    specs = [{"size": size, "steps": RECIPE_STEPS, "seed": seed, "variant": v,
              "name": run_name(size, RECIPE_STEPS, seed, v)}
             for size in order for seed in seeds for v in RECIPE_VARIANTS]
    specs += [{"size": size, "steps": RECIPE_STEPS, "seed": seed, "variant": v,
               "name": run_name(size, RECIPE_STEPS, seed, v)} for size in order for seed in lr_seeds for v in LR_CHECK]
    specs += [{"size": size, "steps": RECIPE_STEPS, "seed": seed, "variant": v,
               "name": run_name(size, RECIPE_STEPS, seed, v)} for size in at for seed in seeds for v in ABLATIONS]
    return specs


def run_config(size: str, steps: int, seed: int, variant: str, corpus: Dict[str, Any], extra: Sequence[str] = ()):
    from train.config import load_config

    spec = SIZES[size]
    overrides = [*spec["overrides"], "mesh.data=1", "mesh.tensor=1", "mesh.simulate_devices=1",
                 *(VARIANTS[variant] or ["nvfp4.weights=bf16"]),
                 "data.source=file", f"data.path={corpus['train']['path']}",
                 f"data.val_path={corpus['val']['path']}", f"data.seed={seed}", f"train.seed={seed}",
                 f"train.steps={steps}", f"train.eval_every={max(1, steps // 10)}",
                 f"train.eval_batches={EVAL_BATCHES}", "train.log_every=50", *extra]
    return load_config(os.path.join(ROOT, "train", "configs", spec["config"]), overrides), overrides


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
                     on_step=_exporter(cfg, spec.get("export_hf")))
    wall = time.perf_counter() - t0
    res = {**spec, "overrides": overrides,
           "final_val_loss": r["final_val_loss"], "val_history": [list(v) for v in r["val_history"]],
           "final_train_loss": r["final_loss"],
           "train_loss_every_10": [round(x, 4) for x in r["history"][9::10]],
           "median_step_time_s": r["median_step_time_s"], "skipped_steps": r["skipped_steps"],
           "wall_s": round(wall, 1), "data_order_sha256": data_order_sha256(cfg),
           "corpus_sha256": [corpus["train"]["sha256"], corpus["val"]["sha256"]], "finished_unix": time.time(),
           "source": source, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)
    log(f"  {spec['name']}: val {res['final_val_loss']:.4f}, train {res['final_train_loss']:.4f}, {wall:.0f} s")
    return res


def _exporter(cfg, at: Optional[Dict[int, str]]):
    """The ``on_step`` hook of a run whose spec has ``export_hf: {step: folder}``: a bf16 Hugging
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


# ----------------------------------------------------------------------------- aggregation
def _stats(xs: Sequence[float]) -> Dict[str, float]:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def _gaps(results: Dict[str, Dict[str, Any]], size: str, steps: int, seeds: Sequence[int], variant: str,
          base: str = "bf16") -> Optional[Dict[str, Any]]:
    per = {}
    for seed in seeds:
        a = results.get(run_name(size, steps, seed, variant))
        b = results.get(run_name(size, steps, seed, base))
        if a and b:
            per[seed] = {"val": a["final_val_loss"], "base": b["final_val_loss"],
                         "gap": a["final_val_loss"] - b["final_val_loss"],
                         "gap_pct": 100 * (a["final_val_loss"] - b["final_val_loss"]) / b["final_val_loss"],
                         "same_data_order": a["data_order_sha256"] == b["data_order_sha256"],
                         "same_source": same_source(a, b)}
    if not per:
        return None
    pct = [p["gap_pct"] for p in per.values()]
    base_vals = [p["base"] for p in per.values()]
    return {"size": size, "steps": steps, "variant": variant, "base": base, "per_seed": per,
            "gap_pct": _stats(pct), "gap_nats": _stats([p["gap"] for p in per.values()]),
            "val": _stats([p["val"] for p in per.values()]), "base_val": _stats(base_vals),
            "same_data_order": all(p["same_data_order"] for p in per.values())}


def same_source(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[bool]:
    """Whether two runs were trained by the same code (:func:`source_state`); None when either
    run predates the record."""
    if "source" not in a or "source" not in b:
        return None
    return a["source"]["sha256"] == b["source"]["sha256"]


def source_summary(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The code states the runs were trained by, with their run counts, and the runs without a
    record."""
    states: Dict[str, Dict[str, Any]] = {}
    for r in results.values():
        s = r.get("source")
        if s:
            states.setdefault(s["sha256"], {**s, "runs": 0})["runs"] += 1
    return {"states": sorted(states.values(), key=lambda s: -s["runs"]),
            "unrecorded": sorted(k for k, r in results.items() if "source" not in r)}


def _gap_curve(results, size, steps, seeds, variant="nvfp4", base="bf16"):
    """``[(step, [gap % per seed])]`` over the evaluations the runs share."""
    curves = []
    for seed in seeds:
        a, b = results.get(run_name(size, steps, seed, variant)), results.get(run_name(size, steps, seed, base))
        if a and b:
            vb = dict((int(s), v) for s, v in b["val_history"])
            curves.append({int(s): 100 * (v - vb[int(s)]) / vb[int(s)] for s, v in a["val_history"] if int(s) in vb})
    if not curves:
        return []
    common = sorted(set.intersection(*(set(c) for c in curves)))
    return [(s, [c[s] for c in curves]) for s in common]


def verdict(g: Optional[Dict[str, Any]], target: float) -> Dict[str, Any]:
    """Met when the mean gap is <= ``target`` % of the bf16 loss, or zero lies inside the seeds'
    spread of the gap (min <= 0: at least one seed has NVFP4 at or below bf16)."""
    if g is None:
        return {"met": None, "why": "not run"}
    m, lo, hi = g["gap_pct"]["mean"], g["gap_pct"]["min"], g["gap_pct"]["max"]
    if m <= target:
        return {"met": True, "why": f"mean gap {m:+.3f}% <= {target}%"}
    if lo <= 0:
        return {"met": True, "why": f"mean gap {m:+.3f}% > {target}%, but inside the seed spread "
                                    f"[{lo:+.3f}%, {hi:+.3f}%]"}
    return {"met": False, "why": f"mean gap {m:+.3f}% > {target}% and every seed positive "
                                 f"[{lo:+.3f}%, {hi:+.3f}%]"}


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
            g = _gaps(results, size, steps, s, "nvfp4")
            if g:
                g["curve"] = _gap_curve(results, size, steps, s)
                table.append(g)
    levers = {}
    for v in ("nvfp4", *LEVERS):
        s = seeds_of(lever_size, top, v)
        g = _gaps(results, lever_size, top, s, v, base=LEVER_BASE.get(v, "bf16"))
        if g:
            # Against the default weights-only run of the same seed as well.
            if v != "nvfp4":
                d = _gaps(results, lever_size, top, s, v, base="nvfp4")
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
    accept = {"weights_only": verdict(levers.get("nvfp4"), WEIGHTS_ONLY_TARGET),
              "full_recipe": verdict(levers.get("compute_nvfp4"), RECIPE_TARGET),
              "full_recipe_keep_last": verdict(levers.get("compute_nvfp4_keep_last_blocks_1"), RECIPE_TARGET)}
    return {"table": table, "levers": levers, "plain_baseline": plain, "acceptance": accept,
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


def _pct(s: Dict[str, float]) -> str:
    return f"{s['mean']:+.2f}% [{s['min']:+.2f}, {s['max']:+.2f}] (std {s['std']:.2f}, {s['n']} seeds)"


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
          "| size | model | steps | tokens seen | bf16 val loss (mean) | NVFP4 val loss (mean) | gap % of bf16 |",
          "|---|---|---:|---:|---:|---:|---|"]
    L[-2:-2] = source_lines(meta, agg)
    for g in agg["table"]:
        m = meta["models"][g["size"]]
        L.append(f"| {g['size']} | {m['layers']} layers, d {m['d_model']}, MLP {m['mlp_hidden']}, "
                 f"{m['batch_size']}x{m['seq_len']} tokens/step | {g['steps']} | "
                 f"{g['steps'] * m['batch_size'] * m['seq_len']:,} | {g['base_val']['mean']:.4f} | "
                 f"{g['val']['mean']:.4f} | {_pct(g['gap_pct'])} |")
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
            L.append(f"| {LEVER_NAMES[v]} | {g['val']['mean']:.4f} | {_pct(g['gap_pct'])}{own} | "
                     f"{_pct(vs) if vs else '-'} |")
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
    a = agg["acceptance"]
    L += ["## Acceptance", "",
          "Rule: mean gap <= target, or zero inside the seeds' spread of the gap (at least one seed with NVFP4 at "
          "or below bf16).", "",
          f"- Weights-only NVFP4 (default), {agg['lever_size']} model, {agg['lever_steps']} steps: target "
          f"{WEIGHTS_ONLY_TARGET}% -> **{_met(a['weights_only'])}** ({a['weights_only']['why']}).",
          f"- Full recipe (`nvfp4.compute=nvfp4`): target {RECIPE_TARGET}% -> **{_met(a['full_recipe'])}** "
          f"({a['full_recipe']['why']}).",
          *([f"- Full recipe with the last block's GEMMs in bf16 (`nvfp4.compute=nvfp4 nvfp4.keep_last_blocks=1`, "
             f"against bf16 with the same split): target {RECIPE_TARGET}% -> **{_met(a['full_recipe_keep_last'])}** "
             f"({a['full_recipe_keep_last']['why']})."] if a.get("full_recipe_keep_last", {}).get("met") is not None
            else []), ""]
    L += findings(agg)
    text = "\n".join(L) + "\n"
    path = os.path.join(out, "CONVERGENCE_TEXT.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def source_lines(meta: Dict[str, Any], agg: Dict[str, Any]) -> List[str]:
    """The code the runs were trained by (:func:`source_summary`) and the pairs that mix two
    states: a gap is only a gap when both runs ran the same code."""
    src = meta.get("sources")
    if not src:
        return []
    states = [f"`{s['sha256'][:12]}` ({s['runs']} runs; commit `{(s['git_commit'] or '?')[:10]}`"
              + (", with uncommitted changes" if s["dirty"] else "" if s["dirty"] is False else ", tree state unknown")
              + ")" for s in src["states"]]
    mixed = sorted({f"`{run_name(g['size'], g['steps'], seed, g['variant'])}` vs `{g['base']}`"
                    for g in [*agg["table"], *agg["levers"].values()]
                    for seed, p in g["per_seed"].items() if p.get("same_source") is False})
    old = src["unrecorded"]
    line = (f"Code: each run records the sha256 of the library's and the stack's sources it trained with "
            f"(`source` in its JSON; `{'`, `'.join(SOURCES)}`). States: " + ("; ".join(states) or "none recorded") + ".")
    if old:
        line += (f" {len(old)} runs predate the record" + (": " + ", ".join(f"`{n}`" for n in old) if len(old) <= 12 else "")
                 + ".")
    line += " Pairs trained by different code: " + (", ".join(mixed) if mixed else "none") + "."
    return [line, ""]


def lever_effect(g: Dict[str, Any], noise: float = 0.0, interval: bool = False) -> str:
    """``helps`` / ``hurts`` when the lever moves the validation loss the same way against
    the default NVFP4 run in every seed by more than ``noise`` % (the difference between two
    runs that should agree: the stack's bf16 baseline and plain optax), else ``no clear effect``.
    ``interval``: where no such noise reference exists (the recipe's ablation), the same sign in
    every seed is not enough (three seeds agree by chance one time in four): the 95% interval of
    the mean difference must exclude 0 as well."""
    vs = g.get("vs_default_pct")
    if not vs:
        return "not run"
    if vs["n"] < 2:
        return f"one seed only ({vs['mean']:+.2f}%)"
    if interval and (vs["max"] < 0 or vs["min"] > 0):
        lo, hi = mean_interval(vs)
        word, side = ("helps", "lower") if vs["max"] < 0 else ("hurts", "higher")
        span = sorted((abs(vs["min"]), abs(vs["max"])))
        if hi < 0 or lo > 0:
            return (f"{word} ({side} in every seed, by {span[0]:.2f}% to {span[1]:.2f}%; 95% interval of the "
                    f"mean [{lo:+.2f}%, {hi:+.2f}%])")
        return (f"not clear: {side} in every seed ({vs['n']} of {vs['n']}, by {span[0]:.2f}% to {span[1]:.2f}%), "
                f"but the 95% interval of the mean, [{lo:+.2f}%, {hi:+.2f}%], contains 0")
    if vs["max"] < -noise:
        return f"helps (lower in every seed, by more than {noise:.2f}%)"
    if vs["min"] > noise:
        return f"hurts (higher in every seed, by more than {noise:.2f}%)"
    if vs["max"] < 0 or vs["min"] > 0:
        return (f"not clear: {'lower' if vs['max'] < 0 else 'higher'} in every seed, but in one by less than "
                f"the {noise:.2f}% two bf16 runs that should agree differ by")
    lo, hi = mean_interval(vs)
    if hi < 0 or lo > 0:
        return (f"{'helps' if hi < 0 else 'hurts'} on average: the 95% interval of the mean difference, "
                f"[{lo:+.2f}%, {hi:+.2f}%], excludes 0, though the sign changes with the seed")
    return f"no clear effect (the sign changes with the seed; 95% interval of the mean [{lo:+.2f}%, {hi:+.2f}%])"


# Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def mean_interval(s: Dict[str, float]) -> Tuple[float, float]:
    """The 95% t-interval of the mean of ``s`` (``_stats`` of per-seed differences)."""
    n = s["n"]
    t = _T975[min(n - 1, len(_T975)) - 1] if n > 1 else float("inf")
    half = t * s["std"] / math.sqrt(n)
    return s["mean"] - half, s["mean"] + half


def findings(agg: Dict[str, Any]) -> List[str]:
    L = ["## Which levers help", "",
         f"Against the default weights-only NVFP4 run of the same seed ({agg['lever_size']} model, "
         f"{agg['lever_steps']} steps):", ""]
    p = agg.get("plain_baseline")
    noise = abs(p["diff_pct"]) if p else 0.0
    for v, g in agg["levers"].items():
        if v != "nvfp4":
            L.append(f"- {LEVER_NAMES[v]}: {lever_effect(g, noise)} "
                     f"({_pct(g['vs_default_pct']) if g.get('vs_default_pct') else '-'}).")
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
        L.append(f"| {g['size']} | {m['d_model']} | {m['mlp_hidden']} | {_pct(g['gap_pct'])} | {_met(v)}: {v['why']} |")
    return L + [""]


def _met(v: Dict[str, Any]) -> str:
    return {True: "met", False: "NOT MET", None: "not run"}[v["met"]]


# ----------------------------------------------------------------------------- driver
def _one_device(cache: str) -> None:
    request_cpu_devices(1)
    use_compile_cache(os.path.join(cache, "jax-cache"))  # runs that differ only in their seed


def parse_args(argv: Sequence[str]):
    p = argparse.ArgumentParser(prog="python -m benchmarks convergence --text",
                                description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT})")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"corpus, per-run results and compile cache (default {DEFAULT_CACHE})")
    p.add_argument("--sizes", help=f"model sizes (default {','.join(WEIGHTS_SIZES)}; with --recipe "
                                   f"{','.join(RECIPE_SIZES)})")
    p.add_argument("--recipe", action="store_true",
                   help="the full recipe's width sweep and ablation instead (CONVERGENCE_RECIPE.md)")
    p.add_argument("--ablation-at", metavar="SIZES",
                   help="--recipe: the sizes (of --sizes) the ablation runs at (default: the widest; "
                        "'none': no ablation)")
    p.add_argument("--lr-check", metavar="SEEDS", default="",
                   help=f"--recipe: at every size, the last-block-bf16 pair again at optim.lr={LR_HALF} "
                        "for these seeds (default none)")
    p.add_argument("--rerun", metavar="NAME",
                   help="train the finished run NAME of this grid again (in <cache>/reruns) and compare its "
                        "losses with the recorded ones bit for bit")
    p.add_argument("--only", help=argparse.SUPPRESS)  # train only these runs (comma-separated names)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds (default 0,1,2)")
    p.add_argument("--headline-seeds", type=int, default=HEADLINE_SEEDS,
                   help=f"the default model's longest cell (NVFP4, bf16, 2d tiles) also runs seeds 0..N-1 "
                        f"(default {HEADLINE_SEEDS})")
    p.add_argument("--lengths", help="override lengths, e.g. tiny=20:40,default=40")
    p.add_argument("--no-levers", action="store_true", help="skip the lever runs")
    p.add_argument("--no-plain", action="store_true", help="skip the plain-optax baseline")
    p.add_argument("--workers", type=int, default=1, help="processes training runs in parallel (default 1)")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # i/N: one of N worker processes
    p.add_argument("--max-bytes", type=int, help=argparse.SUPPRESS)  # cap the corpus (tests)
    p.add_argument("--report-only", action="store_true", help="aggregate the finished runs, train nothing")
    args = p.parse_args(list(argv))
    allowed = RECIPE_SIZES if args.recipe else WEIGHTS_SIZES
    args.sizes = [s for s in (args.sizes or ",".join(allowed)).split(",") if s]
    for s in args.sizes:
        if s not in allowed:
            p.error(f"unknown size {s!r}; sizes are {', '.join(allowed)}")
    if args.ablation_at is not None:
        args.ablation_at = [] if args.ablation_at == "none" else [s for s in args.ablation_at.split(",") if s]
        for s in args.ablation_at:
            if not args.recipe or s not in args.sizes:
                p.error(f"--ablation-at {s!r}: the ablation runs at sizes of --recipe --sizes ({', '.join(args.sizes)})")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.lr_check = [int(s) for s in args.lr_check.split(",") if s]
    if args.lr_check and not args.recipe:
        p.error("--lr-check belongs to --recipe")
    args.headline = headline_seeds(args.seeds, args.headline_seeds)
    lengths = {k: list(v) for k, v in LENGTHS.items()}
    if args.lengths:
        for part in args.lengths.split(","):
            k, v = part.split("=")
            lengths[k] = [int(x) for x in v.split(":")]
    args.lengths_map = lengths
    return args


def _without(argv: Sequence[str], opt: str) -> List[str]:
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
    keep = [a for a in _without(argv, "--shard") if a != "--report-only"]
    return " ".join(["python -m benchmarks convergence --text", *keep])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.recipe:
        specs = recipe_grid(args.sizes, args.seeds, args.ablation_at, args.lr_check)
    else:
        specs = grid(args.sizes, args.seeds, args.lengths_map, levers=not args.no_levers, plain=not args.no_plain,
                     headline=args.headline)
    if args.only:
        specs = [s for s in specs if s["name"] in args.only.split(",")]
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)
    corpus_path = os.path.join(args.cache, "corpus.json")
    if args.shard:
        with open(corpus_path) as f:
            corpus = json.load(f)
        _one_device(args.cache)
        work(specs, corpus, args.cache, log)
        return 0
    corpus = build_corpus(args.cache, max_bytes=args.max_bytes)
    os.makedirs(args.cache, exist_ok=True)
    with open(corpus_path, "w") as f:
        json.dump(corpus, f, indent=1)
    log(f"corpus: {corpus['train']['files']} train modules ({corpus['train']['bytes']:,} bytes), "
        f"{corpus['val']['files']} held out ({corpus['val']['bytes']:,} bytes); {len(specs)} runs")
    if args.rerun:
        return rerun(args, argv, specs, corpus, log)
    if not args.report_only:
        if args.workers > 1:
            codes = _spawn(_without(argv, "--workers"), args.workers)
            if any(codes):
                log(f"workers exited with {codes}; the finished runs are kept, rerun to resume")
        else:
            _one_device(args.cache)
            work(specs, corpus, args.cache, log)
    results = {}
    for spec in specs:
        path = os.path.join(args.cache, "runs", spec["name"] + ".json")
        if os.path.exists(path):
            with open(path) as f:
                results[spec["name"]] = json.load(f)
            results[spec["name"]].setdefault("finished_unix", os.path.getmtime(path))
    wall = time.perf_counter() - t_start
    if args.recipe:
        from benchmarks import convergence_recipe as cr

        path = cr.write(args.out, cr.assemble(results, specs, corpus, args, argv, wall, args.cache))
        log(f"wrote {path}, convergence_recipe.json and convergence_recipe.png ({len(results)}/{len(specs)} runs)")
        return 0 if len(results) == len(specs) else 1
    payload = assemble(results, specs, corpus, args, argv, wall)
    os.makedirs(args.out, exist_ok=True)
    plot(payload["aggregate"], args.sizes, os.path.join(args.out, "convergence_text.png"))
    with open(os.path.join(args.out, "convergence_text.json"), "w") as f:
        json.dump(payload, f, indent=1)
    path = write_report(args.out, payload)
    for g in payload["aggregate"]["table"]:
        log(f"{g['size']:>8} {g['steps']:>5} steps: gap {_pct(g['gap_pct'])}")
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


def rerun(args, argv, specs, corpus, log) -> int:
    """``--rerun NAME``: train run NAME again in a worker process (the grid's own flags) into
    ``<cache>/reruns/cache``, compare its losses with the recorded run's and write the verdict
    to ``<cache>/reruns/NAME.json`` (the report lists it). Exit 0 when bit for bit identical."""
    from benchmarks import convergence_recipe as cr

    name = args.rerun
    if name not in {s["name"] for s in specs}:
        log(f"--rerun {name}: not a run of this grid")
        return 2
    recorded_path = os.path.join(args.cache, "runs", name + ".json")
    if not os.path.exists(recorded_path):
        log(f"--rerun {name}: not finished yet ({recorded_path} does not exist)")
        return 2
    with open(recorded_path) as f:
        recorded = json.load(f)
    scratch = os.path.join(cr.rerun_dir(args.cache), "cache")
    fresh = os.path.join(scratch, "runs", name + ".json")
    for p in (fresh, os.path.join(scratch, "claims", name)):
        if os.path.exists(p):
            os.remove(p)
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, "corpus.json"), "w") as f:
        json.dump(corpus, f, indent=1)
    base = _without(_without(_without(argv, "--rerun"), "--cache"), "--workers")
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
        + ("bit for bit identical" if verdict["identical"] else f"DIFFERENT ({verdict['fields']})"))
    return 0 if verdict["identical"] else 1


def assemble(results, specs, corpus, args, argv, wall: float) -> Dict[str, Any]:
    from benchmarks.train_step import model_summary

    agg = aggregate(results, args.seeds, args.sizes, args.lengths_map, args.headline)
    models = {}
    for size in args.sizes:
        cfg, _ = run_config(size, 10, 0, "nvfp4", corpus)
        models[size] = model_summary(cfg)
    meta = {"seeds": list(args.seeds), "headline_seeds": list(args.headline), "sizes": list(args.sizes),
            "lengths": args.lengths_map, "models": models, **run_meta(results, specs, argv, wall)}
    return {"meta": meta, "corpus": corpus, "aggregate": agg, "runs": stored_runs(results)}


def run_meta(results, specs, argv, wall: float) -> Dict[str, Any]:
    """What a report says of its runs: the command, which runs are done, their time, where,
    whether every pair read the same batches, and the code they were trained by."""
    import jax

    run_wall = sum(r["wall_s"] for r in results.values())
    # Wall clock of the grid: the time during which at least one run was in progress, over every
    # invocation and worker process that contributed (a grid resumed later does not count the
    # time in between).
    span = _busy(results)
    same = [r["data_order_sha256"] == results[r["name"].rsplit("-", 1)[0] + "-bf16"]["data_order_sha256"]
            for r in results.values() if r["name"].rsplit("-", 1)[0] + "-bf16" in results]
    return {
        "command": _command(argv), "runs_done": len(results), "runs_total": len(specs),
        "missing": [s["name"] for s in specs if s["name"] not in results],
        "run_wall_s_sum": round(run_wall, 1), "this_invocation_wall_s": round(wall, 1),
        "grid_wall_s": round(span, 1),
        "grid_wall_h": f"{span / 3600:.2f} h wall clock with runs in progress ({run_wall / 3600:.2f} h of run "
                       f"time summed over the runs, at most {_workers(results)} at once)",
        "where": f"{jax.default_backend()}, {os.cpu_count()} CPU cores, jax {jax.__version__}, "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "same_data_order": bool(same) and all(same), "sources": source_summary(results), "git_commit": git_commit(),
    }


def stored_runs(results) -> Dict[str, Any]:
    """The runs as the results JSON keeps them (without the training-loss trace)."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "train_loss_every_10"} for k, v in results.items()}


def _busy(results) -> float:
    """Seconds during which at least one run was in progress (the union of the runs' spans)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((r["finished_unix"] - r["wall_s"], r["finished_unix"]) for r in results.values()):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _workers(results) -> int:
    """The most runs in progress at one time."""
    ev = sorted([(r["finished_unix"] - r["wall_s"], 1) for r in results.values()]
                + [(r["finished_unix"], -1) for r in results.values()], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best



if __name__ == "__main__":
    sys.exit(main())
