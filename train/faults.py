"""Fault injection: the ``TRAIN_FAULT_*`` variables (docs/TRAINING.md, "Failures") rehearse a run's failures
on a real run. :func:`from_env` reads them without JAX, so a bad one fails before anything starts."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import sys
import time
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np

__all__ = ["EXIT_STATUS", "Faults", "from_env", "make_checkpoints_read_only", "scaled_step"]

EXIT_STATUS = 17  # TRAIN_FAULT_EXIT's


@dataclasses.dataclass(frozen=True)
class Faults:
    """``actions``: ``(step, process or None for all, action)``, ``action(step)`` after that step (and its
    checkpoint); ``nonfinite``: ``{step: value}``, that step's loss is multiplied by ``value``."""

    actions: Tuple[Tuple[int, Optional[int], Callable[[int], None]], ...] = ()
    nonfinite: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def hooks(self):
        """The :class:`train.loop.StepHooks` that inject these faults."""
        import jax
        from train.loop import StepHooks
        actions, values = self.actions, {int(k): float(v) for k, v in self.nonfinite.items()}

        def run_step(trainer, step, params, opt_state, batch, key):
            if step not in values:
                return trainer.step_fn(params, opt_state, batch, key)
            return scaled_step(trainer)(params, opt_state, batch, key, np.float32(values[step]))

        def after(step, params, opt_state, it):
            for at, proc, action in actions:
                if step == at and proc in (None, jax.process_index()):
                    action(step)

        return StepHooks(run_step=run_step if values else None,
                         after_step=after if actions else None)


def scaled_step(trainer):
    """``step(params, opt_state, batch, key, scale)``: ``trainer``'s step on its loss times the float32
    ``scale``, jitted like it; built once per plan (the run's own step has no multiplier)."""
    if "scaled_step" not in trainer.derived:
        from train import programs
        from train import step as step_lib
        cfg, mesh, rules = trainer.cfg, trainer.mesh, trainer.rules
        loss = step_lib.loss_fn_for(cfg, trainer.model, mesh, rules)
        step = step_lib.make_step(cfg, trainer.model, trainer.tx, rules, mesh,
                                  loss_fn=lambda params, rows, key, scale: loss(params, rows, key) * scale)
        trainer.derived["scaled_step"] = programs.jit_step(step, trainer.param_shardings, trainer.state_shardings,
                                                           trainer.batch_sharding, extra_args=1)
    return trainer.derived["scaled_step"]


def from_env(checkpoint_dir: Optional[str] = None) -> Optional[Faults]:
    """The faults this process's ``TRAIN_FAULT_*`` variables ask for, None if none; ``TRAIN_FAULT_READONLY``
    acts on ``checkpoint_dir``. ValueError on a malformed value, naming it."""
    env = os.environ
    actions = []
    for name, action in (("TRAIN_FAULT_EXIT", _exit_abruptly), ("TRAIN_FAULT_STOP", _freeze),
                         ("TRAIN_FAULT_SIGTERM", _send("SIGTERM")), ("TRAIN_FAULT_SIGINT", _send("SIGINT")),
                         ("TRAIN_FAULT_READONLY", lambda step: make_checkpoints_read_only(checkpoint_dir))):
        if env.get(name):
            step_s, _, proc_s = env[name].partition(":")
            try:
                actions.append((int(step_s), int(proc_s) if proc_s else None, action))
            except ValueError:
                raise ValueError(f"{name}={env[name]!r}: expected STEP[:PROCESS]") from None
    nonfinite: Dict[int, float] = {}
    spec = env.get("TRAIN_FAULT_NONFINITE")
    if spec:
        try:
            nonfinite = {int(s): float(v) for s, v in (item.split(":") for item in spec.split(","))}
        except ValueError:
            raise ValueError(f"TRAIN_FAULT_NONFINITE={spec!r}: expected STEP:VALUE[,STEP:VALUE...]") from None
    return Faults(tuple(actions), nonfinite) if actions or nonfinite else None


def _exit_abruptly(step: int) -> None:
    import jax
    print(f"TRAIN_FAULT_EXIT: process {jax.process_index()} exits after step {step}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_STATUS)


def _freeze(step: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def _send(sig: str) -> Callable[[int], None]:
    def send(step: int) -> None:
        import jax
        os.kill(os.getpid(), getattr(signal, sig))
        if jax.process_count() > 1:
            # The runtime's preemption notifier looks for SIGTERM once a second: let the notice
            # reach every process before this one takes its next step.
            time.sleep(2.0)

    return send


def make_checkpoints_read_only(directory) -> None:
    """From now on no new checkpoint can be created in ``directory`` (EACCES; a save under way finishes,
    other directories are untouched). Done in the process: root ignores chmod."""
    from jax_nvfp4 import internals
    directory = os.path.realpath(str(directory))

    def wrap(mkdir):
        async def refuse(path, *args, **kwargs):
            where = os.path.realpath(str(path))
            if os.path.dirname(where) == directory and re.match(r"\d+\.orbax-checkpoint-tmp", os.path.basename(where)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return await mkdir(path, *args, **kwargs)
        return refuse
    internals.wrap_orbax_mkdir(wrap)
