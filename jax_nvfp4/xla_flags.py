"""XLA:GPU flags that overlap the sharded step's per-layer weight gathers and gradient sums with
compute (:func:`jax_nvfp4.make_step`). XLA reads ``XLA_FLAGS`` once, when its backend starts, so
:func:`configure` must run before the first device is touched (importing JAX is fine); this module
does not import JAX. Each name must be a flag of jaxlib's XLA: an unknown one aborts the process.

``python -m jax_nvfp4.xla_flags`` prints ``$XLA_FLAGS`` with :data:`GPU_FLAGS` added (for a job
script: ``export XLA_FLAGS="$(python -m jax_nvfp4.xla_flags)"``); ``--explain`` prints one line
per flag with its reason."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import List, Mapping, MutableMapping, Optional, Sequence, Set, Tuple

__all__ = ["COMBINE_BYTES", "GPU_FLAGS", "configure", "headed_for_gpu", "main", "with_gpu_flags"]

# A layer's packed weights are 123 MB (Llama 3 8B) or 490 MB (70B): one collective or a few this size.
COMBINE_BYTES = 128 << 20

# (flag, value, why): the flags :func:`configure` adds on GPU.
GPU_FLAGS: Tuple[Tuple[str, str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "schedule each asynchronous collective (a layer's weight gather, its gradient all-to-all) to overlap with "
     "compute that does not depend on it, instead of in program order"),
    ("xla_gpu_enable_pipelined_all_gather", "true",
     "move the weight all-gather of the next iteration of the scan over layers into this one: layer i+1's packed "
     "bytes arrive while layer i computes (FSDP prefetch)"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true",
     "finish an iteration's reduce-scatters in the next one: XLA's own reduce-scatters, e.g. of tensor-parallel "
     "activations with the sequence-split residual (the data-axis gradient sum is an all-to-all of bits followed by "
     "an ordered sum, which this does not move)"),
    ("xla_gpu_enable_while_loop_double_buffering", "true",
     "unroll the scan over layers by two, so that a pipelined gather writes a buffer the running layer does not "
     "read; costs one more layer's gathered weights"),
    ("xla_gpu_all_gather_combine_threshold_bytes", str(COMBINE_BYTES),
     "combine a layer's weight gathers (codes and scales of every matrix) into few collectives: one launch and one "
     "synchronisation instead of one per array"),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(COMBINE_BYTES), "the same for XLA's reduce-scatters"),
)


def _flag_names(xla_flags: str) -> Set[str]:
    return set(re.findall(r"--([A-Za-z0-9_]+)", xla_flags or ""))


def with_gpu_flags(xla_flags: str, flags: Sequence[Tuple[str, str, str]] = GPU_FLAGS) -> str:
    """``xla_flags`` with each flag of ``flags`` it does not name appended (a flag given keeps its value)."""
    present = _flag_names(xla_flags)
    added = [f"--{name}={value}" for name, value, _ in flags if name not in present]
    return " ".join([xla_flags.strip(), *added]).strip() if added else (xla_flags or "").strip()


def _has_cuda_plugin() -> bool:
    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):  # jax[cuda13], jax[cuda12]
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def headed_for_gpu(environ: Mapping[str, str] = os.environ) -> bool:
    """``environ``'s ``JAX_PLATFORMS`` names ``cuda`` or ``gpu``, or is unset and a CUDA plugin is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    return _has_cuda_plugin()


def configure(enabled: bool = True, environ: MutableMapping[str, str] = os.environ) -> List[str]:
    """Add :data:`GPU_FLAGS` to ``environ["XLA_FLAGS"]`` (default: this process's) when ``enabled`` and
    headed for a GPU (call before JAX starts its backend). Returns the names added, sorted."""
    if not enabled or not headed_for_gpu(environ):
        return []
    before = environ.get("XLA_FLAGS", "")
    environ["XLA_FLAGS"] = after = with_gpu_flags(before)
    return sorted(_flag_names(after) - _flag_names(before))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print ``$XLA_FLAGS`` with :data:`GPU_FLAGS` added; ``--explain``: one line per flag with its reason."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m jax_nvfp4.xla_flags", description=main.__doc__.split(";")[0] + ".")
    p.add_argument("--explain", action="store_true", help="one line per flag with the reason for it")
    if p.parse_args(argv).explain:
        print("\n".join(f"--{name}={value}: {why}" for name, value, why in GPU_FLAGS))
    else:
        print(with_gpu_flags(os.environ.get("XLA_FLAGS", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
