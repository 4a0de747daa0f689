"""Helpers shared by the benchmarks: timing, simulated devices, the compile cache, the commit."""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import statistics
import subprocess
import time
from typing import Any, Dict, Optional

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def request_cpu_devices(n: int):
    """Ask for ``n`` simulated CPU devices (unless XLA_FLAGS already sets a count) and return
    ``jax.devices()``. The count is fixed when the backend starts; if it already has, keep it."""
    from jax_nvfp4.mesh import simulate_cpu_devices

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


# What a run's numbers depend on besides its config (its overrides, recorded with it): the
# library and the stack, configs included.
SOURCES = ("jax_nvfp4/**/*.py", "train/**/*.py", "train/configs/*")


@functools.cache
def source_state() -> Dict[str, Any]:
    """The sources this process trains with: the sha256 over :data:`SOURCES` (path and bytes),
    taken once, at its first run, so that a file edited while a worker runs does not relabel
    what that worker already imported; the git commit and whether those files differed from it
    (``dirty``). Runs whose ``sha256`` differ were trained by different code."""
    h = hashlib.sha256()
    files = sorted({f for pat in SOURCES for f in glob.glob(os.path.join(ROOT, pat), recursive=True)})
    for f in files:
        h.update(os.path.relpath(f, ROOT).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", "jax_nvfp4", "train"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        status = None
    return {"sha256": h.hexdigest(), "git_commit": git_commit(), "dirty": None if status is None else bool(status)}
