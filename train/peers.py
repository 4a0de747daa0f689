"""A watch on the other processes of a multi-process run: a lost peer ends this one cleanly.

JAX's coordination service notices a process that stops sending heartbeats (dead, or frozen:
SIGSTOP, a hung host) after ``heartbeat_timeout`` and then aborts every other process with
SIGABRT and a C++ stack dump; the client's ``missed_heartbeat_callback`` that would replace
that cannot be given from Python (the status it passes has no Python type). So each process
runs a small watch of its own, with a shorter limit: it publishes a counter in the service's
key-value store every half second and reads the others'. When a peer's counter has not
moved for ``limit`` seconds, or the service itself stops answering, this process prints one
line and exits with status 4, before the runtime's abort.

A process that finishes its run says so (:meth:`PeerWatch.done`), so the others do not take
its silence for a failure.

This module is also the stack's one access to the distributed runtime's coordination client
and preemption sync manager (:func:`coordination_client`, :func:`preemption_sync_available`,
:func:`wait_at_barrier`), which JAX keeps private.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Dict, Optional

__all__ = ["PeerWatch", "EXIT_LOST_PEER", "coordination_client", "preemption_sync_available", "wait_at_barrier",
           "watch_peers"]

EXIT_LOST_PEER = 4
_PREFIX = "train_peers"


class PeerWatch:
    """Watch the peers of this process (see the module docstring).

    Args:
      client: the ``jax.distributed`` coordination client (:func:`coordination_client`).
      process_index, process_count: this process and how many there are.
      limit: seconds of silence after which a peer counts as lost (keep it below the
        coordination service's heartbeat timeout, so this fires first).
    """

    def __init__(self, client, process_index: int, process_count: int, limit: float, period: float = 0.5):
        self.client, self.me, self.n, self.limit, self.period = client, process_index, process_count, limit, period
        now = time.monotonic()
        self._seen: Dict[int, tuple] = {p: (None, now) for p in range(process_count) if p != process_index}
        self._finished = set()
        self._last_answer = now
        self._stop = threading.Event()
        self._beat = 0

    def start(self) -> "PeerWatch":
        for target in (self._poll, self._judge):
            threading.Thread(target=target, name=f"peer-watch-{target.__name__}", daemon=True).start()
        return self

    def done(self) -> None:
        """This process finished its run normally: stop watching and tell the others."""
        self._stop.set()
        try:
            self.client.key_value_set(f"{_PREFIX}/done/{self.me}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - best effort at the end of a run
            pass

    # -- threads
    def _poll(self) -> None:
        """Publish this process's counter and read the others' (may block if the service is
        frozen: the judge thread then sees no answers)."""
        while not self._stop.is_set():
            try:
                self._beat += 1
                self.client.key_value_set(f"{_PREFIX}/alive/{self.me}", str(self._beat), allow_overwrite=True)
                alive = dict(self.client.key_value_dir_get(f"{_PREFIX}/alive/"))
                done = dict(self.client.key_value_dir_get(f"{_PREFIX}/done/"))
            except Exception:  # noqa: BLE001 - the service is gone: the judge decides
                time.sleep(self.period)
                continue
            now = time.monotonic()
            self._last_answer = now
            for p, (value, _) in list(self._seen.items()):
                if _value(done, p) is not None:
                    self._finished.add(p)
                v = _value(alive, p)
                if v is not None and v != value:
                    self._seen[p] = (v, now)
            time.sleep(self.period)

    def _judge(self) -> None:
        while not self._stop.wait(self.period):
            now = time.monotonic()
            if now - self._last_answer > self.limit:
                self._lost(f"the coordination service has not answered for {now - self._last_answer:.0f} s "
                           "(process 0 died or is frozen)")
            for p, (_, t) in self._seen.items():
                if p not in self._finished and now - t > self.limit:
                    self._lost(f"process {p} has not been heard from for {now - t:.0f} s (died or frozen)")

    def _lost(self, why: str) -> None:
        if self._stop.is_set():
            return
        print(f"error: process {self.me}: lost a peer: {why}; stopping", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_LOST_PEER)


def _value(items: Dict[str, str], p: int) -> Optional[str]:
    for k, v in items.items():
        if k.rstrip("/").rsplit("/", 1)[-1] == str(p):
            return v
    return None


# The distributed runtime's handles: jax.distributed exposes initialize, shutdown and
# is_initialized only, no public handle to the coordination service's client (its key-value
# store and barriers) or to the preemption sync manager, so they are read from jax's private
# module here, and only here.
def _runtime():
    from jax._src import distributed

    return distributed.global_state


def coordination_client():
    """The client of ``jax.distributed``'s coordination service (``key_value_set``,
    ``blocking_key_value_get``, ``key_value_dir_get``, ``wait_at_barrier``); None before
    ``jax.distributed.initialize``."""
    return _runtime().client


def preemption_sync_available() -> bool:
    """``jax.distributed``'s preemption sync service runs in this process (the processes of a
    multi-process run can agree on a step to stop at; :mod:`train.preemption`)."""
    return _runtime().preemption_sync_manager is not None


def wait_at_barrier(name: str, timeout_ms: int) -> None:
    """Wait until every process of the run reaches the barrier ``name`` (an error after
    ``timeout_ms``, or when a process is gone)."""
    coordination_client().wait_at_barrier(name, timeout_ms)


def watch_peers(heartbeat_timeout: float) -> Optional[PeerWatch]:
    """Start a :class:`PeerWatch` for this multi-process run (None in a single process)."""
    import jax

    client = coordination_client()
    if client is None or jax.process_count() < 2:
        return None
    # The service counts its timeout from the last heartbeat it received, and a process sends
    # heartbeats only every so often: its abort can come sooner after a peer freezes than the
    # full timeout. At half the timeout the watch lost that race in one multi-process run of
    # many (the survivor died by SIGABRT); 0.3 of it leaves a margin.
    limit = max(2.0, 0.3 * heartbeat_timeout)
    return PeerWatch(client, jax.process_index(), jax.process_count(), limit).start()
