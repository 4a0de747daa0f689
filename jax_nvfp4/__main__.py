"""Demo: quantize a realistic weight tensor and print its error and bytes next to bf16."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as nv


def main() -> None:
    rng = np.random.default_rng(0)
    # A transformer-like weight: Gaussian init plus a few outlier columns, as trained weights have.
    w = rng.standard_normal((2048, 2048)).astype(np.float32) * 0.02
    w[:, rng.choice(2048, 16, replace=False)] *= 20
    w = jnp.asarray(w)
    q = jax.jit(nv.quantize)(w)
    jax.block_until_ready(q)
    t0 = time.perf_counter()
    q = jax.block_until_ready(jax.jit(nv.quantize)(w))
    dt = time.perf_counter() - t0
    for name, approx in (("nvfp4", nv.dequantize(q, jnp.float32)), ("bf16", w.astype(jnp.bfloat16).astype(jnp.float32))):
        err = approx - w
        rel = float(jnp.linalg.norm(err) / jnp.linalg.norm(w))
        nbytes = q.nbytes if name == "nvfp4" else w.size * 2
        print(f"{name:6s} bytes={nbytes:>10,d} ({nbytes / (w.size * 2):.4f} of bf16)  rel. error={rel:.4%}  max abs err={float(jnp.abs(err).max()):.3e}")
    print(f"quantize 2048x2048: {dt * 1e3:.1f} ms on {jax.devices()[0].platform}")


if __name__ == "__main__":
    main()
