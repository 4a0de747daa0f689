"""XLA flags that let a GPU overlap the FSDP step's communication with its compute.

The step gathers each layer's packed weights inside the scan over layers and sums each layer's
weight gradient on the way back (``jax_nvfp4.gather_weight``). Without these flags XLA:GPU
runs those collectives where the program puts them, so every layer waits for its own gather.
MaxText and NVIDIA's JAX containers set the same flags for FSDP on GPUs; every name below is
a flag of the XLA that ships with jaxlib (an unknown name in ``XLA_FLAGS`` aborts the process:
``tests/test_xla_flags.py`` starts one with all of them).

``python -m train`` adds them to ``XLA_FLAGS`` before JAX starts, when the run is headed for a
GPU (``JAX_PLATFORMS`` names ``cuda``/``gpu``, or is unset with JAX's CUDA plugin installed);
they are options of the GPU compiler, which the CPU compiler never reads. A flag already in
``XLA_FLAGS`` keeps its value (override one there); ``train.gpu_xla_flags=false`` adds none.
``python -m train.xla_flags`` prints ``XLA_FLAGS`` with them added (``scripts/slurm_gb200.sbatch``
exports that, so the job's log shows what every process compiles with).

This module does not import JAX: it runs before the backend starts.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Mapping, MutableMapping, Sequence, Tuple

# One layer's packed NVFP4 weights (codes and scale bytes of its 7 matrices, 0.5625 bytes a
# value) are 123 MB for Llama 3 8B and 490 MB for 70B: a layer's gathers combine into one
# collective (8B) or a few (70B) of at most this size each.
COMBINE_BYTES = 128 << 20

# (flag, value, why): the flags python -m train sets on GPU.
GPU_FLAGS: Tuple[Tuple[str, str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "schedule each asynchronous collective (a layer's weight gather, its gradient all-to-all) "
     "to overlap with compute that does not depend on it, instead of in program order"),
    ("xla_gpu_enable_pipelined_all_gather", "true",
     "move the weight all-gather of the next iteration of the scan over layers into this one: "
     "layer i+1's packed bytes arrive while layer i computes (FSDP prefetch)"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true",
     "finish an iteration's reduce-scatters in the next one: XLA's own reduce-scatters, e.g. of "
     "tensor-parallel activations with the sequence-split residual (the data-axis gradient sum "
     "is an all-to-all of bits followed by an ordered sum, which this does not move)"),
    ("xla_gpu_enable_while_loop_double_buffering", "true",
     "unroll the scan over layers by two, so that a pipelined gather writes a buffer the running "
     "layer does not read; costs one more layer's gathered weights"),
    ("xla_gpu_all_gather_combine_threshold_bytes", str(COMBINE_BYTES),
     "combine a layer's weight gathers (codes and scales of every matrix) into few collectives: "
     "one launch and one synchronisation instead of one per array"),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(COMBINE_BYTES),
     "the same for XLA's reduce-scatters"),
)

_PLATFORMS_ENV = "JAX_PLATFORMS"
# JAX's CUDA plugins (jax[cuda13], jax[cuda12]).
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _flag_names(xla_flags: str) -> set:
    return set(re.findall(r"--([A-Za-z0-9_]+)", xla_flags or ""))


def with_gpu_flags(xla_flags: str, flags: Sequence[Tuple[str, str, str]] = GPU_FLAGS) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with every flag of ``flags`` that it does not
    already name appended: a flag given there keeps its value."""
    present = _flag_names(xla_flags)
    added = [f"--{name}={value}" for name, value, _ in flags if name not in present]
    return " ".join([xla_flags.strip(), *added]).strip() if added else (xla_flags or "").strip()


def _has_cuda_plugin() -> bool:
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def headed_for_gpu(environ: Mapping[str, str] = os.environ, has_cuda_plugin=_has_cuda_plugin) -> bool:
    """Whether JAX will start on a GPU, as far as can be told before it starts:
    ``JAX_PLATFORMS`` names ``cuda`` or ``gpu``, or is unset and a CUDA plugin is installed
    (JAX then prefers the GPU)."""
    platforms = environ.get(_PLATFORMS_ENV, "").strip()
    if platforms:
        return any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    return has_cuda_plugin()


def configure(enabled: bool = True, environ: MutableMapping[str, str] = os.environ, has_cuda_plugin=_has_cuda_plugin) -> list:
    """Add :data:`GPU_FLAGS` to ``environ["XLA_FLAGS"]`` when ``enabled`` and the process is
    headed for a GPU; call it before JAX starts its backend. Returns the flags added."""
    if not enabled or not headed_for_gpu(environ, has_cuda_plugin):
        return []
    before = environ.get("XLA_FLAGS", "")
    after = with_gpu_flags(before)
    environ["XLA_FLAGS"] = after
    return sorted(_flag_names(after) - _flag_names(before))


def main(argv=None) -> int:
    """``python -m train.xla_flags``: print ``$XLA_FLAGS`` with :data:`GPU_FLAGS` added
    (``--explain``: one line per flag with why it is there)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--explain" in argv:
        for name, value, why in GPU_FLAGS:
            print(f"--{name}={value}: {why}")
        return 0
    print(with_gpu_flags(os.environ.get("XLA_FLAGS", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
