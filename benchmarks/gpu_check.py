"""``python -m benchmarks gpu``: validate a GPU machine end to end, in one table and one JSON.

On this process's GPUs (all local ones; one will do, in under 8 minutes):

1. ``quantize``: ``nv.quantize`` (16x16 tiles, 1x16 and 16x1 blocks, stochastic rounding) and
   ``nv.dequantize`` on the GPU, byte for byte against the same calls on the host CPU (the CPU
   path is bit-exact with the NumPy reference of the tests); the input has no subnormals,
   which XLA:CPU flushes to zero.
2. ``throughput``: quantize and dequantize bandwidth against memory-bound passes over the same
   bytes (:mod:`benchmarks.quantize`).
3. ``all_gather``: a packed ``uint8`` array and every leaf of a row-sharded ``NVFP4Array``
   all-gathered over the local GPUs: the compiled HLO must move ``u8`` (no widening).
4. ``gemm``: the recipe GEMM this GPU runs (``nv.dot(backend="auto")``: ``scaled_matmul`` on
   Blackwell, the emulation where there is no FP4 GEMM, e.g. Hopper, sm_90), the block-scaled
   calls read from its compiled program, and its fprop, dgrad and wgrad against the emulation.
5. ``steps``: the default job's model and a 1.1B-parameter Llama (``benchmarks.train_step``
   sizes ``default`` and ``1b``), NVFP4 weights and bf16 weights side by side: the compiled
   step's peak memory (XLA's arguments + temporaries + outputs - aliased), median step time,
   the dtypes of its weight all-gathers (u8 for NVFP4 weights), whether its attention is
   cuDNN's fused kernel, and a finite loss.

The XLA flags for overlap (``jax_nvfp4/xla_flags.py``) are set first, as
``python -m train`` sets them. Each section reports its own error instead of stopping the run.
Without a GPU: one line on stderr, exit 1; a failed check: exit 3. ``--cpu`` runs the same
sections on the CPU (a smoke test of this command, not a GPU validation).

Run: ``python -m benchmarks gpu [--json runs/gpu_check.json] [--models default,1b]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _ROOT)

DEFAULT_JSON = os.path.join("runs", "gpu_check.json")
MODELS = ("default", "1b")
_WIDE_FLOATS = ("f16", "bf16", "f32", "f64")
# cuDNN's fused attention kernels are custom calls whose targets start with this.
CUDNN_ATTENTION = "__cudnn$fmha"


def _gathers(hlo: str):
    """``[sorted dtypes]`` of each all-gather instruction of compiled HLO text."""
    import jax_nvfp4 as nv

    by_instruction = {}
    for c in nv.comm.parse(hlo).select(op="all-gather"):
        by_instruction.setdefault((c.computation, c.instruction), set()).add(c.dtype)
    return [sorted(d) for d in by_instruction.values()]


# ----------------------------------------------------------------------------- 1. quantize
def check_quantize(size: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_nvfp4 as nv

    rng = np.random.default_rng(0)
    # A trained-weight-like matrix: Gaussian with a few outlier columns; no subnormals.
    x = (rng.standard_normal((size, size)) * 0.02).astype(np.float32)
    x[:, rng.choice(size, 16, replace=False)] *= 20
    here, cpu = jax.devices()[0], jax.devices("cpu")[0]
    cases = {
        "16x16": dict(block=nv.BLOCK_2D),
        "1x16": dict(block=nv.BLOCK_1D),
        "16x1": dict(block=nv.array.BLOCK_COLUMN),
        "16x16 stochastic": dict(block=nv.BLOCK_2D, rounding="stochastic"),
    }

    def run(device, kw):
        key = jax.device_put(jax.random.key(7), device) if kw.get("rounding") == "stochastic" else None
        fn = jax.jit(lambda a, k: (lambda q: (q, nv.dequantize(q, jnp.bfloat16)))(
            nv.quantize(a, **kw, **({"key": k} if k is not None else {}))))
        out = fn(jax.device_put(x, device), key)
        return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(out)]

    res = {"size": [size, size], "device": str(here), "reference": str(cpu), "cases": {}}
    for name, kw in cases.items():
        a, b = run(here, kw), run(cpu, kw)
        res["cases"][name] = {"identical": a == b, "leaves_differing": sum(p != q for p, q in zip(a, b))}
    res["ok"] = all(c["identical"] for c in res["cases"].values())
    return res


# ----------------------------------------------------------------------------- 3. all-gather
def check_all_gather() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_nvfp4 as nv

    devices = jax.local_devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def gather_hlo(abstract, in_shardings):
        fn = jax.jit(lambda t: jax.lax.with_sharding_constraint(t, jax.tree.map(lambda _: replicated, t)),
                     in_shardings=(in_shardings,), out_shardings=jax.tree.map(lambda _: replicated, abstract))
        return fn.lower(abstract).compile().as_text()

    rows, cols = 256 * n, 1024
    res = {"devices": n}
    u8 = jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8, sharding=sharded)
    res["u8_array"] = ["/".join(d) for d in _gathers(gather_hlo(u8, sharded))]
    q_abs = jax.eval_shape(nv.quantize, jax.ShapeDtypeStruct((rows, cols), jnp.float32))
    leaves = {}
    for path, a in jax.tree_util.tree_flatten_with_path(q_abs)[0]:
        sh = sharded if a.ndim >= 2 else replicated
        leaves[jax.tree_util.keystr(path)] = ["/".join(d) for d in
                                              _gathers(gather_hlo(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), sh))]
    res["nvfp4_leaves"] = leaves
    moved = [d for ds in (res["u8_array"], *leaves.values()) for d in ds]
    res["widened"] = sorted({d for d in moved if any(t in _WIDE_FLOATS for t in d.split("/"))})
    res["ok"] = not res["widened"] and (n == 1 or bool(res["u8_array"]))
    if n == 1:
        res["note"] = "one device: nothing to gather"
    return res


# ----------------------------------------------------------------------------- 4. GEMM
def check_gemm(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_nvfp4 as nv
    from benchmarks.common import median_time
    from jax_nvfp4 import gemm

    platform = gemm.default_platform()
    res = {"platform": platform, "auto": gemm.resolve_backend("auto"), "te_import_error": gemm.te_import_error()}
    if platform == "cuda":
        res["cuda_target"] = str(gemm.cuda_target())
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 256)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
    wq = nv.quantize(w)

    def step(backend):
        def f(x_, wq_, w_, dy_):
            y, vjp = jax.vjp(lambda a, b: gemm.dot(a, wq_, b, backend=backend), x_, w_)
            return (y, *vjp(dy_))
        return jax.jit(f)

    out = {}
    for b in ("emulate", "auto"):
        f = step(b)
        out[b] = [np.asarray(a, np.float64) for a in f(x, wq, w, dy)]
        res[f"{b}_fwd_bwd_s"] = median_time(f, x, wq, w, dy, repeats=repeats)
        if b == "auto":  # what the compiled program calls, not what was asked for
            native = nv.comm.native_gemms(f.lower(x, wq, w, dy).compile().as_text())
            res["native_gemm_calls"] = sum(g.times for g in native)
            res["native_gemm_targets"] = sorted({g.target for g in native})
    for i, name in enumerate(("fprop", "dgrad", "wgrad")):
        got, emu = out["auto"][i], out["emulate"][i]
        res[f"{name}_max_rel_diff"] = float(np.abs(got - emu).max() / np.abs(emu).max())
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    res["fprop_rel_error_vs_float"] = float(np.linalg.norm(out["emulate"][0] - exact) / np.linalg.norm(exact))
    native = res["auto"] != "emulate"
    # Native GEMMs accumulate in another order than the emulation's float32 dot: close, not equal.
    res["ok"] = (res["native_gemm_calls"] == 3 if native else res["native_gemm_calls"] == 0) and all(
        res[f"{k}_max_rel_diff"] < (1e-3 if native else 1e-6) for k in ("fprop", "dgrad", "wgrad"))
    return res


# ----------------------------------------------------------------------------- 5. steps
def check_steps(model: str, time_steps: int) -> dict:
    import jax

    from benchmarks import train_step as ts

    devices = jax.local_devices()
    n = len(devices)
    base = ts.size_config(model, "nvfp4")
    # The model's batch per device at least, on however many GPUs there are.
    batch = math.ceil(base.data.batch_size / n) * n
    pair = ts.measure_pair(model, n, devices, time_steps=time_steps, extra=[f"data.batch_size={batch}"],
                           log=lambda msg: print(msg, flush=True))
    res = {"model": pair["model"], "devices": n, "n_params": pair["nvfp4"]["n_params"]}
    for weights in ("nvfp4", "bf16"):
        r = pair[weights]
        mem = r["memory"]
        parts = [mem.get(f"compiled_{k}") for k in ("argument", "temp", "output", "alias")]
        peak = None if None in parts else parts[0] + parts[1] + parts[2] - parts[3]
        gathers = sorted({k.split(":")[1] for k in r["collectives_by_purpose"].get("weight gather", {})})
        calls = r["custom_calls"]
        res[weights] = {
            "step_time_s": r["step_time_s"],
            "peak_bytes": peak,
            "state_bytes": mem["total"],
            "weight_gather_dtypes": gathers,
            "nvfp4_gather_bytes": r["gather"]["nvfp4_gather_bytes"],
            "cudnn_attention_calls": sum(v for k, v in calls.items() if k.startswith(CUDNN_ATTENTION)),
            "custom_calls": calls,
            "loss_after_steps": r["loss_after_steps"],
            "build_compile_s": r["build_compile_s"],
        }
    res["ratios"] = {"step_time": pair["ratios"]["step_time"],
                     "peak": (res["nvfp4"]["peak_bytes"] / res["bf16"]["peak_bytes"]
                              if res["nvfp4"]["peak_bytes"] and res["bf16"]["peak_bytes"] else None)}
    nv4 = res["nvfp4"]
    packed_ok = n == 1 or (nv4["nvfp4_gather_bytes"] > 0 and not set(nv4["weight_gather_dtypes"]) - {"u8", "u16"})
    res["ok"] = bool(packed_ok and all(res[w]["loss_after_steps"] is not None and math.isfinite(res[w]["loss_after_steps"])
                                       for w in ("nvfp4", "bf16")))
    return res


# ----------------------------------------------------------------------------- the report
def _section(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a first run on new hardware reports, not stops
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6), "ok": False}


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.1f} MiB"


def _ms(s) -> str:
    return "n/a" if s is None else f"{s * 1e3:.1f} ms"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _ratio(r) -> str:
    return "n/a" if r is None else f"{r:.3f}"


def table(report: dict) -> str:
    """The report as one Markdown table: check, result, detail."""
    rows = [("device", f"{report['device_kind']} x {report['devices']} ({report['platform']})",
             f"jax {report['jax']}; XLA flags for overlap added: {len(report['xla_flags_added'])}")]

    def failed(sec):
        return sec.get("error")

    q = report["quantize"]
    rows.append(("quantize vs CPU", failed(q) or ("bit-identical" if q["ok"] else "DIFFERS"),
                 "" if failed(q) else f"{q['size'][0]}^2: " + ", ".join(
                     f"{k} {'same' if v['identical'] else 'DIFFERENT'}" for k, v in q["cases"].items())))
    t = report["throughput"]
    rows.append(("quantize throughput", failed(t) or f"{t['quantize_16x16_GBps']:.0f} GB/s",
                 "" if failed(t) else f"16x16 {t['quantize_16x16_vs_same_bytes']:.2f}, dequantize "
                 f"{t['dequantize_bf16_vs_same_bytes']:.2f} of a memory-bound pass over the same bytes"))
    g = report["all_gather"]
    rows.append(("packed all-gather", failed(g) or (g.get("note") or ("u8" if g["ok"] else f"WIDENED {g['widened']}")),
                 "" if failed(g) else f"{g['devices']} device(s); uint8 array: {g['u8_array'] or 'no all-gather'}"))
    m = report["gemm"]
    if failed(m):
        rows.append(("recipe GEMM", failed(m), ""))
    else:
        what = "native " + m["auto"] if m["auto"] != "emulate" else "emulated"
        rows.append(("recipe GEMM", f"{what} ({m['native_gemm_calls']} block-scaled calls)",
                     f"{m.get('cuda_target', m['platform'])}; largest difference from the emulation, relative: " + ", ".join(
                         f"{k} {m[f'{k}_max_rel_diff']:.1e}" for k in ("fprop", "dgrad", "wgrad"))))
    for name, s in report["steps"].items():
        if failed(s):
            rows.append((f"{name} step", failed(s), ""))
            continue
        n4, b16 = s["nvfp4"], s["bf16"]
        attn = "cuDNN attention" if n4["cudnn_attention_calls"] else "XLA attention"
        rows.append((f"{name} step ({_count(s['n_params'])} params, {s['devices']} device(s))",
                     f"NVFP4 {_ms(n4['step_time_s'])} / bf16 {_ms(b16['step_time_s'])} = {_ratio(s['ratios']['step_time'])}",
                     f"peak NVFP4 {_mb(n4['peak_bytes'])} / bf16 {_mb(b16['peak_bytes'])} = {_ratio(s['ratios']['peak'])}; "
                     f"weight gathers {'/'.join(n4['weight_gather_dtypes']) or 'none (one device)'}; {attn}; "
                     f"loss {n4['loss_after_steps']:.3f} / {b16['loss_after_steps']:.3f}"))
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def parse_args(argv):
    """The command's arguments; a bad one is one line on stderr and exit 2 before anything
    runs (:mod:`benchmarks.arguments`)."""
    from benchmarks import arguments as A
    from benchmarks import train_step as ts

    p = A.Parser(prog="python -m benchmarks gpu", description=__doc__.splitlines()[0].strip("`"),
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--json", default=DEFAULT_JSON, type=A.output_file,
                   help=f"write the report here (default {DEFAULT_JSON})")
    p.add_argument("--models", default=",".join(MODELS), type=A.name_list(list(ts.SIZES), "model size"),
                   help=f"model sizes of benchmarks.train_step to step (default {','.join(MODELS)})")
    p.add_argument("--steps", type=A.positive_int, default=5, help="timed steps per model and weight format (default 5)")
    p.add_argument("--size", type=A.positive_int, default=None, help="square side for quantize (default 8192; --cpu 256)")
    p.add_argument("--repeats", type=A.positive_int, default=10, help="timed calls of quantize and the GEMMs (default 10)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU: a smoke test of this command, no GPU figures")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    models = args.models
    # Before JAX starts its backend: the flags python -m train runs with on a GPU.
    from jax_nvfp4 import xla_flags

    added = xla_flags.configure()
    if not args.cpu:
        from jax_nvfp4.__main__ import check_gpu

        if check_gpu() != 0:  # one line on stderr
            return 1
    import jax

    from benchmarks import quantize

    t0 = time.perf_counter()
    size = args.size or (256 if args.cpu else 8192)
    dev = jax.local_devices()[0]
    report = {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "devices": len(jax.local_devices()),
        "jax": jax.__version__,
        "xla_flags_added": added,
        "quantize": _section(check_quantize, size),
        "throughput": _section(quantize.run, size, args.repeats),
        "all_gather": _section(check_all_gather),
        "gemm": _section(check_gemm, args.repeats),
        "steps": {m: _section(check_steps, m, args.steps) for m in models},
    }
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    checks = [report[k] for k in ("quantize", "all_gather", "gemm")] + list(report["steps"].values())
    report["ok"] = all(c.get("ok") for c in checks) and "error" not in report["throughput"]
    print(table(report))
    print(f"{'all checks passed' if report['ok'] else 'FAILED: see the table'}; {report['wall_s']:.0f} s; "
          f"JSON: {args.json}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    return 0 if report["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
