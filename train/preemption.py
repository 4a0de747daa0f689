"""Stopping on SIGTERM or SIGINT: the run saves the step it is at and exits; a second signal
ends it at once.

SLURM sends SIGTERM at preemption and before the time limit (``--signal``), a terminal SIGINT
on Ctrl-C. The first one asks the training loop (:func:`train.loop.run`) to stop after the
step it is dispatching: it saves that step's checkpoint (when ``checkpoint.dir`` is set),
waits for every pending save and raises :class:`Stopped`; the CLI prints one line and exits
with :func:`exit_code` (128 + the signal's number: 143 for SIGTERM, 130 for SIGINT, what a
shell reports for a process the signal ended). A second signal exits at once with that code:
a save under way is abandoned (orbax's atomic rename keeps every earlier checkpoint whole).

Several processes must stop at the same step, or their collectives would wait for each
other forever. They use JAX's preemption sync protocol
(:func:`jax.experimental.multihost_utils.reached_preemption_sync_point`, what orbax's
``CheckpointManager.reached_preemption`` calls): ``jax.distributed.initialize`` installs a
SIGTERM handler of the runtime's own, which tells the coordination service; every process
then reports the step it is at and all agree on the next step after the furthest one. Every
process asks at every step whether that step has come. SIGTERM is therefore left to the
runtime's handler (it notices a signal within a second); a SIGINT is passed on to it as a
SIGTERM of this process. A process sees a second signal once the agreed step has come.

A signal whose disposition is not the default one when the run starts (a launcher that made
background processes ignore SIGINT) is left alone. Without the runtime's preemption service
(``jax_enable_preemption_service=False``) a multi-process run installs nothing: a signal ends
a process as it would without this module.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

__all__ = ["Preemption", "Stopped", "exit_code"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by signal ``signum`` (128 + its number)."""
    return 128 + int(signum)


class Stopped(Exception):
    """The run stopped at ``step`` on signal ``signum``; ``saved``: a checkpoint of that step
    is on disk (None: no ``checkpoint.dir``)."""

    def __init__(self, step: int, signum: int, saved: Optional[str]):
        self.step, self.signum, self.saved = int(step), int(signum), saved
        super().__init__(self.line())

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def line(self) -> str:
        if self.saved:
            what = "checkpoint saved; rerun the same command to resume"
        else:
            what = "no checkpoint.dir, nothing saved (metrics.jsonl holds the steps trained)"
        return f"stopped at step {self.step} by {self.name}; {what}"


class Preemption:
    """The stop request of this process: install with :meth:`install`, ask with
    :meth:`should_stop` after every step, undo with :meth:`uninstall`.

    Args:
      sync: use JAX's preemption sync protocol (a multi-process run); else this process's
        own signal handlers decide alone.
    """

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.signum: Optional[int] = None  # the first signal this process received
        self._previous = {}

    # -- handlers
    def install(self) -> "Preemption":
        """Take over SIGTERM and SIGINT (main thread only; those with a non-default
        disposition are left alone, as is SIGTERM under the sync protocol)."""
        for sig in SIGNALS:
            current = signal.getsignal(sig)
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            if current is not default or (self.sync and sig == signal.SIGTERM):
                continue
            self._previous[sig] = current
            signal.signal(sig, self._first)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _first(self, signum, frame) -> None:
        if self.signum is not None:
            self._now(signum, frame)
        self.signum = signum
        if self.sync:
            # Through the runtime's SIGTERM handler, so that every process learns of it.
            os.kill(os.getpid(), signal.SIGTERM)

    def _now(self, signum, frame) -> None:
        sys.stdout.flush()
        print(f"second {signal.Signals(signum).name}: exiting at once; the checkpoint being written, if any, is "
              "abandoned (the earlier ones are intact)", file=sys.stderr, flush=True)
        os._exit(exit_code(signum))

    def arm_second(self) -> None:
        """From now on a SIGTERM or SIGINT exits at once (called once the stop has begun: under
        the sync protocol the runtime's SIGTERM handler would swallow a second one)."""
        for sig in SIGNALS:
            if sig in self._previous or (self.sync and sig == signal.SIGTERM):
                self._previous.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, self._now)

    # -- the question of every step
    def should_stop(self, step: int) -> bool:
        """True once the run should stop after ``step`` (steps counted from 1, asked at every
        step by every process)."""
        if self.sync:
            from jax.experimental import multihost_utils

            if not multihost_utils.reached_preemption_sync_point(int(step)):
                return False
            if self.signum is None:
                self.signum = signal.SIGTERM  # the runtime's notice: some process got SIGTERM
            return True
        return self.signum is not None
