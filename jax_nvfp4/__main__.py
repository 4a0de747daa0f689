"""``python -m jax_nvfp4``: a demo, or a check that JAX sees a GPU.

  python -m jax_nvfp4              quantize a 2048x2048 weight; print its error and bytes next to bf16
  python -m jax_nvfp4 --check-gpu  exit 0 if JAX runs on a GPU, else 1 with one line saying why
"""

import argparse
import os
import sys
import time

GPU_INSTALL = 'pip install -e ".[gpu]"'


def check_gpu() -> int:
    """0 and one line naming the GPUs when JAX's default backend is a GPU; else 1 and one line
    on stderr saying what JAX sees and how to install the CUDA build."""
    import jax

    try:
        backend = jax.default_backend()
        devices = jax.devices()
    except Exception as e:  # noqa: BLE001 - e.g. JAX_PLATFORMS=cuda with the CPU build of jaxlib
        first = (str(e).strip().splitlines() or [""])[0] or type(e).__name__
        platforms = os.environ.get("JAX_PLATFORMS")
        asked = f" for JAX_PLATFORMS={platforms}" if platforms else ""
        print(f"no GPU: JAX {jax.__version__} could not start a backend{asked} ({first}); install the CUDA build "
              f"with {GPU_INSTALL} (x86_64 and aarch64 Grace hosts), and check nvidia-smi", file=sys.stderr)
        return 1
    if backend != "gpu":
        print(f"no GPU: JAX {jax.__version__} runs on {backend} ({len(devices)} device(s)); install the CUDA build "
              f"with {GPU_INSTALL} (x86_64 and aarch64 Grace hosts), and check nvidia-smi", file=sys.stderr)
        return 1
    kinds = sorted({d.device_kind for d in devices})
    print(f"GPU ok: JAX {jax.__version__}, {len(devices)} local device(s): {', '.join(kinds)}")
    return 0


def demo() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_nvfp4 as nv

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_nvfp4", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__.splitlines()[0].strip("`").replace("``", ""),
                                epilog="Training: python -m train --help. Benchmarks: python -m benchmarks --help.")
    p.add_argument("--check-gpu", action="store_true",
                   help=f"exit 0 if JAX runs on a GPU, else 1 with one line (install: {GPU_INSTALL})")
    args = p.parse_args(argv)
    if args.check_gpu:
        return check_gpu()
    demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
