"""``python -m benchmarks serving``: the validation loss of a model as served in NVFP4, on one budget.

A model served in NVFP4 is usually trained in bf16 and quantized after training; a model
trained with NVFP4 weights is served exactly as it was trained (the export is lossless). On
the real text of ``python -m benchmarks convergence --text`` (the Python standard library's
modules, every tenth held out; bytes as tokens) and its default model, each seed trains the
same number of steps (``--steps``, the same batches) for every row:

- ``bf16``: bf16 weights (float32 masters), served in bf16: the ceiling;
- ``ptq``: that bf16 model, exported as a bf16 Hugging Face checkpoint and quantized to NVFP4
  round to nearest with one E4M3 scale per 16 inputs and a global amax per matrix, the
  compressed-tensors ``NVFP4A16`` layout (``train.init_from`` with ``nvfp4.weights=nvfp4
  nvfp4.block=1d``, evaluated at step 0): post-training quantization as done today;
- ``native``: NVFP4 weights from scratch (the default recipe; weights only, 1d blocks);
- ``qat``: the bf16 run's checkpoint after 90% of the steps (a bf16 Hugging Face export),
  ``train.init_from`` with NVFP4 weights for the last 10%: quantization-aware fine-tuning.
  A Hugging Face checkpoint carries no optimizer state: AdamW starts fresh, at a constant
  learning rate, the mean of the bf16 run's schedule over those last steps; its batches are
  drawn with another data seed (``data.seed + 1000``; random windows, as every run's).

The NVFP4 rows are evaluated with their NVFP4 weights dequantized to bf16, what a weight-only
NVFP4 kernel computes with; embeddings, head and norms stay bf16 in every row (as NVFP4A16
leaves them). Each NVFP4 row also has a W4A4 row (``ptq_w4a4``, ``native_w4a4``,
``qat_w4a4``): the same params (the ``ptq`` import, the native and fine-tune runs' final
checkpoints), with the activation entering each NVFP4 Linear quantized too, as a W4A4 serving
kernel does (1x16 groups, E4M3 scales, round to nearest, under a global scale from that
layer's calibrated input amax; :mod:`train.calibrate`, emulated). The amax is calibrated
(``static_minmax``: the largest ``|x|``) on ``CALIBRATION_BATCHES`` held-out batches that are
not the evaluated ones: the validation stream's batches after the ``EVAL_BATCHES`` the
validation loss is measured on (random windows of the same held-out modules; never trained
on). The loss of a W4A4 row is measured on the evaluated batches, as every row's.

Gaps are ``(row - bf16) / bf16`` per seed; the report gives their mean, the seeds' range and
the 95% t-interval of the mean.

The runs are ``benchmarks.convergence_text`` runs (its corpus, configs and per-run cache in
``--cache``; a rerun skips finished runs; the native and bf16 runs are that grid's
``default-STEPS-sN-nvfp4`` and ``-bf16`` configs; the native run also keeps its final
checkpoint, a host setting that leaves its trajectory as it was).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np

from benchmarks import arguments as A
from benchmarks import convergence_grid as grid
from benchmarks import convergence_text as ct
from benchmarks import stats
from benchmarks.common import git_commit, source_state

DEFAULT_CACHE = os.path.join("runs", "serving")
SIZE = "default"
STEPS = 2000
TAIL = 0.1  # the fine-tuned share of the budget
CALIBRATION_BATCHES = 16  # the W4A4 rows' calibration set (validation-stream batches after the evaluated ones)
W4A4 = {"ptq_w4a4": "ptq", "native_w4a4": "native", "qat_w4a4": "qat"}  # W4A4 row: its W4A16 row
ROWS = ("bf16", "ptq", "native", "qat", *W4A4)
ROW_NAMES = {
    "bf16": "bf16 weights, served in bf16 (the ceiling)",
    "ptq": "bf16 training, then round-to-nearest NVFP4 (1x16 blocks, NVFP4A16)",
    "native": "NVFP4 weights from scratch (served as trained)",
    "qat": "bf16 for 90% of the steps, then `init_from` with NVFP4 weights for 10%",
    "ptq_w4a4": "ptq, W4A4: activations NVFP4 too (calibrated)",
    "native_w4a4": "native, W4A4: activations NVFP4 too (calibrated)",
    "qat_w4a4": "qat, W4A4: activations NVFP4 too (calibrated)",
}
PAIRS = (("native", "ptq"), ("qat", "ptq"), ("native", "qat"),
         ("ptq_w4a4", "ptq"), ("native_w4a4", "native"), ("qat_w4a4", "qat"), ("native_w4a4", "ptq_w4a4"))


def tail_lr(size: str, steps: int, tail: int, corpus) -> float:
    """The mean learning rate of the full run's schedule over its last ``tail`` steps."""
    from train.optimizer import schedule_for

    cfg, _ = grid.run_config(size, steps, 0, "bf16", corpus)
    sched = schedule_for(cfg)
    return float(statistics.fmean(float(sched(s)) for s in range(steps - tail, steps)))


def specs(size: str, steps: int, seeds: Sequence[int], cache: str, corpus) -> List[Dict[str, Any]]:
    """Per seed, in order: the bf16 run (exporting at 90% and at the end), the native NVFP4
    run, the fine-tune from the 90% export; ``ptq`` entries are evaluations, not runs, and so
    are the W4A4 entries (``of``: the entry whose params they serve; the native and fine-tune
    runs keep their final checkpoint, in ``checkpoint``, for them)."""
    tail = max(1, round(steps * TAIL))
    lr = tail_lr(size, steps, tail, corpus)
    out = []
    for seed in seeds:
        hf = lambda step: os.path.abspath(os.path.join(cache, "hf", f"{size}-{steps}-s{seed}-bf16", f"step-{step}"))
        out.append({"row": "bf16", "size": size, "steps": steps, "seed": seed, "variant": "bf16",
                    "name": grid.run_name(size, steps, seed, "bf16") + "-exported",
                    "export_hf": {steps - tail: hf(steps - tail), steps: hf(steps)}})
        ckpt = lambda name: os.path.abspath(os.path.join(cache, "ckpt", name))
        native = grid.run_name(size, steps, seed, "nvfp4")
        qat = grid.run_name(size, steps, seed, "qat")
        # checkpoint.dir is a host setting: the final checkpoint, the trajectory unchanged.
        out.append({"row": "native", "size": size, "steps": steps, "seed": seed, "variant": "nvfp4",
                    "name": native, "extra": [f"checkpoint.dir={ckpt(native)}"]})
        out.append({"row": "qat", "size": size, "steps": tail, "seed": seed, "variant": "nvfp4", "name": qat,
                    "extra": [f"train.init_from={hf(steps - tail)}", "optim.schedule=constant", "optim.warmup_steps=0",
                              f"optim.lr={lr!r}", f"data.seed={seed + 1000}", f"checkpoint.dir={ckpt(qat)}"]})
        ptq = {"row": "ptq", "size": size, "steps": steps, "seed": seed, "variant": "nvfp4",
               "name": grid.run_name(size, steps, seed, "ptq"), "source": hf(steps)}
        out.append(ptq)
        for row, of in W4A4.items():
            base = next(s for s in out if s["row"] == of and s["seed"] == seed)
            w = {"row": row, "of": of, "size": size, "steps": base["steps"], "seed": seed, "variant": "nvfp4",
                 "name": base["name"] + "-w4a4", "extra": list(base.get("extra", ())),
                 "calibration_batches": CALIBRATION_BATCHES}
            if of == "ptq":
                w.update(source=base["source"], extra=[f"train.init_from={base['source']}", "nvfp4.block=1d"])
            else:
                w["checkpoint"] = ckpt(base["name"])
            out.append(w)
    return out


def ptq_one(spec: Dict[str, Any], corpus, cache: str, log=print) -> Dict[str, Any]:
    """The validation loss of the bf16 export ``spec["source"]`` quantized to NVFP4 (1x16
    blocks, round to nearest) as ``train.init_from`` reads it; cached like a run."""
    path = os.path.join(cache, "runs", spec["name"] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import jax

    from train import data as data_lib
    from train import hf_import
    from train import mesh as mesh_lib
    from train.programs import build, global_batch
    from train.step import validation_loss

    t0 = time.perf_counter()
    cfg, overrides = grid.run_config(spec["size"], spec["steps"], spec["seed"], "nvfp4", corpus,
                                     [f"train.init_from={spec['source']}", "nvfp4.block=1d"])
    trainer, _, _ = build(cfg, mesh_lib.build_mesh(cfg.mesh, jax.devices()[:1]), init=False)
    params, _ = hf_import.load(spec["source"], trainer)
    val = data_lib.eval_batches(cfg, data_lib.make_source(cfg.data, cfg.model, split="val"))
    loss = validation_loss(trainer.eval_fn, params, [global_batch(trainer, b) for b in val])
    res = {**spec, "overrides": overrides, "final_val_loss": loss, "wall_s": round(time.perf_counter() - t0, 1),
           "finished_unix": time.time(), "source": source_state()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    log(f"  {spec['name']}: val {loss:.4f}")
    return res


def w4a4_batches(cfg, n: int = CALIBRATION_BATCHES):
    """``(evaluated, calibration)``: the ``train.eval_batches`` validation batches every row's
    loss is measured on, and the ``n`` validation-stream batches after them (the W4A4 rows'
    calibration set: other windows of the held-out text, not the evaluated batches)."""
    import dataclasses

    from train import data as data_lib

    e = cfg.train.eval_batches
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=e + n))
    rows = data_lib.eval_batches(more, data_lib.make_source(cfg.data, cfg.model, split="val"))
    return rows[:e], rows[e:]


def w4a4_one(spec: Dict[str, Any], corpus, cache: str, log=print) -> Dict[str, Any]:
    """The validation loss of ``spec["of"]``'s params served W4A4: each NVFP4 layer's input
    amax calibrated on :func:`w4a4_batches`' calibration set (``train.calibrate.calibrate``),
    then ``train.calibrate.validation_losses`` on the evaluated batches (``final_val_loss``:
    W4A4; ``w4a16_val_loss``: the same params weight-only, the ``of`` row's model recomputed;
    ``master_bf16_val_loss``: a run's float32 masters in bf16, None for ``ptq``). Cached like a run."""
    path = os.path.join(cache, "runs", spec["name"] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import jax

    from train import calibrate as cal
    from train import checkpoint as checkpoint_lib
    from train import hf_import
    from train import mesh as mesh_lib
    from train.model import from_config
    from train.programs import build

    import jax_nvfp4 as nv

    t0 = time.perf_counter()
    cfg, overrides = grid.run_config(spec["size"], spec["steps"], spec["seed"], "nvfp4", corpus, spec.get("extra", ()))
    trainer, _, _ = build(cfg, mesh_lib.build_mesh(cfg.mesh, jax.devices()[:1]), init=False)
    if spec["of"] == "ptq":
        params, opt_state = hf_import.load(spec["source"], trainer)
        master = None
    else:
        ckpt = checkpoint_lib.Checkpointer(spec["checkpoint"])
        steps = ckpt.all_steps()
        if cfg.train.steps not in steps:
            raise RuntimeError(f"{spec['name']}: no final checkpoint (step {cfg.train.steps}) in {spec['checkpoint']}: "
                               f"remove the cached {spec['of']} run's result to retrain it")
        r = ckpt.restore(cfg.train.steps, trainer.abstract_params, trainer.abstract_state,
                         trainer.param_shardings, trainer.state_shardings)
        params, state = r.params, nv.find_state(r.opt_state)
        master = None if state is None else state.master
    model = from_config(cfg.model, cfg.nvfp4)
    evaluated, calibration = w4a4_batches(cfg, spec["calibration_batches"])
    amax = cal.calibrate(model, params, calibration)
    losses = cal.validation_losses(model, params, amax, evaluated, master=master)
    res = {**spec, "overrides": overrides, "final_val_loss": losses["w4a4"], "w4a16_val_loss": losses["w4a16"],
           "master_bf16_val_loss": losses["bf16"],
           "input_amax": {k: [float(x) for x in np.ravel(v)] for k, v in amax.items()},
           "wall_s": round(time.perf_counter() - t0, 1), "finished_unix": time.time(), "source_state": source_state()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    log(f"  {spec['name']}: val W4A4 {losses['w4a4']:.4f} (W4A16 {losses['w4a16']:.4f})")
    return res


def aggregate(results: Dict[str, Dict[str, Any]], all_specs, seeds) -> Dict[str, Any]:
    by = {(s["row"], s["seed"]): results.get(s["name"]) for s in all_specs}
    rows = {}
    for row in ROWS:
        per = {}
        for seed in seeds:
            r, base = by.get((row, seed)), by.get(("bf16", seed))
            if r and base:
                v, b = r["final_val_loss"], base["final_val_loss"]
                per[seed] = {"val": v, "gap_pct": 100 * (v - b) / b, "gap_nats": v - b}
        if per:
            gaps = [p["gap_pct"] for p in per.values()]
            st = stats.summarize(gaps)
            lo, hi = stats.mean_interval(st)
            rows[row] = {"name": ROW_NAMES[row], "per_seed": per,
                         "val": stats.summarize([p["val"] for p in per.values()]), "gap_pct": st, "gap_nats": stats.summarize([p["gap_nats"] for p in per.values()]),
                         "gap_pct_interval95": [lo, hi]}
    # Each NVFP4 row against each other, paired by seed (negative: the first serves better).
    pairs = {}
    for a, b in PAIRS:
        if a in rows and b in rows:
            d = [rows[a]["per_seed"][s]["gap_pct"] - rows[b]["per_seed"][s]["gap_pct"]
                 for s in seeds if s in rows[a]["per_seed"] and s in rows[b]["per_seed"]]
            if d:
                st = stats.summarize(d)
                pairs[f"{a}-{b}"] = {**st, "interval95": list(stats.mean_interval(st))}
    curves = {}
    for s in all_specs:
        r = results.get(s["name"])
        if r and r.get("val_history") and s["seed"] == seeds[0]:
            off = s["steps"] * (1 / TAIL - 1) if s["row"] == "qat" else 0  # the fine-tune's steps follow 90%
            curves[s["row"]] = [[int(round(st + off)), v] for st, v in r["val_history"]]
    return {"rows": rows, "pairs": pairs, "curves_seed0": curves}


def plot(agg: Dict[str, Any], path: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r for r in ROWS if r in agg["rows"]]
    for i, row in enumerate(names):
        g = agg["rows"][row]
        xs = [p["gap_pct"] for p in g["per_seed"].values()]
        ax.plot([i] * len(xs), xs, "o", color="C0", alpha=0.6, label="one seed" if i == 0 else None)
        lo, hi = g["gap_pct_interval95"]
        m = g["gap_pct"]["mean"]
        ax.errorbar([i + 0.15], [m], yerr=[[m - lo], [hi - m]], fmt="D", color="k", capsize=4,
                    label="mean, 95% interval" if i == 0 else None)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(range(len(names)), [{"bf16": "bf16\n(ceiling)", "ptq": "bf16 +\nRTN NVFP4", "native": "native\nNVFP4",
                                       "qat": "bf16 90% +\nNVFP4 10%", "ptq_w4a4": "ptq\nW4A4",
                                       "native_w4a4": "native\nW4A4", "qat_w4a4": "qat\nW4A4"}[r] for r in names],
                  fontsize=8)
    ax.set_ylabel("validation loss vs bf16 (% of bf16)")
    ax.set_title(f"served in NVFP4: default model, {steps} steps")
    ax.legend(fontsize=8)
    for row, pts in agg["curves_seed0"].items():
        if pts:
            cx.plot(*zip(*pts), "o-" if row != "qat" else "s-", ms=3, label=row)
    if "ptq" in agg["rows"]:
        cx.plot([steps], [agg["rows"]["ptq"]["per_seed"][min(agg["rows"]["ptq"]["per_seed"])]["val"]], "x", ms=9,
                color="C3", label="ptq")
    cx.set_xlabel("step")
    cx.set_ylabel("validation loss (nats/byte)")
    cx.set_title("seed 0")
    cx.set_yscale("log")
    cx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def code_line(runs: Dict[str, Dict[str, Any]]) -> str:
    """Which code trained the runs (:func:`benchmarks.stats.source_summary`): a gap is a gap only between runs
    of one code state."""
    # A W4A4 row's record keeps its code state under "source_state" ("source": the export it read).
    src = stats.source_summary({k: {"source": r["source_state"]} if "source_state" in r else r
                                for k, r in runs.items()})
    states = stats.states_text(src)
    if src["unrecorded"]:
        states.append(f"{len(src['unrecorded'])} runs without a record")
    one = len(src["states"]) == 1 and not src["unrecorded"]
    return ("Code: each run records the sha256 of the sources it trained with (`source` in serving.json): "
            + "; ".join(states) + (". Every gap compares runs of that one state." if one else
                                   ". The gaps compare runs trained by different code."))


def report(payload: Dict[str, Any], out: str) -> str:
    meta, agg = payload["meta"], payload["aggregate"]
    # Read back from JSON, the seeds are string keys.
    agg = {**agg, "rows": {r: {**g, "per_seed": {int(k): v for k, v in g["per_seed"].items()}}
                           for r, g in agg["rows"].items()}}
    L = ["# Served in NVFP4: post-training quantization, native NVFP4 training, fine-tuning", "",
         f"`{meta['command']}` — {meta['where']}; commit `{(meta['git_commit'] or '?')[:10]}`; "
         f"{meta['wall_min']:.0f} min wall clock ({meta['runs_done']}/{meta['runs_total']} runs and evaluations).", "",
         f"The `{meta['size']}` model ({meta['model']}), {meta['steps']} steps of {meta['tokens_per_step']} byte "
         f"tokens for every row (the fine-tune: the bf16 run's first {meta['steps'] - meta['tail_steps']} and "
         f"{meta['tail_steps']} of its own), seeds "
         f"{', '.join(map(str, meta['seeds']))}; validation: {grid.EVAL_BATCHES} batches of held-out stdlib modules. "
         "See `benchmarks/serving.py` for what each row is."
         + (f" W4A4 rows: the row's model with the activation entering each NVFP4 Linear quantized too "
            f"(1x16 groups, E4M3 scales, round to nearest, the global scale from that layer's input amax; "
            f"emulated), the amax calibrated on {meta['calibration_batches']} other held-out batches (the "
            f"validation stream's next {meta['calibration_batches']} after the {grid.EVAL_BATCHES} evaluated)."
            if any(r in agg["rows"] for r in W4A4) else ""), "", code_line(payload["runs"]), "",
         "| served model | validation loss (mean) | gap vs bf16, % (mean) | seeds' range | 95% interval of the mean |",
         "|---|---:|---:|---|---|"]
    for row, g in agg["rows"].items():
        lo, hi = g["gap_pct_interval95"]
        L.append(f"| {g['name']} | {g['val']['mean']:.4f} | {g['gap_pct']['mean']:+.2f} | "
                 f"[{g['gap_pct']['min']:+.2f}, {g['gap_pct']['max']:+.2f}] | "
                 + ("-" if row == "bf16" else f"[{lo:+.2f}, {hi:+.2f}]") + " |")
    L += ["", "Paired by seed (difference of the two gaps, percentage points; negative: the first serves better):", ""]
    for k, p in agg["pairs"].items():
        a, b = k.split("-")
        lo, hi = p["interval95"]
        L.append(f"- {a} - {b}: mean {p['mean']:+.2f} (seeds {p['min']:+.2f} to {p['max']:+.2f}; 95% interval "
                 f"[{lo:+.2f}, {hi:+.2f}])")
    L += ["", "Per seed (validation loss):", "", "| seed | " + " | ".join(agg["rows"]) + " |",
          "|---|" + "---:|" * len(agg["rows"])]
    for seed in meta["seeds"]:
        L.append(f"| {seed} | " + " | ".join(f"{g['per_seed'][seed]['val']:.4f}" if seed in g["per_seed"] else "-"
                                            for g in agg["rows"].values()) + " |")
    L += ["", "![serving](serving.png)", ""]
    path = os.path.join(out, "SERVING.md")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")
    return path


def parse_args(argv: Sequence[str]):
    """The command's arguments; a bad one is one line on stderr and exit 2 before anything is
    trained or written (:mod:`benchmarks.arguments`)."""
    p = A.Parser(prog="python -m benchmarks serving", description=__doc__.splitlines()[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--steps", type=A.int_at_least(2, "the fine-tune is the last 10% of the steps, at least one, "
                                                     "after at least one bf16 step"),
                   default=STEPS, help=f"the budget of every row, in steps (default {STEPS})")
    p.add_argument("--seeds", type=A.seed_list, default=",".join(map(str, grid.SEEDS)), help="seeds (default 0,1,2)")
    p.add_argument("--size", default=SIZE, choices=list(grid.SIZES), help=f"model size (default {SIZE})")
    p.add_argument("--out", type=A.output_dir, default=ct.DEFAULT_OUT, help=f"report folder (default {ct.DEFAULT_OUT})")
    p.add_argument("--cache", type=A.output_dir, default=DEFAULT_CACHE,
                   help=f"corpus, runs, exports (default {DEFAULT_CACHE})")
    p.add_argument("--max-bytes", type=A.positive_int, help=argparse.SUPPRESS)  # cap the corpus (tests)
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    A.make_output_dir(args.out)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)
    corpus = ct.build_corpus(args.cache, max_bytes=args.max_bytes)
    all_specs = specs(args.size, args.steps, args.seeds, args.cache, corpus)
    ct.one_device(args.cache)
    results = {}
    for spec in all_specs:
        if spec["row"] == "ptq":
            results[spec["name"]] = ptq_one(spec, corpus, args.cache, log)
        elif "of" in spec:
            results[spec["name"]] = w4a4_one(spec, corpus, args.cache, log)
        else:
            results[spec["name"]] = ct.run_one(spec, corpus, args.cache, log=log)
    import jax

    from benchmarks.train_step import model_summary

    cfg, _ = grid.run_config(args.size, args.steps, 0, "nvfp4", corpus)
    m = model_summary(cfg)
    wall = sum(r["wall_s"] for r in results.values())
    meta = {"command": " ".join(["python -m benchmarks serving", *argv]), "steps": args.steps, "seeds": args.seeds,
            "size": args.size, "model": f"{m['layers']} layers, d_model {m['d_model']}, MLP {m['mlp_hidden']}",
            "tokens_per_step": f"{m['batch_size']} x {m['seq_len']}", "runs_done": len(results), "runs_total": len(all_specs), "wall_min": wall / 60,
            "where": f"{jax.default_backend()}, {os.cpu_count()} CPU cores, jax {jax.__version__}, "
                     f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "git_commit": git_commit(), "tail_steps": max(1, round(args.steps * TAIL)),
            "calibration_batches": CALIBRATION_BATCHES, "qat_lr": tail_lr(args.size, args.steps, max(1, round(args.steps * TAIL)), corpus)}
    agg = aggregate(results, all_specs, args.seeds)
    payload = {"meta": meta, "corpus": {k: v for k, v in corpus.items() if k not in ("train", "val")},
               "aggregate": agg, "runs": {k: {kk: vv for kk, vv in v.items() if kk != "train_loss_every_10"}
                                          for k, v in results.items()}}
    with open(os.path.join(args.out, "serving.json"), "w") as f:
        json.dump(payload, f, indent=1)
    plot(agg, os.path.join(args.out, "serving.png"), args.steps)
    path = report(payload, args.out)
    for row, g in agg["rows"].items():
        log(f"{row:>7}: val {g['val']['mean']:.4f}, gap {g['gap_pct']['mean']:+.2f}% "
            f"[{g['gap_pct']['min']:+.2f}, {g['gap_pct']['max']:+.2f}]")
    log(f"wrote {path}, serving.json, serving.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
