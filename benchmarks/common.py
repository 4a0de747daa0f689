"""Helpers shared by the benchmarks: timing, simulated devices, the compile cache, the commit."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from typing import Optional

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def request_cpu_devices(n: int):
    """Ask for ``n`` simulated CPU devices (unless XLA_FLAGS already sets a count) and return
    ``jax.devices()``. The count is fixed when the backend starts; if it already has, keep it."""
    from train.mesh import simulate_cpu_devices

    simulate_cpu_devices(n)
    return jax.devices()


def use_compile_cache(directory: str) -> None:
    """Keep every compiled program in ``directory``: runs that differ only in data or seed
    compile the same programs."""
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def git_commit() -> Optional[str]:
    """HEAD of the repository the benchmarks run from, or None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def median_time(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time in seconds of ``fn(*args)`` (already jitted), after warm-up runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
