"""jax_nvfp4.xla_flags, the XLA flags the training stack sets on GPU: real flag names, set only
when headed for a GPU, and never over a value the user gave."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from jax_nvfp4 import xla_flags


def test_every_flag_is_one_the_installed_xla_knows():
    # XLA aborts the process on an unknown name in XLA_FLAGS (a renamed flag would stop every
    # GPU job at start-up); the CPU backend parses the same flag table, so a CPU host checks it.
    env = dict(os.environ, XLA_FLAGS=xla_flags.with_gpu_flags(""), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(int(jnp.ones(3).sum()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "3", run.stderr[-2000:]
    bad = dict(env, XLA_FLAGS="--xla_gpu_enable_async_collectives=true")  # a flag XLA has removed
    run = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(3).sum()"],
                         env=bad, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Unknown flag" in run.stderr


def test_user_flags_win_and_nothing_is_added_twice():
    user = "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/d"
    merged = xla_flags.with_gpu_flags(user)
    assert merged.startswith(user)
    assert merged.count("xla_gpu_enable_pipelined_all_gather") == 1
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in merged
    assert xla_flags.with_gpu_flags(merged) == merged
    assert len(xla_flags.GPU_FLAGS) == len({name for name, _, _ in xla_flags.GPU_FLAGS})


def test_set_only_when_headed_for_a_gpu_and_enabled(monkeypatch):
    def configured(env, plugin=False, enabled=True):
        env = dict(env)
        monkeypatch.setattr(xla_flags, "_has_cuda_plugin", lambda: plugin)
        added = xla_flags.configure(enabled, env)
        return added, env.get("XLA_FLAGS")

    names = sorted(name for name, _, _ in xla_flags.GPU_FLAGS)
    assert configured({"JAX_PLATFORMS": "cpu"}, plugin=True) == ([], None)
    assert configured({}, plugin=False) == ([], None)  # the CPU build of jaxlib: this machine
    assert configured({"JAX_PLATFORMS": "cuda"})[0] == names
    assert configured({}, plugin=True)[0] == names
    assert configured({"JAX_PLATFORMS": "cuda"}, enabled=False) == ([], None)
    added, flags = configured({"JAX_PLATFORMS": "cuda,cpu", "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"})
    assert "xla_gpu_enable_latency_hiding_scheduler" not in added and "=false" in flags


@pytest.mark.slow
def test_cli_prints_the_flags_and_why():
    env = dict(os.environ, XLA_FLAGS="--xla_dump_to=/tmp/d")
    run = subprocess.run([sys.executable, "-m", "jax_nvfp4.xla_flags"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == xla_flags.with_gpu_flags("--xla_dump_to=/tmp/d")
    run = subprocess.run([sys.executable, "-m", "jax_nvfp4.xla_flags", "--explain"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert len(run.stdout.strip().splitlines()) == len(xla_flags.GPU_FLAGS)
    # A mistyped option is an error, not the flags printed as if it were not there.
    run = subprocess.run([sys.executable, "-m", "jax_nvfp4.xla_flags", "--explian"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and not run.stdout and "unrecognized arguments: --explian" in run.stderr


def test_the_slurm_script_takes_its_flags_from_here():
    text = open(os.path.join(ROOT, "scripts", "slurm_gb200.sbatch")).read()
    assert 'export XLA_FLAGS="$(python -m jax_nvfp4.xla_flags)"' in text
    assert "--xla_gpu" not in text  # one home for the flags


def test_flags_set_after_importing_the_library_still_count():
    # python -m train imports jax_nvfp4 (and so JAX) before configure() edits XLA_FLAGS: the
    # import must not start a backend, which would read the flags first.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    script = ("import os; from jax_nvfp4 import xla_flags; "
              "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=3'; "
              "import jax; print(jax.device_count())")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "3", run.stderr[-2000:]
    # The path the training CLI prints for these flags is this module's.
    text = open(os.path.join(ROOT, "train", "__main__.py")).read()
    assert "XLA flags for overlap on GPU (jax_nvfp4/xla_flags.py; XLA_FLAGS overrides)" in text
    assert os.path.isfile(os.path.join(ROOT, xla_flags.__name__.replace(".", os.sep) + ".py"))
