"""Figure 5: final loss after a fixed budget on the embedded corpus, NVFP4 vs bf16 weights.

Three runs of ``train.loop.run`` on the same config, mesh and data: NVFP4 weights with
dequantized bf16 GEMMs (the default), bf16 weights (the baseline), and NVFP4 weights with
``nvfp4.compute=nvfp4`` (the recipe's quantized GEMMs; emulated where no block-scaled GEMM
exists). The entropy rate of the Markov corpus is the floor no model can beat.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict, Sequence

from benchmarks.train_step import size_config
from train import loop, summary
from train import mesh as mesh_lib

RUNS = (
    ("nvfp4", ["nvfp4.weights=nvfp4", "nvfp4.compute=dequant"]),
    ("bf16", ["nvfp4.weights=bf16"]),
    ("nvfp4_compute", ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4"]),
)
GAP_TARGET = 0.1  # nats


def run(size: str, steps: int, devices: Sequence[Any], out_dir: str, *, log=print) -> Dict[str, Any]:
    """Train each of :data:`RUNS` for ``steps`` steps; returns losses, gaps and the plot path."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:  # metrics.jsonl of each run: not kept
        for label, overrides in RUNS:
            cfg = size_config(size, "nvfp4", [*overrides, f"train.steps={steps}"])
            mesh = mesh_lib.build_mesh(cfg.mesh, list(devices))
            t0 = time.perf_counter()
            r = loop.run(cfg, mesh, os.path.join(tmp, label), progress=False, label=label)
            r = {k: v for k, v in r.items() if k not in ("params", "opt_state", "data_state")}
            r["wall_s"] = time.perf_counter() - t0
            runs.append(r)
            log(f"  {label:>13}: final loss {r['final_loss']:.4f} (floor {r['entropy_floor']:.4f}), "
                f"{r['median_step_time_s'] * 1e3:.1f} ms/step, {r['wall_s']:.0f} s")
    os.makedirs(out_dir, exist_ok=True)
    plot = os.path.join(out_dir, "convergence.png")
    summary.plot_losses(runs, plot, runs[0]["entropy_floor"])
    by = {r["label"]: r for r in runs}
    n, b, c = by["nvfp4"], by["bf16"], by["nvfp4_compute"]
    floor = n["entropy_floor"]
    return {
        "size": size,
        "steps": steps,
        "data": len(devices),
        "entropy_floor": floor,
        "runs": {r["label"]: {
            "final_loss": r["final_loss"],
            "last_loss": r["last_loss"],
            "above_floor": r["final_loss"] - floor,
            "median_step_time_s": r["median_step_time_s"],
            "skipped_steps": r["skipped_steps"],
            "wall_s": r["wall_s"],
            # Every 5th step keeps the JSON small; the plot has every step.
            "history_every_5": [round(x, 4) for x in r["history"][::5]],
        } for r in runs},
        "gap_nvfp4_minus_bf16": n["final_loss"] - b["final_loss"],
        "gap_nvfp4_compute_minus_bf16": c["final_loss"] - b["final_loss"],
        "gap_target": GAP_TARGET,
        "plot": os.path.basename(plot),
    }
