"""Device check: packed all-gather dtypes, quantize bandwidth, and the GEMM backend.

Reports, for the default JAX device (GPU or CPU):

1. ``all_gather``: the compiled HLO of gathering a ``uint8`` array sharded ``P('data')`` over a
   1-D mesh of all local devices into a replicated one — every all-gather must move ``u8``
   (no f16/bf16/f32 widening); the same for a whole row-sharded ``NVFP4Array``. With one
   device the gather is a no-op and the HLO holds none.
2. ``bandwidth``: quantize (2D and 1D blocks) and dequantize throughput in GB/s of bytes
   read + written, as a fraction of a device-to-device copy (``x * 1``) measured in the same
   run, and of the H200's 4.8 TB/s specification (a labelled constant).
3. ``gemm``: the backend ``jax_nvfp4.gemm.dot(backend="auto")`` selects and, when native, the
   max abs difference from emulation on a 256x512 @ 512x256 fprop, dgrad and wgrad.

Run: ``python benchmarks/gpu_check.py [--size N] [--host-devices 8] [--json out.json]``.
Each section reports its own error instead of stopping the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _ROOT)

H200_SPEC_BYTES_PER_S = 4.8e12  # NVIDIA H200 HBM3e specification, 4.8 TB/s
_WIDE_FLOATS = ("f16", "bf16", "f32", "f64")


def _gathers(hlo: str):
    """``[("all-gather", [dtypes of its results])]`` for each all-gather instruction of compiled
    HLO text (read by ``jax_nvfp4.comm.parse``)."""
    import jax_nvfp4 as nv

    by_instruction = {}
    for c in nv.comm.parse(hlo).select(op="all-gather"):
        by_instruction.setdefault((c.computation, c.instruction), set()).add(c.dtype)
    return [("all-gather", sorted(d)) for d in by_instruction.values()]


def check_all_gather() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_nvfp4 as nv

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def gather_hlo(abstract, in_shardings):
        fn = jax.jit(lambda t: jax.lax.with_sharding_constraint(
            t, jax.tree.map(lambda _: replicated, t)), in_shardings=(in_shardings,),
            out_shardings=jax.tree.map(lambda _: replicated, abstract))
        return fn.lower(abstract).compile().as_text()

    rows, cols = 256 * n, 1024
    res = {"devices": n}
    u8 = jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8, sharding=sharded)
    g = _gathers(gather_hlo(u8, sharded))
    res["u8_gathers"] = [f"{op}:{'/'.join(d)}" for op, d in g]
    wide = [op for op, d in g if any(t in _WIDE_FLOATS for t in d)]
    res["u8_widened"] = bool(wide)

    # A whole quantized weight, rows sharded (16-row tiles stay whole per shard), leaf by leaf.
    q_abs = jax.eval_shape(nv.quantize, jax.ShapeDtypeStruct((rows, cols), jnp.float32))
    leaves = {}
    for path, a in jax.tree_util.tree_flatten_with_path(q_abs)[0]:
        sh = sharded if a.ndim >= 2 else replicated
        gl = _gathers(gather_hlo(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), sh))
        leaves[jax.tree_util.keystr(path)] = {
            "dtype": str(a.dtype), "sharded": a.ndim >= 2,
            "gathers": [f"{op}:{'/'.join(d)}" for op, d in gl],
            "widened": any(any(t in _WIDE_FLOATS for t in d) for _, d in gl),
        }
    res["nvfp4_leaves"] = leaves
    res["warnings"] = [f"NVFP4Array leaf {k} ({v['dtype']}) is gathered as {v['gathers']}"
                       for k, v in leaves.items() if v["widened"]]
    res["nvfp4_bytes_per_device_after_gather"] = int(
        sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(q_abs)))

    # Control: the same codes as a float4 array (what the packed u8 layout avoids).
    try:
        f4 = jax.ShapeDtypeStruct((rows, cols), jnp.float4_e2m1fn, sharding=sharded)
        res["float4_control_gathers"] = [f"{op}:{'/'.join(d)}" for op, d in _gathers(gather_hlo(f4, sharded))]
    except Exception as e:  # a backend without float4 collectives
        res["float4_control_gathers"] = f"unsupported: {type(e).__name__}: {str(e)[:200]}"

    if n == 1:
        res["note"] = "one device: the gather is a no-op (no all-gather in the HLO)"
    data_leaf = next((v for k, v in leaves.items() if "data" in k), {"widened": False})
    # The verdict is about the packed codes (the bulk of the bytes); other leaves warn.
    res["ok"] = not res["u8_widened"] and not data_leaf["widened"] and (n == 1 or bool(g))
    return res


def check_bandwidth(size: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_nvfp4 as nv
    from benchmarks.common import median_time

    x = jax.jit(lambda k: jax.random.normal(k, (size, size), jnp.float32))(jax.random.key(0))
    n = size * size
    copy = jax.jit(lambda a: a * 1)
    q2 = jax.jit(lambda a: nv.quantize(a, block=nv.BLOCK_2D))
    q1 = jax.jit(lambda a: nv.quantize(a, block=nv.BLOCK_1D))
    deq = jax.jit(lambda q: nv.dequantize(q, jnp.bfloat16))
    q2x = q2(x)

    def q_bytes(block):  # read f32, write packed codes + scales + amax
        return 4 * n + n // 2 + n // (block[0] * block[1]) + 4

    cases = {
        "copy_x*1": (copy, x, 8 * n),
        "quantize_2d": (q2, x, q_bytes(nv.BLOCK_2D)),
        "quantize_1d": (q1, x, q_bytes(nv.BLOCK_1D)),
        "dequantize_2d_to_bf16": (deq, q2x, n // 2 + n // 256 + 4 + 2 * n),
    }
    res = {"size": [size, size], "h200_spec_GBps": H200_SPEC_BYTES_PER_S / 1e9}
    for name, (fn, arg, nbytes) in cases.items():
        t = median_time(fn, arg, repeats=repeats)
        res[name] = {"s": t, "GBps": nbytes / t / 1e9}
    base = res["copy_x*1"]["GBps"]
    for name in cases:
        res[name]["fraction_of_copy"] = res[name]["GBps"] / base
        res[name]["fraction_of_h200_spec"] = res[name]["GBps"] * 1e9 / H200_SPEC_BYTES_PER_S
    return res


def check_gemm(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_nvfp4 as nv
    from jax_nvfp4 import gemm
    from benchmarks.common import median_time

    res = {"auto": gemm.resolve_backend("auto"), "te_import_error": gemm._te_import_error()}
    target = gemm.cuda_target()
    res["compute_capability"] = f"{target.capability[0]}.{target.capability[1]}" if target.source == "devices" else None
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 256)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
    wq = nv.quantize(w)

    def step(backend):
        @jax.jit
        def f(x_, wq_, w_, dy_):
            y, vjp = jax.vjp(lambda a, b: gemm.dot(a, wq_, b, backend=backend), x_, w_)
            return (y, *vjp(dy_))
        return f

    out = {}
    for b in sorted({"emulate", res["auto"]}):
        f = step(b)
        out[b] = [np.asarray(a, np.float64) for a in f(x, wq, w, dy)]
        res[f"{b}_fwd_bwd_s"] = median_time(f, x, wq, w, dy, repeats=repeats)
    if res["auto"] != "emulate":
        for i, name in enumerate(("fprop", "dgrad", "wgrad")):
            nat, emu = out[res["auto"]][i], out["emulate"][i]
            res[f"{name}_max_abs_diff"] = float(np.abs(nat - emu).max())
            res[f"{name}_max_rel_diff"] = float(np.abs(nat - emu).max() / np.abs(emu).max())
    else:
        res["note"] = "auto runs the emulation here; no native GEMM to compare"
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    res["fprop_rel_error_vs_float"] = float(np.linalg.norm(out["emulate"][0] - exact) / np.linalg.norm(exact))
    return res


def _section(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=4)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=None, help="square matrix side for bandwidth "
                   "(default 8192 on GPU, 2048 elsewhere)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--host-devices", type=int, default=None,
                   help="CPU only: simulate this many host devices (sets XLA_FLAGS before jax loads)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    if args.host_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}").strip()
    import jax

    dev = jax.devices()[0]
    size = args.size or (8192 if jax.default_backend() == "gpu" else 2048)
    report = {
        "platform": jax.default_backend(),
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
        "all_gather": _section(check_all_gather),
        "bandwidth": _section(check_bandwidth, size, args.repeats),
        "gemm": _section(check_gemm, args.repeats),
    }

    print(f"device: {report['device_kind']} ({report['platform']}), jax {report['jax']}")
    ag = report["all_gather"]
    if "error" in ag:
        print(f"[all-gather] ERROR {ag['error']}")
    else:
        print(f"[all-gather] {ag['devices']} device(s); u8 array gathers {ag['u8_gathers'] or 'none'}; "
              f"float4 control {ag['float4_control_gathers'] or 'none'}")
        for k, v in ag["nvfp4_leaves"].items():
            print(f"[all-gather] NVFP4Array{k}: {v['dtype']} {'sharded' if v['sharded'] else 'replicated'}, "
                  f"gathers {v['gathers'] or 'none'}")
        print(f"[all-gather] {'OK' if ag['ok'] else 'FAIL'}: packed data "
              f"{'moves as bytes' if ag['ok'] else 'is widened to a float type'}"
              + (f" ({ag['note']})" if "note" in ag else ""))
        for w in ag["warnings"]:
            print(f"[all-gather] WARNING {w}")
    bw = report["bandwidth"]
    if "error" in bw:
        print(f"[bandwidth] ERROR {bw['error']}")
    else:
        print(f"[bandwidth] {bw['size'][0]}x{bw['size'][1]} float32; H200 spec "
              f"{bw['h200_spec_GBps']:.0f} GB/s (labelled constant)")
        for name, v in bw.items():
            if isinstance(v, dict):
                print(f"[bandwidth] {name:24s} {v['GBps']:9.1f} GB/s  {v['fraction_of_copy']:6.3f} of copy  "
                      f"{v['fraction_of_h200_spec']:6.3f} of H200 spec  ({v['s'] * 1e3:.3f} ms)")
    gm = report["gemm"]
    if "error" in gm:
        print(f"[gemm] ERROR {gm['error']}")
    else:
        line = f"[gemm] auto -> {gm['auto']} (compute capability {gm['compute_capability']})"
        if "fprop_max_abs_diff" in gm:
            line += "; max |native - emulate|: " + ", ".join(
                f"{k} {gm[f'{k}_max_abs_diff']:.3e} (rel {gm[f'{k}_max_rel_diff']:.1e})"
                for k in ("fprop", "dgrad", "wgrad"))
        else:
            line += f"; {gm['note']}"
        print(line)
        print("[gemm] 256x512 @ 512x256 fwd+bwd: " + ", ".join(
            f"{k[:-len('_fwd_bwd_s')]} {v * 1e3:.3f} ms" for k, v in gm.items() if k.endswith("_fwd_bwd_s")))
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return report


if __name__ == "__main__":
    main()
