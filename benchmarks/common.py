"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time

import jax


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
