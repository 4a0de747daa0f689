"""What the test modules share: the simulated devices, one XLA compile cache for the whole run,
the repository's paths, the tiny job and ways to run the CLI."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

# The suite compiles a few hundred small programs and runs each for a few steps: its time is
# XLA compile time. The tests' programs compile with LLVM's -O0 and XLA's previous CPU fusion
# emitters, in half the time of the defaults, and in one piece: LLVM's code generation is not
# split into parallel parts (the tests' processes keep every core busy already; splitting cost
# 17% more CPU time for the tiny job's init and step programs). Numerics: the quantization kernels are
# elementwise and bit-exact under any setting (the tests against the NumPy reference and
# Transformer Engine's cases run under these); float reductions and multiply-adds may round
# differently from the default -O2 (the tiny job's losses differ in their last bits), so the
# bit-identity tests compare runs compiled the same way, as everywhere. Subprocesses that set
# their own XLA_FLAGS take them from :func:`xla_flags`.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")


def xla_flags(devices=None):
    """XLA_FLAGS for a test process: ``devices`` simulated CPU devices (None: no count) and
    :data:`TEST_XLA_FLAGS`."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return count + TEST_XLA_FLAGS


# Multi-device tests in this process use 8 simulated CPU devices; set before jax is imported.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A suite started with SIGINT ignored (a background job of a shell without job control) would pass that on to every
# process it starts, and the Ctrl-C tests need SIGINT's default (the training CLI keeps an ignored SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
# NumPy's OpenBLAS threads spin between calls: the simulated devices need the cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# One persistent XLA compile cache for this run: its test processes (pytest-xdist workers
# inherit the variables) and every JAX subprocess they start, so that a program compiled once
# is a cache read everywhere else. A cache the caller names is used and kept; ours is removed
# at the end of the run.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_nvfp4-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "train", "configs", "tiny.yaml")
# The tiny job of the reliability modules (checkpoint, faults, multiprocess) and of the mesh
# tests (tensor axis, two racks): widths divisible by 16 x 6, a batch divisible by 8, 6, 4 and
# 1, sequences of 32 tokens (what these tests check does not depend on the length; a step
# takes 60% of the CPU time of tiny.yaml's 64). One job, so that its programs compile once. No
# gradient clipping: its global norm sums squares per storage shard, so FSDP and HSDP would
# differ by rounding (the multiprocess job clips, to check the norm's sum across processes).
JOB = ("train.steps=6", "model.d_model=96", "model.heads=2", "model.mlp_hidden=192", "model.seq_len=32",
       "data.batch_size=24", "optim.clip_norm=0")
# The modules and tests that train the job on 8 or 6 devices run on one pytest-xdist worker,
# one after the other: its programs compile once and are compile-cache reads from then on
# (two workers starting the same compile at once would both pay for it).
job_worker = pytest.mark.xdist_group("job")


@pytest.fixture(scope="session")
def job_run(tmp_path_factory):
    """``train.loop.run`` of the job (:data:`JOB`) on 8 devices, a flat data axis: the
    reference run of the checkpoint, tensor-axis and two-rack tests (on the job's worker),
    trained once."""
    from train import loop

    cfg = job()
    return loop.run(cfg, mesh_of(cfg, 8), str(tmp_path_factory.mktemp("job")), progress=False)


# Likewise the tests that train or measure tiny.yaml itself (the CLI's tiny run, the
# benchmarks' tiny points): one worker builds its NVFP4 and bf16 programs once.
tiny_worker = pytest.mark.xdist_group("tiny")


# The longest stretches first, so that neither pytest-xdist worker is left with one at the end
# while the other idles: the modules whose tests run on one worker (a shared fixture) and the
# end-to-end training runs. Each module stays contiguous; the rest keep their order.
LONGEST_FIRST = ("test_multiprocess.py", "test_train.py", "test_benchmarks.py", "test_checkpoint.py")


def pytest_collection_finish(session):
    # Tracing makes many short-lived objects; the heap of a test process is large (JAX, Flax,
    # orbax, the test modules). Collections of the modules' objects are wasted work: keep them
    # out of the collector, and collect young objects less often.
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 10)


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", dest="run_all",
                     help="also run the tests marked slow (the whole suite)")


def pytest_collection_modifyitems(config, items):
    # The default run leaves out the tests marked slow (README, "Tests"): `--all` runs them too,
    # `-m slow` only them, any other `-m` expression decides alone.
    if not (config.getoption("run_all") or config.option.markexpr):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pytest_unconfigure(config):
    import atexit
    import gc

    # A worker's exit is a cleanup of objects that die with the process anyway (about 12 s
    # after the last test otherwise). Pytest collects the heap five times over, looking for
    # exceptions raised in finalizers (about 3 s with every compiled program and trace alive):
    # those objects live until the process ends, so they stay out of the collector. JAX's exit
    # handler clears its caches one program at a time (about 5 s): a worker's last exit handler
    # (the first to run) ends the process instead, once pytest-xdist has its results.
    gc.freeze()
    if hasattr(config, "workerinput"):
        atexit.register(_exit_now)
    elif _OWN_CACHE:  # the run's first process
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def tiny(*overrides):
    """``train/configs/tiny.yaml`` with ``overrides`` (``section.key=value`` strings)."""
    from train.config import load_config

    return load_config(TINY, list(overrides))


def job(*overrides):
    """The reliability modules' tiny job (``JOB``) with ``overrides``."""
    return tiny(*JOB, *overrides)


def mesh_of(cfg, n):
    """``cfg``'s mesh on the first ``n`` devices."""
    import jax

    from train import mesh as mesh_lib

    return mesh_lib.build_mesh(cfg.mesh, jax.devices()[:n])


def sets(overrides):
    """``--set`` arguments for ``overrides``."""
    return [a for o in overrides for a in ("--set", o)]


def cli(args, env=None, timeout=240):
    """``python -m train --config tiny.yaml --no-progress ARGS`` in a process of its own (the
    run's compile cache included): the ``CompletedProcess``, text output captured."""
    config = [] if "--config" in args else ["--config", TINY]
    return subprocess.run([sys.executable, "-m", "train", *config, "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def main_here(args, capfd):
    """``python -m train --config tiny.yaml --no-progress ARGS`` (ARGS' own ``--config``
    instead, if it has one) in this process (its exit
    status and stderr are the CLI's): ``(exit status, stdout, stderr lines)``."""
    from train.__main__ import main

    capfd.readouterr()
    rc = main([*([] if "--config" in args else ["--config", TINY]), "--no-progress", *args])
    out, err = capfd.readouterr()
    return rc, out, err.strip().splitlines()
