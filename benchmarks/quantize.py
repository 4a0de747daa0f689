"""Quantize / dequantize throughput as a ratio to a memory-bound elementwise pass.

The baseline reads the same float32 array and writes an array of the same size
(``x * 2 + 1``), measured in the same run; a ratio of 1.0 means quantization runs at the
speed of memory traffic. Run: ``python -m benchmarks.quantize [--size 4096]``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as nv
from benchmarks.common import median_time


def run(size: int = 4096, repeats: int = 10) -> dict:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32)
    elementwise = jax.jit(lambda a: a * 2 + 1)
    quant = {b: jax.jit(lambda a, b=b: nv.quantize(a, block=b)) for b in (nv.BLOCK_2D, nv.BLOCK_1D)}
    q2d = quant[nv.BLOCK_2D](x)
    deq = jax.jit(lambda q: nv.dequantize(q, jnp.bfloat16))
    base = median_time(elementwise, x, repeats=repeats)
    gb = x.nbytes * 2 / 1e9  # read + write of the baseline
    out = {
        "size": [size, size],
        "device": jax.devices()[0].device_kind,
        "baseline_elementwise_s": base,
        "baseline_GBps": gb / base,
    }
    for b, f in quant.items():
        t = median_time(f, x, repeats=repeats)
        out[f"quantize_{b[0]}x{b[1]}_s"] = t
        out[f"quantize_{b[0]}x{b[1]}_vs_elementwise"] = base / t
    t = median_time(deq, q2d, repeats=repeats)
    out["dequantize_bf16_s"] = t
    out["dequantize_bf16_vs_elementwise"] = base / t
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    res = run(args.size, args.repeats)
    print(json.dumps(res, indent=2))
    for k, v in res.items():
        if k.endswith("_vs_elementwise"):
            print(f"{k}: {v:.3f}x the throughput of a memory-bound pass")


if __name__ == "__main__":
    main()
