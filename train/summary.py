"""What a run leaves besides its metrics: ``summary.json`` and ``loss.png`` (one run, or NVFP4
against bf16 with ``--compare``), and the strict-JSON records both are written with."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional

import jax
import numpy as np


def json_record(rec: Dict[str, Any]) -> str:
    """``rec`` as one line of strict JSON: non-finite floats (a skipped step's NaN loss) become null."""
    return json.dumps(_finite_or_none(rec), allow_nan=False)


def _finite_or_none(x):
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


def plot_losses(runs, path: str, floor: Optional[float]):
    """``loss.png``: each run's training (and validation) loss against the step on a log axis with
    plain tick labels; with two runs a second panel shows their difference per step (first - second).
    Returns the figure."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure list
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    two = len(runs) == 2
    fig = Figure(figsize=(7, 6.5 if two else 4))
    axes = fig.subplots(2 if two else 1, 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [2, 1]} if two else None)
    ax = axes[0, 0]
    for i, r in enumerate(runs):
        st = dict(color=("tab:blue", "tab:orange", "tab:purple", "tab:red")[i % 4], lw=1.4,
                  ls=("-", "--", "-.", (0, (1, 1)))[i % 4])
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
        dx.plot(np.arange(1, n + 1), diff, color="tab:green", lw=1,
                label=f"{a['label']} - {b['label']} (train, per step)")
        vb = dict(b.get("val_history") or [])
        pts = [(s, v - vb[s]) for s, v in a.get("val_history") or [] if s in vb]
        if pts:
            dx.plot(*zip(*pts), "D", color="k", ms=5, label="validation difference")
        dx.axhline(0, color="k", lw=0.8)
        dx.set_ylabel("loss difference (nats)")
        dx.legend(fontsize=8)
        dx.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def summarize(runs, out_dir: str) -> Dict[str, Any]:
    """Write summary.json (and loss.png, process 0); return the summary without arrays."""
    keep = ("label", "steps", "final_loss", "final_loss_steps", "last_loss", "final_val_loss", "val_history",
            "entropy_floor", "median_step_time_s", "skipped_steps", "all_gather_bytes", "bf16_gather_bytes",
            "nvfp4_gather_bytes", "nvfp4_bf16_gather_bytes", "nvfp4_block", "collectives", "temp_bytes")
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
