"""Quantize / dequantize throughput as a ratio to memory-bound passes measured in the same run.

Two baselines, both jitted element-wise passes whose time is set by memory traffic:

- ``elementwise``: reads the float32 array and writes one of the same size (``x * 2 + 1``);
  ``*_vs_elementwise`` = baseline time / op time (1.0: the op runs as fast as that pass).
- ``same_bytes``: the fastest of a few trivial passes that read and write the same numbers of
  bytes as the op (quantize: read float32, write half a byte per value; dequantize: read half a
  byte per value, write bf16); ``*_vs_same_bytes`` = that pass's time / op time, i.e. the
  fraction of the memory-bound speed the op reaches on its own traffic.

Bandwidths (``*_GBps``) count bytes read + written. Run:
``python -m benchmarks.quantize [--size 4096]`` (or ``python -m benchmarks quantize``).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as nv
from benchmarks.common import median_time


def _quant_bytes(n: int, block) -> int:
    # read float32; write packed codes, one E4M3 scale byte per block and the float32 amax
    return 4 * n + n // 2 + n // (block[0] * block[1]) + 4


def run(size: int = 4096, repeats: int = 10) -> dict:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32)
    n = size * size
    elementwise = jax.jit(lambda a: a * 2 + 1)
    quant = {b: jax.jit(lambda a, b=b: nv.quantize(a, block=b)) for b in (nv.BLOCK_2D, nv.BLOCK_1D)}
    q2d = quant[nv.BLOCK_2D](x)
    deq = jax.jit(lambda q: nv.dequantize(q, jnp.bfloat16))
    # Same traffic as quantize (f32 in, a byte per two values out) and as dequantize (a byte
    # per two values in, bf16 out), trivial arithmetic; XLA compiles each shape differently
    # well, so the fastest candidate stands for the memory-bound time.
    same_q = {
        "strided_add": jax.jit(lambda a: (a[:, ::2] + a[:, 1::2]).astype(jnp.uint8)),
        "high_bytes": jax.jit(lambda a: (jax.lax.bitcast_convert_type(a[:, ::2], jnp.uint32) >> 24).astype(jnp.uint8)),
    }
    same_dq = {
        "repeat": jax.jit(lambda d: jnp.repeat(d, 2, axis=-1).astype(jnp.bfloat16)),
        "concat": jax.jit(lambda d: jnp.concatenate([d, d], -1).astype(jnp.bfloat16)),
        "widen": jax.jit(lambda d: d.astype(jnp.uint32) * np.uint32(0x01010101)),  # 4 bytes out per byte in
    }
    base = median_time(elementwise, x, repeats=repeats)
    out = {
        "size": [size, size],
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "baseline_elementwise_s": base,
        "baseline_GBps": 8 * n / base / 1e9,
    }
    name_q, t_same_q = min(((k, median_time(f, x, repeats=repeats)) for k, f in same_q.items()), key=lambda kv: kv[1])
    out["same_bytes_quantize_pass"] = name_q
    out["same_bytes_quantize_s"] = t_same_q
    out["same_bytes_quantize_GBps"] = (4 * n + n // 2) / t_same_q / 1e9
    for b, f in quant.items():
        t = median_time(f, x, repeats=repeats)
        name = f"quantize_{b[0]}x{b[1]}"
        out[f"{name}_s"] = t
        out[f"{name}_GBps"] = _quant_bytes(n, b) / t / 1e9
        out[f"{name}_vs_elementwise"] = base / t
        out[f"{name}_vs_same_bytes"] = t_same_q / t
    name_dq, t_same_dq = min(((k, median_time(f, q2d.data, repeats=repeats)) for k, f in same_dq.items()),
                             key=lambda kv: kv[1])
    out["same_bytes_dequantize_pass"] = name_dq
    out["same_bytes_dequantize_s"] = t_same_dq
    out["same_bytes_dequantize_GBps"] = (n // 2 + 2 * n) / t_same_dq / 1e9
    t = median_time(deq, q2d, repeats=repeats)
    out["dequantize_bf16_s"] = t
    out["dequantize_bf16_GBps"] = (n // 2 + n // 256 + 4 + 2 * n) / t / 1e9
    out["dequantize_bf16_vs_elementwise"] = base / t
    out["dequantize_bf16_vs_same_bytes"] = t_same_dq / t
    return out


def main(argv=None) -> None:
    from benchmarks import arguments as A

    p = A.Parser(prog="python -m benchmarks.quantize", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=A.positive_int, default=4096)
    p.add_argument("--repeats", type=A.positive_int, default=10)
    args = p.parse_args(argv)
    res = run(args.size, args.repeats)
    print(json.dumps(res, indent=2))
    for k, v in res.items():
        if k.endswith("_vs_elementwise"):
            print(f"{k}: {v:.3f}x the throughput of a memory-bound pass")
        elif k.endswith("_vs_same_bytes"):
            print(f"{k}: {v:.3f} of the speed of a memory-bound pass over the same bytes")


if __name__ == "__main__":
    main()
