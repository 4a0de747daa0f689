"""The private JAX and orbax APIs this project uses, each where no public one serves: the only module
that imports or reads them (``tests/test_imports.py`` checks), so that an upgrade that moves one breaks
here, in one place, with the reason next to it."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["await_orbax_tmp_cleanup", "distributed_state", "wrap_orbax_mkdir"]


def distributed_state() -> Any:
    """``jax.distributed``'s state: ``.client`` (the coordination service's key-value store and barriers; None
    before ``jax.distributed.initialize``) and ``.preemption_sync_manager`` (None where the service does not run).
    ``jax.distributed`` offers no public handle to either."""
    from jax._src import distributed
    return distributed.global_state


def await_orbax_tmp_cleanup(manager) -> None:
    """Wait for an orbax ``CheckpointManager``'s background removal of a killed save's temporary directory (a
    manager opened on a folder starts it; orbax has no public way to wait for it). Nothing where this orbax
    lacks it."""
    getattr(manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()


def wrap_orbax_mkdir(wrap: Callable[[Callable], Callable]) -> None:
    """Replace the function orbax's saves create a step's directory with (``<step>.orbax-checkpoint-tmp``) by
    ``wrap(it)``, for the rest of the process: orbax offers no public way to make that creation fail (a fault
    rehearsal of a checkpoint folder turned read-only)."""
    from orbax.checkpoint._src.path import async_path
    async_path.mkdir = wrap(async_path.mkdir)
