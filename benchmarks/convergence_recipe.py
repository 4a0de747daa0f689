"""``python -m benchmarks convergence --text --recipe``: the full NVFP4 recipe's gap against width,
and the ablation that attributes it.

The runs are :mod:`benchmarks.convergence_text`'s (same corpus, same one-device runs, same
cache, paired by seed): :data:`~benchmarks.convergence_grid.RECIPE_SIZES` (the default model at
4 layers, d_model 64 to 512) for :data:`~benchmarks.convergence_grid.RECIPE_STEPS` steps, the
full recipe (``nvfp4.compute=nvfp4``) against bf16, and the full recipe with its last block in
bf16 (``nvfp4.keep_last_blocks=1``, a quarter of the blocks' linear layers; the head is always
bf16) against bf16 with the same split (the split draws other init keys). At the widest width
swept (or at each size ``--ablation-at`` names), :data:`~benchmarks.convergence_grid.ABLATIONS`
switch the recipe's elements off one at a time (the last block still bf16), each compared with
the full recipe of the same seed. ``--seeds-at SIZE=FIRST-LAST`` runs the sweep's two pairs at
SIZE for more seeds (:func:`more_seeds`): a section of their own gives each gap's 95% t-interval
and, once every seed is done, whether the gap is below
:data:`~benchmarks.convergence_grid.SEEDS_AT_BOUND`, with the cost in CPU hours done and to do.
The report's head (runs done, missing, run time, code) speaks of the sweep, the ablation and
the learning-rate check only.

This module aggregates the runs and writes ``CONVERGENCE_RECIPE.md``, ``convergence_recipe.json``
and ``convergence_recipe.png``; ``--rerun NAME`` trains one finished run again from the code of
the working tree and says whether its losses are the recorded ones, bit for bit.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import convergence_grid as grid
from benchmarks import stats

REPORT = "CONVERGENCE_RECIPE.md"
FULL = "compute_nvfp4"
FULL_KEEP = "compute_nvfp4_keep_last_blocks_1"
BASE_KEEP = "bf16_keep_last_blocks_1"
RECIPE_NAMES = {
    FULL: "full recipe, every block NVFP4",
    FULL_KEEP: "full recipe, last block bf16",
}


def widest(sizes: Sequence[str]) -> str:
    return grid.by_width(sizes)[-1]


def aggregate(results: Dict[str, Dict[str, Any]], sizes: Sequence[str], seeds: Sequence[int],
              ablation_sizes: Optional[Sequence[str]] = None,
              seeds_at: Optional[Dict[str, Sequence[int]]] = None) -> Dict[str, Any]:
    """Per size, the recipe's gap with and without the bf16 last block; at each ablation size
    (default: the widest), each ablation's gap against bf16 (same split) and its difference
    from the full recipe (``vs_default_pct``, paired by seed), and the attribution; the
    acceptance at the widest size; the sweep at more seeds (:func:`more_seeds`, ``seeds_at``)."""
    steps = grid.RECIPE_STEPS
    sweep = []
    for size in grid.by_width(sizes):
        row = {"size": size}
        for v, base in grid.RECIPE_PAIRS.items():
            g = stats.gaps(results, size, steps, seeds, v, base=base)
            if g:
                g["curve"] = stats.gap_curve(results, size, steps, seeds, v, base)
            row[v] = g
        sweep.append(row)
    top = widest(sizes) if sizes else None
    ablations = []
    for size in grid.by_width([top] if ablation_sizes is None and top else ablation_sizes or []):
        rows: Dict[str, Any] = {}
        ref = stats.gaps(results, size, steps, seeds, FULL_KEEP, base=BASE_KEEP)
        if ref:
            rows[FULL_KEEP] = ref
        for v in grid.ABLATIONS:
            g = stats.gaps(results, size, steps, seeds, v, base=BASE_KEEP)
            if g:
                d = stats.gaps(results, size, steps, seeds, v, base=FULL_KEEP)
                g["vs_default_pct"] = d["gap_pct"] if d else None
                rows[v] = g
        ablations.append({"size": size, "rows": rows, "attribution": attribution(rows)})
    lr = []  # the learning-rate check, per size: the same seeds at the default rate and at half of it
    for size in grid.by_width(sizes):
        half = stats.gaps(results, size, steps, seeds, FULL_KEEP + "_lr_half", base=BASE_KEEP + "_lr_half")
        if half:
            at = sorted(half["per_seed"])
            lr.append({"size": size, "lr_half": grid.LR_HALF, "seeds": at, "half": half,
                       "default": stats.gaps(results, size, steps, at, FULL_KEEP, base=BASE_KEEP),
                       "bf16_half_vs_default": stats.gaps(results, size, steps, at, BASE_KEEP + "_lr_half",
                                                          base=BASE_KEEP),
                       "recipe_half_vs_default": stats.gaps(results, size, steps, at, FULL_KEEP + "_lr_half",
                                                            base=FULL_KEEP)})
    return {"steps": steps, "sweep": sweep, "widest": top, "ablations": ablations, "lr_check": lr,
            "acceptance": acceptance(sweep, top), "seeds_at": more_seeds(results, seeds_at or {})}


def acceptance(sweep, top: str) -> Dict[str, Any]:
    """The verdicts at the widest size ``top`` against the recipe's target (:func:`benchmarks.stats.verdict`)."""
    at_top = next((r for r in sweep if r["size"] == top), {})
    return {"size": top, "full_recipe_keep_last": stats.verdict(at_top.get(FULL_KEEP), grid.RECIPE_TARGET),
            "full_recipe": stats.verdict(at_top.get(FULL), grid.RECIPE_TARGET)}


def more_seeds(results: Dict[str, Dict[str, Any]], seeds_at: Dict[str, Sequence[int]]) -> List[Dict[str, Any]]:
    """Per size of ``seeds_at`` (narrowest first), the sweep's two pairs at its seeds
    (:func:`~benchmarks.convergence_grid.seeds_at_grid`): each pair's gap over the seeds that have
    both runs, with the 95% t-interval of the mean (``interval``; None under two seeds) and the
    verdict on whether the gap is below :data:`~benchmarks.convergence_grid.SEEDS_AT_BOUND`
    (:func:`benchmarks.stats.below`: none until every seed is done); the seeds with all their runs
    done, the runs not done, the code the runs were trained by, and the cost in CPU hours (done,
    and estimated for the rest: :func:`benchmarks.stats.cpu_hours`)."""
    out = []
    for size in grid.by_width(seeds_at):
        seeds = list(seeds_at[size])
        specs = grid.seeds_at_grid({size: seeds})
        pairs, below = {}, {}
        for v, base in grid.RECIPE_PAIRS.items():
            g = stats.gaps(results, size, grid.RECIPE_STEPS, seeds, v, base=base)
            if g:
                g["interval"] = list(stats.mean_interval(g["gap_pct"])) if g["gap_pct"]["n"] > 1 else None
            pairs[v] = g
            below[v] = stats.below(g, grid.SEEDS_AT_BOUND, len(seeds))
        missing = [s for s in specs if s["name"] not in results]
        out.append({"size": size, "steps": grid.RECIPE_STEPS, "seeds": seeds, "bound_pct": grid.SEEDS_AT_BOUND,
                    "seeds_done": [x for x in seeds if not any(s["seed"] == x for s in missing)],
                    "runs_done": len(specs) - len(missing), "runs_total": len(specs),
                    "missing": [s["name"] for s in missing], "pairs": pairs, "below": below,
                    "sources": stats.source_summary({s["name"]: results[s["name"]] for s in specs
                                                     if s["name"] in results}),
                    "hosts": _hosts(results[s["name"]] for s in specs if s["name"] in results),
                    "cost": stats.cpu_hours(results, specs)})
    return out


def _hosts(runs) -> Dict[str, int]:
    """``{host CPU: runs}`` (``host_cpu`` in a run's JSON; ``"not recorded"`` for runs without it)."""
    out: Dict[str, int] = {}
    for r in runs:
        key = r.get("host_cpu") or "not recorded"
        out[key] = out.get(key, 0) + 1
    return out


def attribution(ablation: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The ablations ordered by how much switching the element off lowers the gap (mean of the
    paired differences from the full recipe), each with its 95% interval and verdict."""
    out = []
    for v, g in ablation.items():
        d = g.get("vs_default_pct")
        if v == FULL_KEEP or not d:
            continue
        lo, hi = stats.mean_interval(d) if d["n"] > 1 else (float("-inf"), float("inf"))
        out.append({"variant": v, "name": grid.ABLATION_NAMES[v], "gap_pct": g["gap_pct"], "minus_full_pct": d,
                    "interval": [lo, hi], "effect": stats.lever_effect(g, interval=True),
                    "met": stats.verdict(g, grid.RECIPE_TARGET)})
    return sorted(out, key=lambda a: a["minus_full_pct"]["mean"])


# ----------------------------------------------------------------------------- report
def plot(agg: Dict[str, Any], models: Dict[str, Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for v, c, dx in ((FULL, "tab:red", -0.04), (FULL_KEEP, "tab:blue", 0.04)):
        rows = [(models[r["size"]]["d_model"], r[v]["gap_pct"]) for r in agg["sweep"] if r.get(v)]
        if not rows:
            continue
        x = [d * 2 ** dx for d, _ in rows]
        mean = [s["mean"] for _, s in rows]
        err = _spread([s for _, s in rows])
        a.errorbar(x, mean, yerr=err, fmt="o-", color=c, capsize=3, label=f"{RECIPE_NAMES[v]} (seed min-max)")
    half = [(models[x["size"]]["d_model"], x["half"]["gap_pct"]["mean"], x["seeds"]) for x in agg.get("lr_check", [])]
    if half:
        most = max((ss for *_, ss in half), key=len)
        fewer = ", ".join(f"d_model {d}: {','.join(map(str, ss))}" for d, _, ss in half if ss != most)
        a.plot([d * 2 ** 0.04 for d, _, _ in half], [g for _, g, _ in half], "s--", color="tab:green",
               label=f"last block bf16, optim.lr={grid.LR_HALF:g} (mean of seeds {','.join(map(str, most))})"
                     + (f"\n(seeds at {fewer})" if fewer else ""))
    a.set_xscale("log", base=2)
    a.axhline(0, color="k", lw=0.8)
    a.axhline(grid.RECIPE_TARGET, color="k", ls=":", lw=0.8, label=f"{grid.RECIPE_TARGET}% (published level)")
    a.set_xlabel("d_model (4 layers)")
    a.set_ylabel("val loss gap, % of bf16")
    a.set_title(f"full recipe vs bf16, {agg['steps']} steps")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    names = [(FULL_KEEP, "full recipe")] + [(v, grid.ABLATION_NAMES[v].split(" (")[0]) for v in grid.ABLATIONS]
    done = [ab for ab in agg["ablations"] if ab["rows"]]
    if done:
        h = 0.8 / len(done)
        for i, ab in enumerate(done):  # one bar per ablated size and setting, narrowest first
            bars = [(k, ab["rows"][v]["gap_pct"]) for k, (v, _) in enumerate(names) if v in ab["rows"]]
            b.barh([k - 0.4 + h * (i + 0.5) for k, _ in bars], [g["mean"] for _, g in bars], height=h,
                   xerr=_spread([g for _, g in bars]), capsize=2, color=f"C{i}",
                   label=f"d_model {models[ab['size']]['d_model']}")
        b.set_yticks(list(range(len(names))), [label for _, label in names], fontsize=8)
        b.invert_yaxis()
        b.axvline(0, color="k", lw=0.8)
        b.axvline(grid.RECIPE_TARGET, color="k", ls=":", lw=0.8)
        b.set_xlabel("val loss gap, % of bf16 with the same split")
        b.set_title("one element off at a time (last block bf16)", fontsize=9)
        b.grid(alpha=0.3, axis="x")
        b.legend(fontsize=7)
    else:
        b.text(0.5, 0.5, "ablation not run", transform=b.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(summaries) -> List[List[float]]:
    """Error bars from the mean to the seeds' min and max (never negative: equal seeds)."""
    return [[max(0.0, s["mean"] - s["min"]) for s in summaries], [max(0.0, s["max"] - s["mean"]) for s in summaries]]


def _cell(g: Optional[Dict[str, Any]]) -> str:
    return stats.pct_text(g["gap_pct"]) if g else "not run"


def write_report(out: str, payload: Dict[str, Any]) -> str:
    agg, meta, corpus = payload["aggregate"], payload["meta"], payload["corpus"]
    models = meta["models"]
    L = stats.report_head("# The full NVFP4 recipe against bf16: gap against width, and an ablation", meta,
                          "corpus, runs, this report, the JSON and the plot",
                          [f"Retrain one finished run and compare its losses bit for bit: `{meta['command']} --rerun NAME`."])
    L += ["## Setup", "",
          f"The corpus, splits and run protocol of [CONVERGENCE_TEXT.md](CONVERGENCE_TEXT.md) (train sha256 "
          f"`{corpus['train']['sha256'][:16]}...`, held-out `{corpus['val']['sha256'][:16]}...`): byte tokens, one "
          f"device per run, `train.seed = data.seed = seed` for seeds {meta['seeds']}, every pair reads the same "
          f"batches (sha256 of every training batch, equal in every pair: **{meta['same_data_order']}**), final "
          f"validation loss on {grid.EVAL_BATCHES} held-out batches. Gap = (recipe - bf16) / bf16 in % of the bf16 "
          "loss, paired by seed: mean [min, max] (std).", "",
          "The models: the default model at 4 layers, widened with 32-wide heads, 16 x 64 tokens per step, "
          f"{agg['steps']} steps ({agg['steps'] * 16 * 64:,} tokens). The full recipe (`nvfp4.compute=nvfp4`): "
          "weights stored in 16x16 tiles; activations (fprop, and wgrad's x) and gradients quantized in 1x16 "
          "blocks along the contraction; gradients rounded stochastically; a random Hadamard transform on both "
          "wgrad operands; embedding, head and norms bf16. With the last block bf16 (`nvfp4.keep_last_blocks=1`): "
          "7 of the 28 block linear layers (25%, the nearest 4 layers come to the published ~16%), against bf16 "
          "with the same split (the split draws the last block's params from other init keys).", ""]
    L += stats.source_lines(meta, {"table": [g for r in agg["sweep"] for g in (r.get(FULL), r.get(FULL_KEEP)) if g],
                                "levers": {f"{ab['size']}/{k}": g for ab in agg["ablations"] for k, g in ab["rows"].items()}})
    L += [f"## Gap against width ({agg['steps']} steps)", "",
          "| size | d_model | MLP | params | tokens per non-embedding param | bf16 val loss | full recipe | "
          "bf16 val loss, split | full recipe, last block bf16 |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in agg["sweep"]:
        m = models[r["size"]]
        base = lambda g: f"{g['base_val']['mean']:.4f}" if g else "-"
        per = f"{agg['steps'] * 16 * 64 / m['non_embedding']:.2f}" if m.get("non_embedding") else "-"
        L.append(f"| {r['size']} | {m['d_model']} | {m['mlp_hidden']} | {m['params'] / 1e6:.2f} M | {per} | {base(r.get(FULL))} | "
                 f"{_cell(r.get(FULL))} | {base(r.get(FULL_KEEP))} | {_cell(r.get(FULL_KEEP))} |")
    L += ["", "![gap against width; ablation](convergence_recipe.png)", ""]
    for x in agg.get("seeds_at") or []:
        L += more_seeds_lines(x, models[x["size"]], meta["command"])
    for ab in agg["ablations"]:
        if not ab["rows"]:
            continue
        L += [f"## Ablation ({ab['size']}, last block bf16, {agg['steps']} steps)", "",
              "Each row switches one element of the recipe off. Gap: against bf16 with the same split. "
              "Minus the full recipe: the paired difference from the full recipe's run of the same seed "
              "(negative: the element costs that much).", "",
              "| setting | val loss (mean) | gap % of bf16 | minus the full recipe, % | effect of switching it off |",
              "|---|---:|---|---|---|"]
        for v, g in ab["rows"].items():
            name = RECIPE_NAMES.get(v) or grid.ABLATION_NAMES[v]
            d = g.get("vs_default_pct")
            L.append(f"| {name} | {g['val']['mean']:.4f} | {stats.pct_text(g['gap_pct'])} | "
                     f"{stats.pct_text(d) if d else '-'} | {stats.lever_effect(g, interval=True) if d else '-'} |")
        L.append("")
        if ab["attribution"]:
            L += ["Attribution (the elements ordered by what switching each off takes off the gap):", ""]
            for x in ab["attribution"]:
                lo, hi = x["interval"]
                L.append(f"- {x['name']}: {x['minus_full_pct']['mean']:+.2f}% of the loss (95% interval "
                         f"[{lo:+.2f}%, {hi:+.2f}%]); gap then {x['gap_pct']['mean']:+.2f}% ({stats.met_text(x['met'])} at "
                         f"{grid.RECIPE_TARGET}%).")
            L.append("")
    if agg.get("lr_check"):
        L += ["## Learning rate (last block bf16)", "",
              f"The sweep trains every width at the default model's learning rate (`optim.lr={meta['lr']:g}`). "
              f"The same pairs again at `optim.lr={grid.LR_HALF:g}`, same seeds and batches; each row's seeds are the "
              "ones run at both rates. Halving: the paired change of each side's validation loss.", "",
              "| size | seeds | optim.lr | bf16 val loss, split | full recipe, last block bf16 | gap % of bf16 | "
              "halving moves bf16 | halving moves the recipe |", "|---|---|---:|---:|---:|---|---|---|"]
        for x in agg["lr_check"]:
            seeds = ",".join(map(str, x["seeds"]))
            for rate, g, moves in ((meta["lr"], x["default"], (None, None)),
                                   (x["lr_half"], x["half"], (x["bf16_half_vs_default"], x["recipe_half_vs_default"]))):
                if g:
                    m = [f"{d['gap_pct']['mean']:+.2f}%" if d else "" for d in moves]
                    L.append(f"| {x['size']} | {seeds} | {rate:g} | {g['base_val']['mean']:.4f} | {g['val']['mean']:.4f} | "
                             f"{stats.pct_text(g['gap_pct'])} | {m[0]} | {m[1]} |")
        L.append("")
    if any(ab["rows"] for ab in agg["ablations"]):
        L += ["1D weights: the weights-only layout (one scale per 16 consecutive inputs) serves the forward "
              "GEMM as stored; the backward GEMM contracts over the outputs, so it re-quantizes the dequantized "
              "weight in 1x16 blocks along them, and sees another weight than the forward pass (the 16x16 tiles "
              "serve both as they are). Activations in bf16: the forward and weight-gradient GEMMs multiply the "
              "bf16 activations by the other operand dequantized (not an FP4 GEMM).", ""]
    a = acceptance(agg["sweep"], agg["widest"])  # judged by today's rule, also for a payload read from its JSON
    L += ["## Acceptance", "",
          "Rule: mean gap <= target.", "",
          f"- Full recipe with the last block bf16 at the widest width ({a['size']}): target {grid.RECIPE_TARGET}% -> "
          f"**{stats.met_text(a['full_recipe_keep_last'])}** ({a['full_recipe_keep_last']['why']}).",
          f"- Full recipe, every block NVFP4 ({a['size']}): target {grid.RECIPE_TARGET}% -> "
          f"**{stats.met_text(a['full_recipe'])}** ({a['full_recipe']['why']})."]
    top_lr = next((x for x in agg.get("lr_check", []) if x["size"] == a["size"]), None)
    if top_lr:
        L.append(f"- The same at `optim.lr={grid.LR_HALF:g}` (seeds {','.join(map(str, top_lr['seeds']))}; the "
                 f"learning-rate table above): gap {stats.pct_text(top_lr['half']['gap_pct'])} -> "
                 f"**{stats.met_text(stats.verdict(top_lr['half'], grid.RECIPE_TARGET))}**.")
    L.append("")
    return stats.write_text(out, REPORT, L + stats.reproduction_lines(payload.get("reruns") or []))


def seeds_text(seeds: Sequence[int]) -> str:
    """Seeds as ``--seeds-at`` writes them when they run on (``0-7``), else comma-separated."""
    seeds = sorted(map(int, seeds))  # a JSON object's keys are strings
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def more_seeds_lines(x: Dict[str, Any], model: Dict[str, Any], command: str) -> List[str]:
    """The report's section on the sweep at more seeds at one size (an item of
    :func:`more_seeds`): the two pairs' gaps, intervals and verdicts, the seeds done, the cost in
    CPU hours done and to do, and the command that trains the runs not done."""
    n, done, bound = len(x["seeds"]), x["seeds_done"], x["bound_pct"]
    L = [f"## Gap at {n} seeds ({x['size']}, {x['steps']} steps)", "",
         f"The sweep's two pairs at d_model {model['d_model']} for seeds {seeds_text(x['seeds'])} "
         f"(`--seeds-at {x['size']}={seeds_text(x['seeds'])}`), so that the 95% t-interval of the mean gap (paired "
         f"by seed) says whether the gap is below {bound:g}% of the bf16 loss: it is when the interval's upper end "
         f"is. Done: **{len(done)} of {n} seeds** ({x['runs_done']} of {x['runs_total']} runs)"
         + (f"; the verdict waits for all {n}." if len(done) < n else "."), "",
         f"| comparison | seeds | bf16 val loss | recipe val loss | gap % of bf16 | 95% interval of the mean | "
         f"below {bound:g}%? |", "|---|---|---:|---:|---|---|---|"]
    for v, base in grid.RECIPE_PAIRS.items():
        g, b = x["pairs"][v], x["below"][v]
        name = f"{RECIPE_NAMES[v]} vs bf16" + (" with the same split" if base != "bf16" else "")
        word = {True: "**yes**: ", False: "**no**: ", None: ""}[b["met"]] + b["why"]
        if not g:
            L.append(f"| {name} | - | - | - | not run | - | {word} |")
            continue
        iv = g.get("interval")
        L.append(f"| {name} | {seeds_text(g['per_seed'])} | {g['base_val']['mean']:.4f} | {g['val']['mean']:.4f} | "
                 f"{stats.pct_text(g['gap_pct'])} | " + (f"[{iv[0]:+.2f}%, {iv[1]:+.2f}%]" if iv else "-")
                 + f" | {word} |")
    c = x["cost"]
    cost = (f"Run cost, each run on one core: {c['done_h']:.2f} CPU hours done ({c['runs_done']} runs), "
            f"about {c['todo_h']:.2f} CPU hours to do ({c['runs_todo']} runs")
    cost += (", each at the mean time of the finished runs of its variant at this width" if c["runs_todo"] else "")
    cost += (f"; {len(c['unestimated'])} of them without a finished run to estimate from" if c["unestimated"] else "")
    cost += (f"; about {c['todo_h'] / 2:.2f} h wall clock with `--workers 2` on 2 free cores)." if c["runs_todo"]
             else ").")
    L += ["", cost]
    todo = [s for s in x["seeds"] if s not in done]
    if todo:
        per = {s: sum(grid.run_name(x["size"], x["steps"], s, v) in x["missing"] for v in grid.RECIPE_VARIANTS)
               for s in todo}
        whole = [s for s in todo if per[s] == len(grid.RECIPE_VARIANTS)]
        parts = ([f"seed{'s' if len(whole) > 1 else ''} {', '.join(map(str, whole))} (every run)"] if whole else []) + [
            f"seed {s} ({per[s]} of {len(grid.RECIPE_VARIANTS)} runs)" for s in todo if s not in whole]
        L += ["", "Not run yet: " + "; ".join(parts) + ". Train them, the committed runs restored into the cache "
              f"first and nothing else of the grid trained: `{command} --from-results --train-seeds "
              f"{','.join(map(str, todo))}`."]
    L.append("")
    L += stats.source_lines({"sources": x["sources"]},
                            {"table": [g for g in x["pairs"].values() if g], "levers": {}})
    if len(x["sources"]["states"]) > 1:
        L += [f"These seeds were trained by {len(x['sources']['states'])} code states: the interval pools them "
              "(`--rerun NAME` says whether this tree's code retrains a recorded run bit for bit).", ""]
    hosts = x.get("hosts") or {}
    L += [f"Settings pinned to what the recorded runs trained with: `{' '.join(grid.RECIPE_PINNED)}`. Hosts (CPU "
          "model, `host_cpu` in a run's JSON): " + "; ".join(f"{h} ({n} runs)" for h, n in hosts.items())
          + ". XLA:CPU compiles for the host's instruction set: a run retrains bit for bit on the same kind of CPU, "
          "not across kinds; each seed's pair trains on one host, and the interval pools hosts.", ""]
    return L


def assemble(results, specs, corpus, args, command: str, wall: float, cache: str) -> Dict[str, Any]:
    from benchmarks.train_step import model_summary

    models = {}
    for size in args.sizes:
        cfg, _ = grid.run_config(size, 10, 0, "bf16", corpus)
        models[size] = {**model_summary(cfg), "params": n_params(cfg), "non_embedding": grid.non_embedding_params(cfg)}
    seeds_at = getattr(args, "seeds_at", None) or {}
    # The head of the report (runs done, missing, run time, code) speaks of the sweep, the ablation
    # and the learning-rate check; the sweep at more seeds counts its own runs in its section.
    sweep = grid.recipe_grid(args.sizes, args.seeds, args.ablation_at, args.lr_check)
    main = {s["name"]: results[s["name"]] for s in sweep if s["name"] in results}
    meta = {"seeds": list(args.seeds), "sizes": list(args.sizes), "models": models, "lr": cfg.optim.lr,
            "run_wall_s": {size: round(statistics.fmean([r["wall_s"] for r in main.values() if r["size"] == size]), 1)
                           for size in args.sizes if any(r["size"] == size for r in main.values())},
            **stats.run_meta(main, sweep, command, wall)}
    if seeds_at:
        meta["seeds_at"] = {size: list(seeds) for size, seeds in seeds_at.items()}
    agg = aggregate(results, args.sizes, args.seeds, args.ablation_at, seeds_at)
    return {"meta": meta, "corpus": corpus, "aggregate": agg,
            "reruns": read_reruns(cache, {s["name"] for s in specs}), "runs": stats.stored_runs(results)}


def n_params(cfg) -> int:
    """The model's parameter count (embedding and head included)."""
    import math

    import jax
    import jax.numpy as jnp

    from train.model import from_config

    model = from_config(cfg.model, cfg.nvfp4)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.model.seq_len), jnp.int32)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


def write(out: str, payload: Dict[str, Any]) -> str:
    os.makedirs(out, exist_ok=True)
    plot(payload["aggregate"], payload["meta"]["models"], os.path.join(out, "convergence_recipe.png"))
    with open(os.path.join(out, "convergence_recipe.json"), "w") as f:
        json.dump(payload, f, indent=1)
    return write_report(out, payload)


# ----------------------------------------------------------------------------- reproduction
def rerun_dir(cache: str) -> str:
    return os.path.join(cache, "reruns")


def compare(name: str, recorded: Dict[str, Any], rerun: Dict[str, Any]) -> Dict[str, Any]:
    """Whether a retrained run's losses are the recorded ones bit for bit (the final validation
    loss, every validation point and the training losses every 10 steps). A loss the record
    lacks (a run restored from a results JSON keeps no training-loss trace) is not compared:
    ``fields`` has None for it, ``not_recorded`` names it, and ``identical`` speaks of the others."""
    keys = ("final_val_loss", "val_history", "final_train_loss", "train_loss_every_10")
    same = {k: recorded[k] == rerun.get(k) if k in recorded else None for k in keys}
    out = {"name": name, "identical": all(v for v in same.values() if v is not None), "fields": same}
    missing = [k for k in keys if k not in recorded]
    if missing:
        out["not_recorded"] = missing
    return {**out,
            "recorded": {k: recorded.get(k) for k in ("final_val_loss", "final_train_loss")},
            "rerun": {k: rerun.get(k) for k in ("final_val_loss", "final_train_loss")},
            "recorded_source": recorded.get("source"), "rerun_source": rerun.get("source"),
            "checked_unix": rerun.get("finished_unix")}


def read_reruns(cache: str, names=None) -> List[Dict[str, Any]]:
    """The verdicts of ``--rerun`` in ``cache`` (of the runs in ``names``, when given), by name."""
    d = rerun_dir(cache)
    if not os.path.isdir(d):
        return []
    out = []
    for f in sorted(os.listdir(d)):
        if f.endswith(".json") and (names is None or f[:-5] in names):
            with open(os.path.join(d, f)) as fh:
                out.append(json.load(fh))
    return out
