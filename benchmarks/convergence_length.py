"""``python -m benchmarks convergence --text --length-sweep``: the NVFP4 gap against training length.

The runs are :mod:`benchmarks.convergence_text`'s (same corpus, same one-device runs, same
cache, paired by seed) at one width (:data:`~benchmarks.convergence_grid.LENGTH_SIZE`, the
4-layer d_model 64 model of the recipe grid unless ``--sizes`` says otherwise), for budgets in
tokens per non-embedding parameter (``--budgets``, converted to steps from the model's own
count: every parameter but the embedding and the head). Each run's cosine schedule decays to 10%
of the peak over its own length. Weights-only NVFP4 (the default) is compared with bf16, the
full recipe with its last block bf16 (``nvfp4.compute=nvfp4 nvfp4.keep_last_blocks=1``) with
bf16 with the same split. ``--levers`` adds weights-only NVFP4 with one lever each at one budget
(``--levers-at``; ``--lever-seeds`` adds seeds there).

This module aggregates the runs and writes ``CONVERGENCE_LENGTH.md`` and
``convergence_length.json``: per budget the final gap (seeds' mean, range and 95% interval); the
levers against the default; where the gap comes from (what storage alone costs a bf16-trained
model, in each storage format, against what training through NVFP4 weights adds); from the
validation history the gap half-way through the run against the final one (the second half is
where the cosine takes the learning rate from about 55% of the peak to 10%); and the next budget
the sweep leaves out, with its cost.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import convergence_grid as grid
from benchmarks import stats

REPORT = "CONVERGENCE_LENGTH.md"
NAMES = {"nvfp4": "weights-only NVFP4 (default) vs bf16",
         "compute_nvfp4_keep_last_blocks_1": "full recipe, last block bf16 vs bf16 (same split)",
         "keep_last_blocks_1": "weights-only, last block bf16 vs bf16 (same split)",
         "block_2d": "weights-only, 2d 16x16 tiles vs bf16",
         "stochastic_rounding": "weights-only, stochastic rounding of the re-quantization vs bf16",
         "four_over_six": "weights-only, each block's scale to 6 or 4 (`nvfp4.four_over_six`) vs bf16"}
PLOT = "convergence_length.png"
# Epochs of the training text a budget may take: up to about 4, repeated text trains about as well as new text
# (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models"); past it a budget measures repetition too.
MAX_EPOCHS = 4


def format_name(fmt: str) -> str:
    """A storage format of :data:`~benchmarks.convergence_grid.STORAGE_FORMATS` as its lever's name says it."""
    return NAMES[fmt].split(", ", 1)[1].split(" vs ")[0]


def budget_cells(specs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The (budget, size, steps) cells of ``specs``, in their order."""
    cells: List[Dict[str, Any]] = []
    for s in specs:
        cell = {"budget": s["budget"], "size": s["size"], "steps": s["steps"]}
        if cell not in cells:
            cells.append(cell)
    return cells


def half_way(curve, steps: int):
    """The evaluation of ``curve`` (:func:`stats.gap_curve`) nearest half of ``steps``, and the last."""
    if len(curve) < 2:
        return None, None
    mid = min(curve[:-1], key=lambda c: abs(c[0] - steps / 2))
    return mid, curve[-1]


def decay(results, size: str, steps: int, seeds: Sequence[int], variant: str, base: str) -> Optional[Dict[str, Any]]:
    """The gap at the evaluation nearest half-way, at the end, and the end minus half-way paired
    by seed (negative: the gap shrinks while the learning rate decays), with its 95% interval."""
    curve = stats.gap_curve(results, size, steps, seeds, variant, base)
    mid, end = half_way(curve, steps)
    if mid is None:
        return None
    diff = stats.summarize([b - a for a, b in zip(mid[1], end[1])])
    interval = list(stats.mean_interval(diff)) if diff["n"] > 1 else None
    return {"mid_step": mid[0], "end_step": end[0], "mid": stats.summarize(mid[1]), "end": stats.summarize(end[1]),
            "end_minus_mid": diff, "interval": interval,
            "curve": [(s, stats.summarize(v)["mean"]) for s, v in curve]}


def aggregate(results: Dict[str, Dict[str, Any]], specs: Sequence[Dict[str, Any]], seeds: Sequence[int],
              shapes: Dict[str, Dict[str, int]], train_bytes: int, lr_at=None) -> Dict[str, Any]:
    """Per budget cell: tokens, tokens per non-embedding parameter, epochs of the training text,
    and per compared variant the final gap (with its 95% interval) and :func:`decay`.
    ``lr_at(size, steps, step)``: the learning rate there as a fraction of the peak (optional)."""
    rows = []
    for cell in budget_cells(specs):
        size, steps = cell["size"], cell["steps"]
        sh = shapes[size]
        tokens = steps * sh["tokens_per_step"]
        row = {**cell, "tokens": tokens, "tokens_per_param": tokens / sh["non_embedding"],
               "epochs": tokens / train_bytes, "pairs": {}}
        for v, base in grid.LENGTH_PAIRS.items():
            g = stats.gaps(results, size, steps, seeds, v, base=base)
            if g:
                g["interval"] = list(stats.mean_interval(g["gap_pct"])) if g["gap_pct"]["n"] > 1 else None
                g["decay"] = decay(results, size, steps, seeds, v, base)
                if g["decay"] and lr_at:
                    g["decay"]["mid_lr"] = lr_at(size, steps, g["decay"]["mid_step"])
            row["pairs"][v] = g
        for v, base in grid.LENGTH_LEVERS.items():
            if any(x["variant"] == v and x["steps"] == steps and x["size"] == size for x in specs):
                row["pairs"][v] = lever(results, size, steps, seeds, v, base, row["pairs"].get("nvfp4"))
        row["sources"] = sources(results, size, steps, seeds)
        rows.append(row)
    return {"rows": rows}


# The weights-only runs whose diagnostics (:func:`benchmarks.convergence_text.weight_diagnostics`)
# split their gap: each with its bf16 run of the same seed.
SOURCE_VARIANTS = ("nvfp4", "four_over_six")


def sources(results, size: str, steps: int, seeds: Sequence[int]) -> Optional[Dict[str, Any]]:
    """Where the weights-only gap comes from, over the seeds whose runs recorded diagnostics, each in
    % of the seed's bf16 validation loss: ``quantized_bf16`` (the bf16 run's final weights quantized
    once: what NVFP4 storage alone costs a model trained in bf16); per weights-only variant ``storage``
    (the same in that variant's own format: the default's, or that of a lever of
    :data:`~benchmarks.convergence_grid.STORAGE_FORMATS`), ``masters`` (its float32 masters evaluated
    without NVFP4: how far training through NVFP4 weights moved the model itself), ``stored`` (its NVFP4
    weights: the gap) and ``beyond_storage`` (the gap minus ``storage``, paired by seed); and per format of
    :data:`~benchmarks.convergence_grid.STORAGE_FORMATS`, over the seeds that recorded it, ``formats``:
    ``cost`` in it, ``default`` (the default format's on the same seeds) and, paired, the difference."""
    def run(seed, v):
        return results.get(grid.run_name(size, steps, seed, v))

    have = [s for s in seeds if run(s, "bf16") and "val_loss_quantized" in run(s, "bf16")]
    if not have:
        return None

    def cost(s, fmt=None):  # the bf16 run of seed s quantized once in format fmt (None: the default)
        r = run(s, "bf16")
        x = r["val_loss_quantized"] if fmt is None else r.get("val_loss_quantized_as", {}).get(fmt)
        return None if x is None else 100.0 * (x - r["final_val_loss"]) / r["final_val_loss"]

    pct = lambda x, s: 100.0 * (x - run(s, "bf16")["final_val_loss"]) / run(s, "bf16")["final_val_loss"]
    out = {"seeds": have, "quantized_bf16": stats.summarize([cost(s) for s in have]), "variants": {}, "formats": {}}
    for v in SOURCE_VARIANTS:
        fmt = v if v in grid.STORAGE_FORMATS else None
        both = [s for s in have if run(s, v) and "val_loss_master" in run(s, v) and cost(s, fmt) is not None]
        if both:
            stored = [pct(run(s, v)["final_val_loss"], s) for s in both]
            out["variants"][v] = {"seeds": both, "format": fmt, "storage": stats.summarize([cost(s, fmt) for s in both]),
                                  "masters": stats.summarize([pct(run(s, v)["val_loss_master"], s) for s in both]),
                                  "stored": stats.summarize(stored),
                                  "beyond_storage": stats.summarize([g - cost(s, fmt) for g, s in zip(stored, both)])}
    every = [s for s in have if all(cost(s, f) is not None for f in grid.STORAGE_FORMATS)]
    if every:  # each format's mean cost over the same seeds, the default's first
        out["common"] = {"seeds": every, "cost": {f: statistics.fmean(cost(s, None if f == "default" else f) for s in every)
                                                  for f in ("default", *grid.STORAGE_FORMATS)}}
    for f in grid.STORAGE_FORMATS:
        both = [s for s in have if cost(s, f) is not None]
        if both:
            out["formats"][f] = {"seeds": both, "cost": stats.summarize([cost(s, f) for s in both]),
                                 "default": stats.summarize([cost(s) for s in both]),
                                 "vs_default": stats.summarize([cost(s, f) - cost(s) for s in both])}
    return out


def lever(results, size: str, steps: int, seeds: Sequence[int], v: str, base: str, default) -> Optional[Dict[str, Any]]:
    """A lever's gap over its bf16 base (as :func:`stats.gaps`, with its 95% interval) and, paired by
    seed, its gap minus the default weights-only gap (``vs_default_pct``: negative, the lever holds
    the gap lower)."""
    g = stats.gaps(results, size, steps, seeds, v, base=base)
    if not g:
        return None
    g["interval"] = list(stats.mean_interval(g["gap_pct"])) if g["gap_pct"]["n"] > 1 else None
    both = [s for s in g["per_seed"] if default and s in default["per_seed"]]
    if both:
        g["vs_default_pct"] = stats.summarize([g["per_seed"][s]["gap_pct"] - default["per_seed"][s]["gap_pct"]
                                               for s in both])
        g["vs_default_seeds"] = both
    return g


def cost(results: Dict[str, Dict[str, Any]], specs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """CPU hours: each run trains on one core (one XLA thread), so its wall time is its CPU time."""
    per: Dict[str, float] = {}
    for s in specs:
        r = results.get(s["name"])
        if r:
            per[str(s["budget"])] = per.get(str(s["budget"]), 0.0) + r["wall_s"]
    return {"cpu_h_per_budget": {k: v / 3600 for k, v in per.items()}, "cpu_h": sum(per.values()) / 3600}


def write_report(out: str, payload: Dict[str, Any]) -> str:
    agg, meta, corpus = payload["aggregate"], payload["meta"], payload["corpus"]
    c = meta["cost"]
    L = stats.report_head("# NVFP4 against bf16: the gap against training length", meta,
                          "corpus, runs, this report, the JSON and the plot",
                          [f"Run cost: {c['cpu_h']:.2f} CPU hours (each run on one core; per budget in tokens/param: "
                           + ", ".join(f"{k}: {v:.2f} h" for k, v in c["cpu_h_per_budget"].items()) + ")."])
    if meta.get("budgets_not_in_grid"):
        L += ["**Budgets not in this grid:** " + ", ".join(
            f"{b['budget']} tokens/param ({', '.join(f'{s}: {n} steps' for s, n in b['steps'].items())}, "
            f"{b['epochs']:.2f} epochs)" for b in meta["budgets_not_in_grid"])
              + " (the sweep's default budgets; run them with `--budgets`).", ""]
    nxt = meta.get("next_budget")
    if nxt:
        est = nxt.get("cpu_h_estimate")
        L += [f"The next budget, {nxt['budget']} tokens/param, is "
              + ", ".join(f"{n:,} steps of {s}" for s, n in nxt["steps"].items())
              + f", {nxt['epochs']:.2f} epochs of the training text"
              + (f", past the about {MAX_EPOCHS} over which repeated text trains about as well as new text "
                 "(Muennighoff et al. 2023): a longer budget wants a larger corpus" if round(nxt["epochs"]) > MAX_EPOCHS
                 else "") + "; not in this sweep"
              + (f": its variants there would take about {est:.1f} CPU hours (the longest budget's runs, scaled by "
                 "the steps)" if est else "") + (f"; `{nxt['command']}` adds it" if nxt.get("command") else "")
              + ".", ""]
    shapes = meta["shapes"]
    L += ["## Setup", "",
          f"The corpus, splits and run protocol of [CONVERGENCE_TEXT.md](CONVERGENCE_TEXT.md) (train "
          f"{corpus['train']['bytes']:,} bytes, sha256 `{corpus['train']['sha256'][:16]}...`; held-out "
          f"`{corpus['val']['sha256'][:16]}...`): byte tokens, one device per run, `train.seed = data.seed = seed` "
          f"for seeds {meta['seeds']}" + (f" (the levers and the runs they are judged against also for seeds "
                                          f"{[x for x in meta['lever_seeds'] if x not in meta['seeds']]})"
                                          if set(meta.get("lever_seeds") or ()) - set(meta["seeds"]) else "")
          + f", every pair reads the same batches (sha256 of every training batch, equal in "
          f"every pair: **{meta['same_data_order']}**), validation loss on {grid.EVAL_BATCHES} held-out batches every "
          "tenth of the run and at the end. Gap = (variant - base) / base in % of the base's final validation "
          "loss, paired by seed: mean [min, max] (std), and the 95% t-interval of the mean.", "",
          "Model: " + "; ".join(f"`{s}` ({sh['non_embedding']:,} non-embedding parameters: all but the embedding "
                                f"and the head; {sh['tokens_per_step']:,} tokens per step)" for s, sh in shapes.items())
          + ". A budget of B tokens per non-embedding parameter is round(B x params / tokens per step) steps; the "
          "default cosine schedule (20 warmup steps, decay to 10% of `optim.lr`) spans each run, so every run "
          "decays. Weights-only NVFP4 (`nvfp4.weights=nvfp4`, the default) against bf16; the full recipe with "
          "its last block bf16 (`nvfp4.compute=nvfp4 nvfp4.keep_last_blocks=1`) against bf16 with the same split "
          "(`nvfp4.keep_last_blocks=1`: the split draws the last block's params from other init keys).", ""]
    L += stats.source_lines(meta, {"table": [g for r in agg["rows"] for g in r["pairs"].values() if g], "levers": {}})
    L += ["## Final gap against tokens per parameter", "",
          "| budget (tokens/param) | size | steps | tokens | epochs | comparison | bf16 val loss | gap % of bf16 | "
          "95% interval |", "|---:|---|---:|---:|---:|---|---:|---|---|"]
    for r in agg["rows"]:
        for v, g in r["pairs"].items():
            if v in grid.LENGTH_LEVERS:
                continue  # their own table below
            head = (f"| {r['budget']} ({r['tokens_per_param']:.2f}) | {r['size']} | {r['steps']} | {r['tokens']:,} | "
                    f"{r['epochs']:.2f} | {NAMES[v]} | ")
            if not g:
                L.append(head + "- | not run | - |")
                continue
            iv = g.get("interval")
            L.append(head + f"{g['base_val']['mean']:.4f} | {stats.pct_text(g['gap_pct'])} | "
                     + (f"[{iv[0]:+.2f}%, {iv[1]:+.2f}%] |" if iv else "- |"))
    levers = [(r, v, g) for r in agg["rows"] for v, g in r["pairs"].items() if v in grid.LENGTH_LEVERS]
    if levers:
        L += ["", f"## Levers for weights-only NVFP4 at {levers[0][0]['budget']} tokens/param", "",
              "Each lever is weights-only NVFP4 with one setting changed, against the bf16 run of the same model "
              "(`nvfp4.keep_last_blocks=1` against bf16 with the same split). Lever minus default: the lever's "
              "gap minus the default weights-only gap, paired by seed (negative: the lever holds the gap lower); "
              "a verdict needs the same sign in every seed and a 95% interval of the mean that excludes 0.", "",
              "| budget | lever | gap % of bf16 | 95% interval | lever minus default | verdict |",
              "|---:|---|---|---|---|---|"]
        for r, v, g in levers:
            if not g:
                L.append(f"| {r['budget']} | {NAMES[v]} | not run | - | - | - |")
                continue
            iv, vs = g.get("interval"), g.get("vs_default_pct")
            L.append(f"| {r['budget']} | {NAMES[v]} | {stats.pct_text(g['gap_pct'])} | "
                     + (f"[{iv[0]:+.2f}%, {iv[1]:+.2f}%]" if iv else "-") + " | "
                     + (stats.pct_text(vs) if vs else "-") + f" | {stats.lever_effect(g, interval=True)} |")
    L += ["", f"![gap against tokens per parameter]({PLOT})"]
    src = [r for r in agg["rows"] if r.get("sources")]
    if src:
        L += ["", "## Where the weights-only gap comes from", "",
              "Each run evaluated once more at its end, on the same held-out batches (in % of the same seed's bf16 "
              "validation loss; mean [min, max] over the seeds): the bf16 run's final weights quantized once as the "
              "weights-only run stores its weights (what 4-bit storage alone costs a model trained in bf16, in that "
              "run's format), each weights-only run's float32 masters evaluated without NVFP4, and its NVFP4 weights "
              "(its gap). The gap minus that storage cost, paired by seed, is what training through NVFP4 weights adds "
              "to it (negative: the model trained through them is stored at a lower cost than the bf16-trained one).",
              "", "| budget | seeds | weights-only run | bf16 weights quantized once (its format) | its float32 masters "
              "| its NVFP4 weights (the gap) | gap minus storage cost |", "|---:|---|---|---|---|---|---|"]
        for r in src:
            for v, d in r["sources"]["variants"].items():
                L.append(f"| {r['budget']} | {', '.join(map(str, d['seeds']))} | {NAMES[v].split(' vs ')[0]} | "
                         f"{stats.pct_text(d['storage'])} | {stats.pct_text(d['masters'])} | {stats.pct_text(d['stored'])} | "
                         f"{stats.pct_text(d['beyond_storage'])} |")
        fmts = [r for r in src if r["sources"]["formats"]]
        if fmts:
            L += ["", "What storage alone costs in each format: the bf16 run's final weights quantized once in it, the "
                  "default format's cost (1d blocks of 16, each scaled to 6) on the same seeds, and the difference, "
                  "paired by seed (negative: the format stores the same model at a lower cost). A run trained before "
                  "this diagnostic existed takes it from a bit-identical retraining (`--rerun NAME`, under "
                  "Reproduction).", "",
                  "| budget | format | seeds | bf16 weights quantized once | the default format | difference |",
                  "|---:|---|---|---|---|---|"]
            for r in fmts:
                for f, d in r["sources"]["formats"].items():
                    L.append(f"| {r['budget']} | {format_name(f)} | "
                             f"{', '.join(map(str, d['seeds']))} | {stats.pct_text(d['cost'])} | "
                             f"{stats.pct_text(d['default'])} | {stats.pct_text(d['vs_default'])} |")
            last = max((r for r in fmts if r["sources"].get("common")), key=lambda r: r["tokens_per_param"], default=None)
            if last:
                common = last["sources"]["common"]
                best = min(common["cost"], key=common["cost"].get)
                name = "the default format" if best == "default" else format_name(best)
                target = grid.WEIGHTS_ONLY_TARGET
                L += ["", f"At {last['budget']} tokens/param, on the seeds that recorded every format "
                          f"({', '.join(map(str, common['seeds']))}), the lowest storage cost, {common['cost'][best]:+.2f}% "
                          f"(the seeds' mean), is that of {name}: "
                      + (f"below the {target}% weights-only target." if common["cost"][best] < target else
                         f"every format stores the bf16-trained model above the {target}% weights-only target. That is "
                         "the cost of storing a model trained in bf16; a model trained through NVFP4 weights may end "
                         "below it (the gap minus storage cost above).")]
    L += ["", "## The gap while the learning rate decays", "",
          "From each run's validation history: the gap at the evaluation nearest half-way through the run "
          "(the cosine's learning rate there, as a fraction of the peak, in the column) and at the end (10% of "
          "the peak); end minus half-way is paired by seed (negative: the gap shrinks during the second half "
          "of the decay).", "",
          "| budget | comparison | half-way step (lr/peak) | gap half-way | gap at the end | end minus half-way | "
          "95% interval |", "|---:|---|---|---|---|---|---|"]
    for r in agg["rows"]:
        for v, g in r["pairs"].items():
            d = g and g.get("decay")
            if not d:
                continue
            lr = f" ({d['mid_lr']:.2f})" if d.get("mid_lr") is not None else ""
            iv = d["interval"]
            L.append(f"| {r['budget']} | {NAMES[v]} | {d['mid_step']} of {d['end_step']}{lr} | "
                     f"{stats.pct_text(d['mid'])} | {stats.pct_text(d['end'])} | {stats.pct_text(d['end_minus_mid'])} | "
                     + (f"[{iv[0]:+.2f}%, {iv[1]:+.2f}%] |" if iv else "- |"))
    L += ["", "Mean gap over the validation history (step: gap % of bf16):", ""]
    for r in agg["rows"]:
        for v, g in r["pairs"].items():
            d = g and g.get("decay")
            if d:
                L.append(f"- {r['budget']} tokens/param, {NAMES[v]}: "
                         + ", ".join(f"{s}: {x:+.2f}" for s, x in d["curve"]) + ".")
    L.append("")
    return stats.write_text(out, REPORT, L + stats.reproduction_lines(payload.get("reruns") or []))


def assemble(results, specs, corpus, args, command: str, wall: float, cache: Optional[str] = None) -> Dict[str, Any]:
    from benchmarks.convergence_recipe import read_reruns
    from train.optimizer import schedule_for

    shapes = args.shapes

    def lr_at(size, steps, step):
        cfg, _ = grid.run_config(size, steps, 0, "bf16", corpus)
        return float(schedule_for(cfg)(step)) / cfg.optim.lr

    seeds = sorted({*args.seeds, *(args.lever_seeds or ())})  # each cell takes the seeds whose runs it has
    meta = {"seeds": list(args.seeds), "lever_seeds": list(args.lever_seeds or ()), "sizes": list(args.sizes), "budgets": list(args.budgets), "shapes": shapes,
            "budgets_not_in_grid": [not_run(b, shapes, corpus["train"]["bytes"]) for b in grid.LENGTH_BUDGETS
                                    if b not in args.budgets],
            "cost": cost(results, specs), **stats.run_meta(results, specs, command, wall)}
    meta["next_budget"] = next_budget(results, specs, shapes, corpus["train"]["bytes"], args.budgets, command,
                                      (args.levers_at or max(args.budgets)) if args.levers else None)
    agg = aggregate(results, specs, seeds, shapes, corpus["train"]["bytes"], lr_at)
    reruns = read_reruns(cache, {s["name"] for s in specs}) if cache else []
    return {"meta": meta, "corpus": corpus, "aggregate": agg, "reruns": reruns, "runs": stats.stored_runs(results)}


def next_budget(results, specs, shapes: Dict[str, Dict[str, int]], train_bytes: int, budgets: Sequence[int],
                command: str, levers_at: Optional[int]) -> Dict[str, Any]:
    """The budget after the sweep's longest (twice it), as :func:`not_run`, with ``cpu_h_estimate`` (the
    sweep's own variants at the longest budget, their CPU time scaled by the steps; absent until they
    are all done) and ``command``: the sweep's ``command`` with it added to ``--budgets`` (and
    ``--levers-at`` keeping the levers where they ran)."""
    top = max(budgets)
    out = not_run(2 * top, shapes, train_bytes)
    at_top = [s for s in specs if s["budget"] == top and s["variant"] in grid.LENGTH_VARIANTS]
    if at_top and all(s["name"] in results for s in at_top):
        out["cpu_h_estimate"] = sum(results[s["name"]]["wall_s"] * out["steps"][s["size"]] / s["steps"]
                                    for s in at_top) / 3600
    words, budget_list = command.split(), ",".join(map(str, [*budgets, out["budget"]]))
    if "--budgets" in words:
        words[words.index("--budgets") + 1] = budget_list
    else:
        words += ["--budgets", budget_list]
    if levers_at is not None and "--levers-at" not in words:
        words += ["--levers-at", str(levers_at)]
    out["command"] = " ".join(words)
    return out


def not_run(budget, shapes: Dict[str, Dict[str, int]], train_bytes: int) -> Dict[str, Any]:
    """A budget the grid leaves out: its steps per size and epochs (of the first size)."""
    steps = {s: grid.budget_steps(budget, sh["non_embedding"], sh["tokens_per_step"]) for s, sh in shapes.items()}
    size = next(iter(shapes))
    return {"budget": budget, "steps": steps, "epochs": steps[size] * shapes[size]["tokens_per_step"] / train_bytes}


def plot(agg: Dict[str, Any], path: str) -> None:
    """Gap % of bf16 against tokens per parameter: one line (the seeds' mean) per comparison, the
    seeds as points; the levers (at their one budget) as points beside it; and, where the runs
    recorded it, the storage cost (the bf16 weights quantized once, the seeds' mean), in each format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, v in enumerate(NAMES):
        pts = [(r["tokens_per_param"], g) for r in agg["rows"] for k, g in r["pairs"].items() if k == v and g]
        if not pts:
            continue
        shift = 2 ** (0.03 * (i - 2))  # seeds of different comparisons side by side
        xs = [x * shift for x, _ in pts]
        ax.plot(xs, [g["gap_pct"]["mean"] for _, g in pts], "o-" if len(pts) > 1 else "D", color=f"C{i}",
                label=NAMES[v])
        for x, (_, g) in zip(xs, pts):
            seeds = [p["gap_pct"] for p in g["per_seed"].values()]
            ax.plot([x] * len(seeds), seeds, ".", color=f"C{i}", alpha=0.5)
    src = [(r["tokens_per_param"], r["sources"]["quantized_bf16"]) for r in agg["rows"] if r.get("sources")]
    if src:
        ax.plot([x for x, _ in src], [q["mean"] for _, q in src], "s--", color="0.4", ms=4,
                label="bf16 weights quantized once (the storage cost)")
    for f, marker in zip(grid.STORAGE_FORMATS, "^v<>"):
        pts = [(r["tokens_per_param"], r["sources"]["formats"][f]["cost"]["mean"]) for r in agg["rows"]
               if f in (r.get("sources") or {}).get("formats", {})]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker + ":", color="0.4", ms=4,
                    label=f"the same, stored as {format_name(f).split(' (')[0]}")
    ax.set_xscale("log")
    budgets = sorted({r["tokens_per_param"] for r in agg["rows"]})
    ax.set_xticks(budgets, [f"{b:.0f}" for b in budgets])  # the budgets, not log-scale minor labels
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axhline(0, color="k", lw=0.8)
    ax.axhline(grid.WEIGHTS_ONLY_TARGET, color="k", ls=":", lw=0.8, label=f"{grid.WEIGHTS_ONLY_TARGET}%")
    ax.set_xlabel("tokens per non-embedding parameter")
    ax.set_ylabel("final val loss gap, % of bf16")
    ax.set_title("NVFP4 against bf16 by training length (line: mean; dots: seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: str, payload: Dict[str, Any]) -> str:
    os.makedirs(out, exist_ok=True)
    plot(payload["aggregate"], os.path.join(out, PLOT))
    with open(os.path.join(out, "convergence_length.json"), "w") as f:
        json.dump(payload, f, indent=1)
    return write_report(out, payload)
