"""Stopping on SIGTERM or SIGINT: save the step, exit 128 + the signal's number; a second one exits at
once (docs/TRAINING.md). Several processes agree on the step through JAX's preemption sync protocol, whose
SIGTERM handler is the runtime's: SIGTERM is left to it, a SIGINT passed on to it as a SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

__all__ = ["Preemption", "Stopped", "exit_code"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    return 128 + int(signum)


class Stopped(Exception):
    """The run stopped at ``step`` on signal ``signum``; ``saved``: that step's checkpoint (None: no
    ``checkpoint.dir``)."""

    def __init__(self, step: int, signum: int, saved: Optional[str]):
        self.step, self.signum, self.saved = int(step), int(signum), saved
        super().__init__(self.line())

    def line(self) -> str:
        what = ("checkpoint saved; rerun the same command to resume" if self.saved
                else "no checkpoint.dir, nothing saved (metrics.jsonl holds the steps trained)")
        return f"stopped at step {self.step} by {signal.Signals(self.signum).name}; {what}"


class Preemption:
    """This process's stop request: :meth:`install`, :meth:`should_stop` after every step,
    :meth:`uninstall`. ``sync``: use JAX's preemption sync protocol (multi-process)."""

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.signum: Optional[int] = None  # the first signal this process received
        self._previous = {}

    def install(self) -> "Preemption":
        """Take over SIGTERM and SIGINT (main thread only) where their disposition is the default: a launcher
        may have made background processes ignore SIGINT."""
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
        if self.sync:  # through the runtime's SIGTERM handler, so that every process learns of it
            os.kill(os.getpid(), signal.SIGTERM)

    def _now(self, signum, frame) -> None:
        sys.stdout.flush()
        print(f"second {signal.Signals(signum).name}: exiting at once; the checkpoint being written, if any, is "
              "abandoned (the earlier ones are intact)", file=sys.stderr, flush=True)
        os._exit(exit_code(signum))

    def arm_second(self) -> None:
        """From now on a SIGTERM or SIGINT exits at once (call once the stop has begun: under the sync
        protocol the runtime's SIGTERM handler would swallow a second one)."""
        for sig in SIGNALS:
            if sig in self._previous or (self.sync and sig == signal.SIGTERM):
                self._previous.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, self._now)

    def should_stop(self, step: int) -> bool:
        """Whether to stop after ``step`` (counted from 1; every process asks at every step)."""
        if not self.sync:
            return self.signum is not None
        from jax.experimental import multihost_utils
        if not multihost_utils.reached_preemption_sync_point(int(step)):
            return False
        if self.signum is None:
            self.signum = signal.SIGTERM  # the runtime's notice: some process got SIGTERM
        return True
