import os
import sys

# Multi-device tests in this process use 8 simulated CPU devices; set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent XLA compile cache for a test module and the CLI subprocesses it starts
    (shared by the modules of a session, so a repeated compile is a cache read)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = str(tmp_path_factory.getbasetemp() / "jax-cache")
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cc.reset_cache()
    yield path
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    cc.reset_cache()
