"""Statistics of the convergence benchmarks' runs, paired by seed, and the report lines built on
them; shared by ``python -m benchmarks convergence --text`` (:mod:`benchmarks.convergence_text`),
its ``--recipe`` report (:mod:`benchmarks.convergence_recipe`) and ``python -m benchmarks serving``.

A run is a dict of its results (``final_val_loss``, ``val_history``, ``data_order_sha256``,
``source``, ...) in a ``results`` dict keyed by its name
(:func:`benchmarks.convergence_grid.run_name`). A gap is ``(variant - base) / base`` of the
final validation loss in percent, paired by seed; :func:`summarize` gives the mean, min, max,
std and count of the seeds' values, :func:`mean_interval` the 95% t-interval of the mean, and
:func:`below` whether that interval lies below a bound.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.common import SOURCES, git_commit
from benchmarks.convergence_grid import run_name


def summarize(xs: Sequence[float]) -> Dict[str, float]:
    """Mean, min, max, sample std (0 for one value) and count of ``xs``."""
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def gaps(results: Dict[str, Dict[str, Any]], size: str, steps: int, seeds: Sequence[int], variant: str,
         base: str = "bf16") -> Optional[Dict[str, Any]]:
    """The gap of ``variant`` over ``base`` at ``size`` and ``steps``, per seed of ``seeds``
    that has both runs and summarized over them; None when no seed has."""
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
            "gap_pct": summarize(pct), "gap_nats": summarize([p["gap"] for p in per.values()]),
            "val": summarize([p["val"] for p in per.values()]), "base_val": summarize(base_vals),
            "same_data_order": all(p["same_data_order"] for p in per.values())}


def same_source(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[bool]:
    """Whether two runs were trained by the same code (:func:`benchmarks.common.source_state`);
    None when either run predates the record."""
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


def gap_curve(results, size, steps, seeds, variant="nvfp4", base="bf16"):
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
    """Met when the mean gap is <= ``target`` % of the bf16 loss (the seeds' spread is reported, never a reason: a
    rule that any seed at or below bf16 meets would favour noisier results)."""
    if g is None:
        return {"met": None, "why": "not run"}
    m, lo, hi = g["gap_pct"]["mean"], g["gap_pct"]["min"], g["gap_pct"]["max"]
    if m <= target:
        return {"met": True, "why": f"mean gap {m:+.3f}% <= {target}%"}
    return {"met": False, "why": f"mean gap {m:+.3f}% > {target}%; seeds [{lo:+.3f}%, {hi:+.3f}%]"}


def met_text(v: Dict[str, Any]) -> str:
    """A :func:`verdict` in a word: met, NOT MET, not run."""
    return {True: "met", False: "NOT MET", None: "not run"}[v["met"]]


def pct_text(s: Dict[str, float]) -> str:
    """A :func:`summarize` of gaps in % as the reports write it: mean [min, max] (std, seeds)."""
    return f"{s['mean']:+.2f}% [{s['min']:+.2f}, {s['max']:+.2f}] (std {s['std']:.2f}, {s['n']} seeds)"


def states_text(src: Dict[str, Any]) -> List[str]:
    """Each code state of :func:`source_summary` as the reports name it."""
    return [f"`{s['sha256'][:12]}` ({s['runs']} runs; commit `{(s['git_commit'] or '?')[:10]}`"
            + (", with uncommitted changes" if s["dirty"] else "" if s["dirty"] is False else ", tree state unknown")
            + ")" for s in src["states"]]


def source_lines(meta: Dict[str, Any], agg: Dict[str, Any]) -> List[str]:
    """The code the runs were trained by (:func:`source_summary`) and the pairs that mix two
    states: a gap is only a gap when both runs ran the same code."""
    src = meta.get("sources")
    if not src:
        return []
    states = states_text(src)
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
    """The 95% t-interval of the mean of ``s`` (:func:`summarize` of per-seed differences)."""
    n = s["n"]
    t = _T975[min(n - 1, len(_T975)) - 1] if n > 1 else float("inf")
    half = t * s["std"] / math.sqrt(n)
    return s["mean"] - half, s["mean"] + half


def below(g: Optional[Dict[str, Any]], bound: float, seeds: int) -> Dict[str, Any]:
    """Whether the gap of ``g`` (:func:`gaps`) is below ``bound`` % of the base loss: met when the
    upper end of the 95% t-interval of the mean gap (:func:`mean_interval`) is below ``bound``,
    not met otherwise (``why`` says whether the whole interval is above it); no verdict (``met``
    None) until ``seeds`` seeds have both runs."""
    if g is None:
        return {"met": None, "why": "not run"}
    n = g["gap_pct"]["n"]
    if n < max(2, seeds):
        return {"met": None, "why": f"{n} of {seeds} seeds done: no verdict before all {seeds}"}
    lo, hi = mean_interval(g["gap_pct"])
    iv = f"95% interval of the mean gap [{lo:+.2f}%, {hi:+.2f}%]"
    if hi < bound:
        return {"met": True, "why": f"{iv}, all of it below {bound:g}%"}
    if lo > bound:
        return {"met": False, "why": f"{iv}, all of it above {bound:g}%"}
    return {"met": False, "why": f"{iv} contains {bound:g}%: not shown below it"}


def cpu_hours(results: Dict[str, Dict[str, Any]], specs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """What the runs of ``specs`` cost in CPU hours, each run on one core (a worker's one XLA
    thread), so that its wall time is its CPU time: the finished ones (``done_h``, ``runs_done``)
    and an estimate for the others (``todo_h``, ``runs_todo``), each at the mean wall time of the
    finished runs in ``results`` of its size, steps and variant, else of its size and steps;
    ``unestimated``: the runs with neither (not in ``todo_h``)."""
    done = [results[s["name"]]["wall_s"] for s in specs if s["name"] in results]
    todo, unestimated = [], []
    for s in specs:
        if s["name"] in results:
            continue
        cell = [r for r in results.values() if (r.get("size"), r.get("steps")) == (s["size"], s["steps"])]
        walls = ([r["wall_s"] for r in cell if r.get("variant") == s["variant"]] or [r["wall_s"] for r in cell])
        if walls:
            todo.append(statistics.fmean(walls))
        else:
            unestimated.append(s["name"])
    return {"runs_done": len(done), "done_h": sum(done) / 3600, "runs_todo": len(todo) + len(unestimated),
            "todo_h": sum(todo) / 3600, "unestimated": unestimated}


def report_head(title: str, meta: Dict[str, Any], made: str, extra: Sequence[str] = ()) -> List[str]:
    """A grid report's first lines: ``title``, the command that makes ``made`` (what it writes),
    the grid's run time (:func:`run_meta`), ``extra`` lines, and the runs not finished."""
    L = [title, "", f"Reproduce ({made}): `{meta['command']}`.",
         f"Run time: {meta['grid_wall_h']}, {meta['runs_done']} of {meta['runs_total']} runs ({meta['where']}).",
         *extra, ""]
    if meta["missing"]:
        L += [f"**Not run ({len(meta['missing'])} of {meta['runs_total']}):** "
              + ", ".join(f"`{m}`" for m in meta["missing"]) + ".", ""]
    return L


def reproduction_lines(reruns: Sequence[Dict[str, Any]]) -> List[str]:
    """The table of retrained runs (``--rerun NAME``): recorded and retrained validation loss, whether
    every recorded loss agrees bit for bit (naming the losses the record lacks, which were not
    compared), and the code of the retraining; nothing when none was retrained."""
    if not reruns:
        return []
    L = ["## Reproduction", "", "| run | recorded val loss | retrained | bit for bit | code of the retraining |",
         "|---|---:|---:|---|---|"]
    for x in reruns:
        unchecked = f" ({', '.join(f'`{k}`' for k in x['not_recorded'])}: not recorded)" if x.get("not_recorded") else ""
        L.append(f"| `{x['name']}` | {x['recorded']['final_val_loss']!r} | {x['rerun']['final_val_loss']!r} | "
                 f"{'yes' if x['identical'] else 'NO'}{unchecked} | `{x['rerun_source']['sha256'][:12]}` (commit "
                 f"`{(x['rerun_source'].get('git_commit') or '?')[:10]}`) |")
    return L + [""]


def write_text(out: str, name: str, lines: Sequence[str]) -> str:
    """Write ``lines`` as the report ``out/name``; its path."""
    path = os.path.join(out, name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def run_meta(results, specs, command: str, wall: float) -> Dict[str, Any]:
    """What a report says of its runs: the command, which runs are done, their time, where,
    whether every pair read the same batches, and the code they were trained by."""
    import jax

    run_wall = sum(r["wall_s"] for r in results.values())
    # Wall clock of the grid: the time during which at least one run was in progress, over every
    # invocation and worker process that contributed (a grid resumed later does not count the
    # time in between).
    span = busy_seconds(results)
    # When the last run finished (a report rebuilt later keeps its grid's date), else now.
    last = max((r["finished_unix"] for r in results.values()), default=None)
    finished = (datetime.datetime.fromtimestamp(last, datetime.timezone.utc) if last is not None
                else datetime.datetime.now(datetime.timezone.utc))
    same = [r["data_order_sha256"] == results[r["name"].rsplit("-", 1)[0] + "-bf16"]["data_order_sha256"]
            for r in results.values() if r["name"].rsplit("-", 1)[0] + "-bf16" in results]
    return {
        "command": command, "runs_done": len(results), "runs_total": len(specs),
        "missing": [s["name"] for s in specs if s["name"] not in results],
        "run_wall_s_sum": round(run_wall, 1), "this_invocation_wall_s": round(wall, 1),
        "grid_wall_s": round(span, 1),
        "grid_wall_h": f"{span / 3600:.2f} h wall clock with runs in progress ({run_wall / 3600:.2f} h of run "
                       f"time summed over the runs, at most {most_at_once(results)} at once)",
        "where": f"{jax.default_backend()}, {os.cpu_count()} CPU cores, jax {jax.__version__}, "
                 f"{finished:%Y-%m-%d %H:%M} UTC",
        "same_data_order": bool(same) and all(same), "sources": source_summary(results), "git_commit": git_commit(),
    }


def stored_runs(results) -> Dict[str, Any]:
    """The runs as the results JSON keeps them (without the training-loss trace)."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "train_loss_every_10"} for k, v in results.items()}


def busy_seconds(results) -> float:
    """Seconds during which at least one run was in progress (the union of the runs' spans)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((r["finished_unix"] - r["wall_s"], r["finished_unix"]) for r in results.values()):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def most_at_once(results) -> int:
    """The most runs in progress at one time."""
    ev = sorted([(r["finished_unix"] - r["wall_s"], 1) for r in results.values()]
                + [(r["finished_unix"], -1) for r in results.values()], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best
