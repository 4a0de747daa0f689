"""REPORT.md, HEADLINE.md and plots from the JSON results of ``python -m benchmarks``.

Reads whichever section files exist in the results folder (``traffic.json``, ``memory.json``,
``speed.json``, ``quantize.json``, ``convergence.json``, ``scaling.json``), so running one
section refreshes its part of the report and keeps the others. Also checks the targets:
:func:`target_misses` lists, in plain words, every figure outside its target.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from benchmarks.train_step import LEAF_LIMIT, LEAF_LIMIT_TEXT, packed_gather_measured

SECTIONS = ("traffic", "memory", "speed", "quantize", "convergence", "scaling")
# The packed gather may exceed its physical limit by 0.2% (amax words, leaves whose scales
# stay replicated).
LEAF_TARGET = round(LEAF_LIMIT * 1.002, 4)
GAP_TARGET = 0.1
STATE_PARTS = ("params", "master", "optimizer", "grads")


# ----------------------------------------------------------------------------- loading
def load(out_dir: str) -> Dict[str, Any]:
    res = {}
    for s in SECTIONS:
        path = os.path.join(out_dir, f"{s}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[s] = json.load(f)
    return res


def _mb(b: Optional[float]) -> str:
    if b is None:
        return "n/a"
    if b >= 1 << 20:
        return f"{b / (1 << 20):.2f} MiB"
    if b >= 1 << 10:
        return f"{b / (1 << 10):.1f} KiB"
    return f"{int(b)} B"


def _r(x: Optional[float], digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ms(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s * 1e3:.1f} ms"


def _where(meta: Dict[str, Any]) -> str:
    return (f"{meta.get('n_devices')} x {meta.get('device_kind')} ({meta.get('platform')}"
            f"{', simulated devices on ' + str(meta.get('cpu_count')) + ' CPU cores' if meta.get('platform') == 'cpu' else ''}), "
            f"jax {meta.get('jax')}, commit {str(meta.get('git_commit'))[:10]}"
            + (" with uncommitted changes to jax_nvfp4/ or train/" if meta.get("dirty") else "") + f", {meta.get('date')}"
            + (f", host load {meta['load_avg_1m']}" if meta.get("load_avg_1m") is not None else ""))


def _point_label(p: Dict[str, Any]) -> str:
    m = p["model"]
    return f"{p['size']} (d={m['d_model']}, {m['layers']} layers), data={p['data']}"


# ----------------------------------------------------------------------------- targets
def target_misses(res: Dict[str, Any]) -> List[str]:
    """Every figure outside its target, one plain sentence each."""
    out = []
    points = []
    for s in ("traffic", "memory", "speed"):
        if s in res:
            points.append((s, res[s]["point"]))
    for p in res.get("scaling", {}).get("points", []):
        points.append(("scaling", p))
    seen = set()
    for sec, p in points:
        key = (p["size"], p["data"])
        r = p["ratios"]
        if sec in ("traffic", "scaling") and (key, "leaf") not in seen:
            seen.add((key, "leaf"))
            g = packed_gather_measured(p["nvfp4"], p["bf16"])
            if g["comparable"] and g["ratio"] is not None and g["ratio"] > LEAF_TARGET:
                out.append(f"{sec}: {_point_label(p)}: packed gather ratio measured across the runs "
                           f"{g['ratio']:.4f} (NVFP4 run's u8 weight gathers / the bf16 run's gathers of the "
                           f"same weights) > target {LEAF_TARGET} ({LEAF_LIMIT_TEXT})")
        if (key, "mem") not in seen and r["state_memory"] is not None:
            seen.add((key, "mem"))
            if r["state_memory"] >= 1:
                out.append(f"{sec}: {_point_label(p)}: training-state memory ratio NVFP4/bf16 "
                           f"{r['state_memory']:.3f} is not < 1")
    a = res.get("speed", {}).get("against")
    if a and a["ratio"] > a["target"]:
        out.append(f"speed: step time {a['ratio']:.3f}x that of commit {a['rev'][:10]} > target {a['target']}")
    c = res.get("convergence")
    if c:
        if abs(c["gap_nvfp4_minus_bf16"]) >= GAP_TARGET:
            out.append(f"convergence: |NVFP4 - bf16| final loss = {abs(c['gap_nvfp4_minus_bf16']):.4f} "
                       f"nats >= target {GAP_TARGET} after {c['steps']} steps")
        if abs(c["gap_nvfp4_compute_minus_bf16"]) >= GAP_TARGET:
            out.append(f"convergence: |NVFP4 (compute=nvfp4) - bf16| final loss = "
                       f"{abs(c['gap_nvfp4_compute_minus_bf16']):.4f} nats >= {GAP_TARGET} after {c['steps']} steps")
    return out


def leaf_unchecked(res: Dict[str, Any]) -> List[str]:
    """The points whose measured packed gather ratio is not held to its target: the bf16 run
    keeps weights replicated (not gathered) that the NVFP4 run gathers packed, so the two runs'
    gathers are not of the same weights (:func:`benchmarks.train_step.packed_gather_measured`)."""
    out, seen = [], set()
    points = [res["traffic"]["point"]] if "traffic" in res else []
    points += res.get("scaling", {}).get("points", [])
    for p in points:
        g = packed_gather_measured(p["nvfp4"], p["bf16"])
        if (p["size"], p["data"]) not in seen and g["ratio"] is not None and not g["comparable"]:
            seen.add((p["size"], p["data"]))
            out.append(f"{p['size']} data={p['data']} ({g['ratio']:.4f})")
    return out


# ----------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# One marker per weight format in every plot (hollow for the bf16 baseline), one colour per size.
MARKERS = {"nvfp4": dict(marker="o"), "bf16": dict(marker="s", mfc="none")}


def plot_scaling(points: List[Dict[str, Any]], path: str):
    """The scaling figure (returned, closed): bytes, ratios, memory and time against the
    data-axis size; plain tick labels (data sizes as numbers, bytes and seconds with units)."""
    plt = _plt()
    from matplotlib.ticker import EngFormatter, FixedLocator, NullFormatter, NullLocator

    sizes = list(dict.fromkeys(p["size"] for p in points))
    colors = dict(zip(sizes, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    (a, b), (c, d) = axes
    for size in sizes:
        ps = sorted((p for p in points if p["size"] == size), key=lambda p: p["data"])
        x = [p["data"] for p in ps]
        col = colors[size]
        for w, ls in (("nvfp4", "-"), ("bf16", "--")):
            style = dict(color=col, label=f"{size} {w}", **MARKERS[w])
            g = [(p["data"], p[w]["gather"]["param_gather_bytes"]) for p in ps if p[w]["gather"]["param_gather_bytes"]]
            if g:  # data=1 gathers nothing: no point on a log axis
                a.plot(*zip(*g), ls, **style)
            c.plot(x, [p[w]["memory"]["total"] for p in ps], ls, **style)
            t = [(p["data"], p[w]["step_time_s"]) for p in ps if p[w]["step_time_s"]]
            if t:
                d.plot(*zip(*t), ls, **style)
        lr = [(p["data"], p["ratios"]["leaf_gather"]) for p in ps if p["ratios"]["leaf_gather"] is not None]
        mr = [(p["data"], p["ratios"]["model_gather"]) for p in ps if p["ratios"]["model_gather"] is not None]
        if lr:
            b.plot(*zip(*lr), "-", marker="o", color=col, label=f"{size}: NVFP4 weights, packed / bf16 of the same weights")
        if mr:
            b.plot(*zip(*mr), ":", marker="^", color=col, label=f"{size}: whole model, NVFP4 run / bf16 run")
    b.axhline(LEAF_LIMIT, color="k", lw=1, ls="--", label=LEAF_LIMIT_TEXT)
    a.set(title="params all-gathered per step per device", ylabel="bytes", yscale="log")
    b.set(title="gathered bytes, NVFP4 / bf16", ylabel="ratio", ylim=(0, 1))
    c.set(title="training state per device (params+master+opt+grads)", ylabel="bytes", yscale="log")
    d.set(title="median step time", ylabel="seconds", yscale="log")
    datas = sorted({p["data"] for p in points})
    for ax, unit in ((a, "B"), (c, "B"), (d, "s")):
        ax.yaxis.set_major_formatter(EngFormatter(unit=unit))
        ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        # The measured data-axis sizes, written as numbers (not 2^k).
        ax.xaxis.set_major_locator(FixedLocator(datas))
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("data-axis size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2 if ax is not b else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return fig


def plot_memory(points: List[Dict[str, Any]], path: str) -> None:
    """Stacked per-device state bytes, NVFP4 vs bf16, for each point; temporaries beside."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(points) + 2), 4))
    colors = dict(zip(STATE_PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:gray")))
    xt, xl = [], []
    for i, p in enumerate(points):
        for j, w in enumerate(("nvfp4", "bf16")):
            x = 3 * i + j
            bottom = 0
            for part in STATE_PARTS:
                v = p[w]["memory"][part] / (1 << 20)
                ax.bar(x, v, bottom=bottom, color=colors[part], label=part if (i, j) == (0, 0) else None)
                bottom += v
            xt.append(x)
            xl.append(f"{p['size']}\n{w}")
    ax.set_xticks(xt, xl, fontsize=7)
    ax.set_ylabel("MiB per device")
    ax.set_title(f"training state per device, data={points[0]['data']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# Purposes of jax_nvfp4.comm.PURPOSES shown in the report, in order, with their labels.
PURPOSE_LABELS = {
    "weight gather": "weight all-gather",
    "grad reduce": "gradient reduction",
    "grad norm": "gradient-clipping norm",
    "re-quantize": "re-quantization",
    "loss / metrics": "loss and metrics",
    "other": "other",
}


def plot_traffic(p: Dict[str, Any], path: str) -> None:
    plt = _plt()
    keys = [k for k in PURPOSE_LABELS if any(k in p[w]["collectives_by_purpose"] for w in ("nvfp4", "bf16"))]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for j, (w, col) in enumerate((("nvfp4", "tab:blue"), ("bf16", "tab:gray"))):
        vals = [sum(p[w]["collectives_by_purpose"].get(k, {}).values()) / 1024 for k in keys]
        ax.bar([i + 0.4 * j for i in range(len(keys))], vals, width=0.4, color=col, label=f"{w} weights")
    ax.set_xticks([i + 0.2 for i in range(len(keys))], [PURPOSE_LABELS[k] for k in keys], rotation=20,
                  ha="right", fontsize=7)
    ax.set_ylabel("KiB per device per step")
    ax.set_title(f"collectives of the compiled step: {_point_label(p)}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- markdown
def _cmd(sec: Dict[str, Any]) -> str:
    note = sec["meta"].get("command_note")
    return f"`{sec['meta']['command']}`" + (f" ({note})" if note else "")


def _traffic_md(t: Dict[str, Any]) -> List[str]:
    p = t["point"]
    n, b, r = p["nvfp4"], p["bf16"], p["ratios"]
    g = n["gather"]
    pm = packed_gather_measured(n, b)
    lines = [
        "## 1. Bytes all-gathered per step (parameters) and gradient reduction",
        "",
        f"Reproduce: {_cmd(t)}. {_point_label(p)}; {_where(t['meta'])}.",
        "Bytes per device per step, read from the compiled step's HLO by `jax_nvfp4.comm.parse` (each "
        "instruction's result, times the trip count of the loops around it) and attributed by the "
        "name scope and Python call stack XLA keeps for each instruction: a collective "
        "in the `weight_gather` scope (each layer's gather, forward and rematerialised backward) is a "
        "parameter gather, one in the `ordered_reduce` scope the gradient reduction, and so on.",
        "",
        "| | NVFP4 weights | bf16 weights | NVFP4 / bf16 |",
        "|---|---:|---:|---:|",
        f"| params all-gathered, whole model (NVFP4 run's HLO / bf16 run's HLO) | {_mb(g['param_gather_bytes'])} | "
        f"{_mb(b['gather']['param_gather_bytes'])} | **{_r(r['model_gather'], 4)}** |",
        f"| packed gather ratio, measured across the runs: the NVFP4 run's packed (u8) weight gathers / the "
        f"bf16 run's weight gathers less those of the leaves both keep in bf16 | {_mb(pm['packed_bytes'])} | "
        f"{_mb(pm['bf16_bytes'])} | **{_r(pm['ratio'], 5)}** (target <= {LEAF_TARGET}) |",
        f"| per-leaf layout ratio: the NVFP4 leaves' packed bytes / 2 bytes per value of the same leaves "
        f"(from the NVFP4 run alone: {LEAF_LIMIT_TEXT} by construction) | {_mb(g['nvfp4_gather_bytes'])} | "
        f"{_mb(g['nvfp4_bf16_gather_bytes'])} | {_r(r['leaf_gather'], 5)} |",
        f"| gradient reduction | {_mb(n['grad_reduce_bytes'])} | {_mb(b['grad_reduce_bytes'])} | "
        f"{_r(r['grad_reduce'])} |",
        f"| every collective of the step | {_mb(n['all_collective_bytes'])} | {_mb(b['all_collective_bytes'])} | "
        f"{_r(r['all_collectives'])} |",
        "",
        f"The packed gathers measured across the runs reach {_r(pm['ratio'] / LEAF_LIMIT if pm['ratio'] else None, 4)} "
        f"of the layout's limit ({LEAF_LIMIT_TEXT}). The whole-model ratio is higher because the embedding "
        "and the head stay bf16 and are gathered as 16-bit words. Against the analytic bf16 gather of "
        f"the same sharded leaves the whole model moves {_r(r['model_gather_vs_analytic_bf16'], 4)}.",
        "",
        "By purpose and op:dtype, bytes per device per step:",
        "",
        "| purpose | op:dtype | NVFP4 weights | bf16 weights |",
        "|---|---|---:|---:|",
    ]
    for k, label in PURPOSE_LABELS.items():
        nk, bk = n["collectives_by_purpose"].get(k, {}), b["collectives_by_purpose"].get(k, {})
        for od in sorted(set(nk) | set(bk)):
            lines.append(f"| {label} | {od} | {nk.get(od, 0):,} | {bk.get(od, 0):,} |")
    lines += ["", "![collectives](traffic.png)", ""]
    return lines


def _memory_md(m: Dict[str, Any], scaling: Optional[Dict[str, Any]]) -> List[str]:
    p = m["point"]
    n, b, r = p["nvfp4"]["memory"], p["bf16"]["memory"], p["ratios"]
    lines = [
        "## 2. Per-device memory of the training state",
        "",
        f"Reproduce: {_cmd(m)}. {_point_label(p)}; {_where(m['meta'])}.",
        "params, float32 masters and the rest of the optimizer state: the largest per-device sum of "
        "the arrays' addressable shards. grads: the float gradient tree each device holds before the "
        "cross-device reduction (whole tensors, from shapes and shardings). Temporaries: "
        "`compiled.memory_analysis().temp_size_in_bytes` of the step.",
        "",
        "| per device | NVFP4 weights | bf16 weights | NVFP4 / bf16 |",
        "|---|---:|---:|---:|",
    ]
    for part in STATE_PARTS:
        lines.append(f"| {part} | {_mb(n[part])} | {_mb(b[part])} | {_r(n[part] / b[part] if b[part] else None)} |")
    lines += [
        f"| **training state** | **{_mb(n['total'])}** | **{_mb(b['total'])}** | **{_r(r['state_memory'])}** |",
        f"| step temporaries | {_mb(n['compiled_temp'])} | {_mb(b['compiled_temp'])} | {_r(r['temp_memory'])} |",
        f"| step arguments (compiled) | {_mb(n['compiled_argument'])} | {_mb(b['compiled_argument'])} | "
        f"{_r(n['compiled_argument'] / b['compiled_argument'] if b['compiled_argument'] else None)} |",
        "",
        "![memory](memory.png)",
        "",
    ]
    return lines


def _speed_md(s: Dict[str, Any]) -> List[str]:
    p = s["point"]
    n, b, r = p["nvfp4"], p["bf16"], p["ratios"]
    return [
        "## 3. Step time",
        "",
        f"Reproduce: {_cmd(s)}. {_point_label(p)}; {_where(s['meta'])}.",
        f"Median of {len(n['step_times_s'])} steps after compilation and one untimed step.",
        "",
        "| | NVFP4 weights | bf16 weights | NVFP4 / bf16 |",
        "|---|---:|---:|---:|",
        f"| step time | {_ms(n['step_time_s'])} | {_ms(b['step_time_s'])} | **{_r(r['step_time'])}** |",
        "",
        "On CPU the simulated devices share the host's cores and there is no interconnect to save: "
        "the step time shows the compute cost of quantizing and dequantizing, not the gather savings.",
        "",
    ] + against_md(s.get("against"))


def against_md(a: Optional[Dict[str, Any]]) -> List[str]:
    """This tree's NVFP4 step against an earlier commit's (``--against REV``), side by side."""
    if not a:
        return []
    n = len(a["step_times_s_here"])
    if a.get("block_here"):
        same = (f"the same NVFP4 step (both sides store {a['block_here']} blocks: "
                f"{a.get('block_why', 'this tree pinned to the other side')})")
    else:  # recorded before the block was pinned
        same = ("the NVFP4 step with mismatched block formats (MEASURED UNLIKE: that commit's library stores "
                "16x16-tile (2d) blocks, this tree's `nvfp4.block=auto` resolved to 1d blocks; not like-for-like)")
    return [
        f"Against commit {a['rev'][:10]} ({a['rev_subject']}): {same}, same model and "
        f"{a['devices']} devices, each tree in its own process, {a['rounds']} alternating rounds of "
        f"{a['steps_per_round']} steps (median of {n} per side; `benchmarks.against`).",
        "",
        f"| | commit {a['rev'][:10]} | this tree | this tree / {a['rev'][:10]} |",
        "|---|---:|---:|---:|",
        f"| step time | {_ms(a['step_time_s_rev'])} | {_ms(a['step_time_s_here'])} | **{_r(a['ratio'])}** "
        f"(target <= {a['target']}) |",
        "",
    ]


def _quantize_md(q: Dict[str, Any]) -> List[str]:
    r = q["result"]
    rows = [("quantize, 16x16 blocks", "quantize_16x16"), ("quantize, 1x16 blocks", "quantize_1x16"),
            ("dequantize to bf16", "dequantize_bf16")]
    lines = [
        "## 4. Quantize and dequantize throughput",
        "",
        f"Reproduce: {_cmd(q)}. {r['size'][0]}x{r['size'][1]} float32 on {r['device']} ({r['platform']}); "
        f"{_where(q['meta'])}.",
        "Baselines measured in the same run: `x * 2 + 1` (reads and writes float32, "
        f"{r['baseline_GBps']:.1f} GB/s), and a pass that reads and writes the same bytes as the op "
        f"(quantize-shaped: {r['same_bytes_quantize_GBps']:.1f} GB/s, dequantize-shaped: "
        f"{r['same_bytes_dequantize_GBps']:.1f} GB/s).",
        "",
        "| op | time | GB/s (read + write) | vs `x*2+1` (`x*2+1` time / op time) | vs same-bytes pass |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, k in rows:
        lines.append(f"| {label} | {_ms(r[k + '_s'])} | {r[k + '_GBps']:.1f} | {r[k + '_vs_elementwise']:.3f} | "
                     f"{r[k + '_vs_same_bytes']:.3f} |")
    lines.append("")
    return lines


def _convergence_md(c: Dict[str, Any]) -> List[str]:
    lines = [
        "## 5. Convergence",
        "",
        f"Reproduce: {_cmd(c)}. Model `{c['size']}`, {c['steps']} steps, data={c['data']}, "
        f"embedded Markov corpus; {_where(c['meta'])}.",
        f"Final loss = mean training loss of the last steps (`train.loop.run`). Entropy floor "
        f"{c['entropy_floor']:.4f} nats/token.",
        "",
        "| run | final loss | above floor | minus bf16 | median step |",
        "|---|---:|---:|---:|---:|",
    ]
    bf = c["runs"]["bf16"]["final_loss"]
    names = {"nvfp4": "NVFP4 weights (dequantized bf16 GEMMs)", "bf16": "bf16 weights (baseline)",
             "nvfp4_compute": "NVFP4 weights, `nvfp4.compute=nvfp4` (recipe GEMMs)"}
    for k, run in c["runs"].items():
        lines.append(f"| {names.get(k, k)} | {run['final_loss']:.4f} | {run['above_floor']:+.4f} | "
                     f"{run['final_loss'] - bf:+.4f} | {_ms(run['median_step_time_s'])} |")
    lines += ["", f"Target |NVFP4 - bf16| < {GAP_TARGET} nats: "
              f"{'met' if abs(c['gap_nvfp4_minus_bf16']) < GAP_TARGET else 'MISSED'} "
              f"({c['gap_nvfp4_minus_bf16']:+.4f}).", "", f"![convergence]({c['plot']})", ""]
    return lines


def _scaling_md(s: Dict[str, Any]) -> List[str]:
    lines = [
        "## 6. Scaling: figures 1-3 over model sizes and data-axis sizes",
        "",
        f"Reproduce: {_cmd(s)}. {_where(s['meta'])}. The global batch is fixed per model, so more "
        "devices means less work per device"
        + (" (on CPU the simulated devices share the same cores)." if s["meta"].get("platform") == "cpu" else "."),
        "",
        "| model | data | param gather NVFP4 | param gather bf16 | whole-model ratio | packed ratio, measured across runs "
        "| per-leaf layout ratio | grad reduce ratio "
        "| state NVFP4 | state bf16 | state ratio | temp ratio | step NVFP4 | step bf16 | step ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in s["points"]:
        n, b, r = p["nvfp4"], p["bf16"], p["ratios"]
        m = p["model"]
        lines.append(
            f"| {p['size']} (d={m['d_model']}, L={m['layers']}, {n['n_params'] / 1e6:.2f}M) | {p['data']} | "
            f"{_mb(n['gather']['param_gather_bytes'])} | {_mb(b['gather']['param_gather_bytes'])} | "
            f"{_r(r['model_gather'])} | {_r(packed_gather_measured(n, b)['ratio'], 4)} | {_r(r['leaf_gather'], 4)} | "
            f"{_r(r['grad_reduce'])} | "
            f"{_mb(n['memory']['total'])} | {_mb(b['memory']['total'])} | {_r(r['state_memory'])} | "
            f"{_r(r['temp_memory'])} | {_ms(n['step_time_s'])} | {_ms(b['step_time_s'])} | {_r(r['step_time'])} |")
    unchecked = leaf_unchecked({"scaling": s})
    lines += ["", "With data=1 nothing is gathered (ratios n/a)."
              + (f" At {', '.join(unchecked)} the bf16 run keeps weights replicated (plain leaves under "
                 "`Rules.min_shard_size`) that the NVFP4 run gathers packed, so the measured ratio is not of the "
                 "same weights and is not held to the target." if unchecked else ""),
              "", "![scaling](scaling.png)", ""]
    return lines


def _notes_md(res: Dict[str, Any]) -> List[str]:
    notes = [
        "## Notes",
        "",
        "- The bf16 baseline is the same training stack with `nvfp4.weights=bf16`: float32 masters, "
        "the same optimizer, bf16 params stored sharded over the data axis and all-gathered as "
        "16-bit words each step. Plain (bf16) leaves with fewer than 16384 elements "
        "(`Rules.min_shard_size`) stay replicated: they are not gathered, their master and "
        "optimizer state sit whole on every device, and their gradients are gathered whole. NVFP4 "
        "leaves are always sharded. This matters for the tiny model only (its attention kernels "
        "are 2x64x64).",
    ]
    pts = ([res[s]["point"] for s in ("traffic", "memory", "speed") if s in res]
           + res.get("scaling", {}).get("points", []))
    leaf = [(p, p["ratios"]["leaf_gather"]) for p in pts if p["ratios"]["leaf_gather"] is not None]
    below = sorted({f"{p['size']} data={p['data']} ({x:.5f})" for p, x in leaf if x < LEAF_LIMIT * (1 - 1e-9)})
    if leaf:
        notes.append(f"- The per-leaf layout ratio is {LEAF_LIMIT:.5f} ({LEAF_LIMIT_TEXT}) at every measured point"
                     + (f" but {', '.join(below)}, below it" if below else "") + ".")
    larger = sorted({f"{p['size']} data={p['data']} (+{100 * (p['nvfp4']['memory']['master'] / p['bf16']['memory']['master'] - 1):.1f}%)"
                     for p in pts if p["nvfp4"]["memory"]["master"] > p["bf16"]["memory"]["master"]})
    notes.append("- NVFP4 masters (and the optimizer state over them) are padded so each data shard holds whole "
                 "16x16 tiles: "
                 + (f"the NVFP4 run's float32 master is larger than the bf16 run's at {', '.join(larger)}."
                    if larger else "at every measured point the NVFP4 run's float32 master is no larger than the "
                    "bf16 run's."))
    point = next((res[s]["point"] for s in ("traffic", "memory", "speed") if s in res), None)
    if point is not None:
        ops = {w: ", ".join(sorted(point[w]["collectives_by_purpose"].get("grad reduce", {}))) or "nothing"
               for w in ("nvfp4", "bf16")}
        notes.append(f"- Gradient reduction ({_point_label(point)}) moves {ops['nvfp4']} with NVFP4 weights and "
                     f"{ops['bf16']} with bf16 weights. With `train.step`'s ordered reduction the "
                     "gradients travel as bits (all-to-all into the masters' layout, all-gather where a "
                     "master is replicated) and are summed on the device in a fixed order, so the bytes "
                     "are whole per-shard gradients, padded to the masters' 16x16 tiles; NVFP4 and bf16 "
                     "differ only where their masters are laid out differently.")
        rq = point["nvfp4"]["collectives_by_purpose"].get("re-quantize", {})
        if rq:
            what = {"all-reduce": "the global amax", "collective-permute": "packed tiles moved from the masters' "
                    "padded layout to the params' layout", "all-gather": "re-quantized shards gathered into "
                    "replicated params"}
            parts = [f"{od} ({what.get(od.split(':')[0], 'other')})" for od in sorted(rq)]
            notes.append(f"- Re-quantization with NVFP4 weights adds {_mb(sum(rq.values()))} per step "
                         f"({_point_label(point)}): {', '.join(parts)}.")
    return notes + [""]


def write(out_dir: str) -> Dict[str, Any]:
    """Render REPORT.md, HEADLINE.md and the plots from the JSON files in ``out_dir``."""
    res = load(out_dir)
    lines = [
        "# jax_nvfp4 benchmarks: NVFP4 weights vs bf16 weights, measured side by side",
        "",
        "Generated by `python -m benchmarks` (`benchmarks/report.py`); every NVFP4 figure is set against a "
        "bf16 baseline measured in the same run"
        + (" (section 3's step time against an earlier commit sets this tree's NVFP4 step against that "
           "commit's instead)" if res.get("speed", {}).get("against") else "")
        + ". Each section names the command that reproduces it.",
        "",
    ]
    misses = target_misses(res)
    lines += ["## Targets", ""]
    if misses:
        lines += [f"- **OUTSIDE TARGET**: {m}" for m in misses]
    else:
        lines.append(f"- All checked figures are within target (packed gather ratio measured across the runs "
                     f"<= {LEAF_TARGET}, state memory NVFP4/bf16 < 1, |convergence gap| < {GAP_TARGET} nats).")
    unchecked = leaf_unchecked(res)
    if unchecked:
        lines.append(f"- Packed gather ratio not checked at {', '.join(unchecked)}: the bf16 run keeps weights "
                     "replicated there that the NVFP4 run gathers (section 6).")
    lines.append("")
    if "traffic" in res:
        plot_traffic(res["traffic"]["point"], os.path.join(out_dir, "traffic.png"))
        lines += _traffic_md(res["traffic"])
    if "memory" in res:
        pts = [res["memory"]["point"]]
        if "scaling" in res:
            d = res["memory"]["point"]["data"]
            pts = [p for p in res["scaling"]["points"] if p["data"] == d] or pts
        plot_memory(pts, os.path.join(out_dir, "memory.png"))
        lines += _memory_md(res["memory"], res.get("scaling"))
    if "speed" in res:
        lines += _speed_md(res["speed"])
    if "quantize" in res:
        lines += _quantize_md(res["quantize"])
    if "convergence" in res:
        lines += _convergence_md(res["convergence"])
    if "scaling" in res:
        plot_scaling(res["scaling"]["points"], os.path.join(out_dir, "scaling.png"))
        lines += _scaling_md(res["scaling"])
    lines += _notes_md(res)
    with open(os.path.join(out_dir, "REPORT.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out_dir, "HEADLINE.md"), "w") as f:
        f.write(headline(res, report_path(out_dir)))
    return {"misses": misses, "sections": sorted(res)}


def report_path(out_dir: str) -> str:
    """Where ``out_dir``'s REPORT.md is, as a link from the repository root (where the README
    that includes HEADLINE.md is), or as given when it lies outside the repository."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.abspath(os.path.join(out_dir, "REPORT.md"))
    rel = os.path.relpath(path, root)
    return path if rel.startswith(os.pardir) else rel.replace(os.sep, "/")


def headline(res: Dict[str, Any], report_path: str = "benchmarks/results/REPORT.md") -> str:
    """A short Markdown table of the main ratios (included by the README); its last line
    points to ``report_path``, the report written with it."""
    rows = []
    meta = None
    t = res.get("traffic")
    if t:
        p, meta = t["point"], t["meta"]
        n, b, r = p["nvfp4"], p["bf16"], p["ratios"]
        rows.append((f"params all-gathered per step per device, whole model: NVFP4 run / bf16 run "
                     f"({p['size']} model, data={p['data']})",
                     _mb(n["gather"]["param_gather_bytes"]), _mb(b["gather"]["param_gather_bytes"]), _r(r["model_gather"])))
        pm = packed_gather_measured(n, b)
        rows.append((f"packed gather ratio, measured: the NVFP4 run's packed weight gathers / the bf16 run's "
                     f"gathers of the same weights (layout limit {LEAF_LIMIT_TEXT})", _mb(pm["packed_bytes"]),
                     _mb(pm["bf16_bytes"]), f"**{_r(pm['ratio'], 5)}**"))
        rows.append(("gradient reduction bytes per step", _mb(n["grad_reduce_bytes"]), _mb(b["grad_reduce_bytes"]),
                     _r(r["grad_reduce"])))
    m = res.get("memory")
    if m:
        p, meta = m["point"], meta or m["meta"]
        n, b, r = p["nvfp4"]["memory"], p["bf16"]["memory"], p["ratios"]
        rows.append(("training state per device (params + master + optimizer + grads)", _mb(n["total"]),
                     _mb(b["total"]), f"**{_r(r['state_memory'])}**"))
        rows.append(("params alone per device", _mb(n["params"]), _mb(b["params"]), _r(r["params_memory"])))
        rows.append(("step temporaries", _mb(n["compiled_temp"]), _mb(b["compiled_temp"]), _r(r["temp_memory"])))
    s = res.get("speed")
    if s:
        p, meta = s["point"], meta or s["meta"]
        load = s["meta"].get("load_avg_1m")
        rows.append((f"step time ({s['meta'].get('platform')}"
                     + (f", host load {load}; moves with load" if load is not None else "") + ")",
                     _ms(p["nvfp4"]["step_time_s"]),
                     _ms(p["bf16"]["step_time_s"]), _r(p["ratios"]["step_time"])))
    c = res.get("convergence")
    if c:
        meta = meta or c["meta"]
        rows.append((f"final loss after {c['steps']} steps ({c['size']} model; floor {c['entropy_floor']:.3f})",
                     f"{c['runs']['nvfp4']['final_loss']:.4f}", f"{c['runs']['bf16']['final_loss']:.4f}",
                     f"gap {c['gap_nvfp4_minus_bf16']:+.4f} nats"))
        if "nvfp4_compute" in c["runs"]:
            rows.append(("... with `nvfp4.compute=nvfp4` (recipe GEMMs)",
                         f"{c['runs']['nvfp4_compute']['final_loss']:.4f}", "",
                         f"gap {c['gap_nvfp4_compute_minus_bf16']:+.4f} nats"))
    q = res.get("quantize")
    if q:
        r = q["result"]
        meta = meta or q["meta"]
        rows.append((f"quantize 16x16 throughput ({r['size'][0]}^2 f32) vs a memory-bound pass over the same bytes",
                     f"{r['quantize_16x16_GBps']:.1f} GB/s", f"{r['same_bytes_quantize_GBps']:.1f} GB/s",
                     _r(r["quantize_16x16_vs_same_bytes"])))
    if not rows:
        return "No benchmark results yet: run `python -m benchmarks`.\n"
    out = ["| figure | NVFP4 | bf16 / baseline | ratio |", "|---|---:|---:|---:|"]
    out += [f"| {a} | {b} | {c_} | {d} |" for a, b, c_, d in rows]
    runs = {name: res[name]["meta"] for name in ("traffic", "memory", "speed", "convergence", "quantize") if res.get(name)}
    where = _where(meta)
    if len({(m.get("git_commit"), m.get("date")) for m in runs.values()}) > 1:  # sections run apart: each its own
        where = where.split(", commit ")[0] + ", its sections measured apart: " + "; ".join(
            f"{name} at commit {str(m.get('git_commit'))[:10]}{' (uncommitted changes)' if m.get('dirty') else ''}, "
            f"{m.get('date')}" + (f", host load {m['load_avg_1m']}" if m.get("load_avg_1m") is not None else "")
            for name, m in runs.items())
    out += ["", f"Measured by `python -m benchmarks` on {where}; details in [{report_path}]({report_path}).", ""]
    return "\n".join(out)


def main(argv=None) -> None:
    """``python -m benchmarks.report [DIR]``: re-render the report from the JSON files in DIR."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else os.path.join("benchmarks", "results")
    res = write(out)
    print(f"wrote {out}/REPORT.md and HEADLINE.md from {', '.join(res['sections']) or 'no results'}")
    for m in res["misses"]:
        print(f"OUTSIDE TARGET: {m}")


if __name__ == "__main__":
    main()
