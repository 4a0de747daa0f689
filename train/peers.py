"""A watch on the peers of a multi-process run: a lost one ends this process with one line, exit 4,
before the coordination service's SIGABRT (its ``missed_heartbeat_callback`` cannot be given from
Python). Also the stack's one access to the distributed runtime's handles, which JAX keeps private."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Dict, Optional

__all__ = ["PeerWatch", "EXIT_LOST_PEER", "coordination_client", "differences", "preemption_sync_available",
           "watch_peers"]

EXIT_LOST_PEER = 4
_PREFIX = "train_peers"


class PeerWatch:
    """Each process publishes a counter in ``client``'s key-value store and reads the others': a counter
    still for ``limit`` seconds (below the service's heartbeat timeout), or no answer, is a lost peer."""

    def __init__(self, client, process_index: int, process_count: int, limit: float, period: float = 0.5):
        self.client, self.me, self.n, self.limit, self.period = client, process_index, process_count, limit, period
        now = time.monotonic()
        self._seen: Dict[int, tuple] = {p: (None, now) for p in range(process_count) if p != process_index}
        self._finished, self._last_answer, self._stop, self._beat = set(), now, threading.Event(), 0

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

    def _poll(self) -> None:
        # May block while the service is frozen: the judge thread then sees no answers.
        while not self._stop.is_set():
            try:
                self._beat += 1
                self.client.key_value_set(f"{_PREFIX}/alive/{self.me}", str(self._beat), allow_overwrite=True)
                alive, done = (_by_process(self.client.key_value_dir_get(f"{_PREFIX}/{d}/")) for d in ("alive", "done"))
            except Exception:  # noqa: BLE001 - the service is gone: the judge decides
                time.sleep(self.period)
                continue
            now = self._last_answer = time.monotonic()
            self._finished.update(p for p in self._seen if str(p) in done)
            for p, (value, _) in list(self._seen.items()):
                if alive.get(str(p), value) != value:
                    self._seen[p] = (alive[str(p)], now)
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


def _by_process(items) -> Dict[str, str]:
    """``{process: value}`` of a key-value directory's ``[(".../<process>", value)]``."""
    return {k.rstrip("/").rsplit("/", 1)[-1]: v for k, v in items}


def coordination_client():
    """``jax.distributed``'s coordination client (key-value store, barriers); None before initialize."""
    from jax_nvfp4.internals import distributed_state
    return distributed_state().client


def differences(values: Dict[str, str], timeout_s: float = 300.0) -> Optional[str]:
    """How this process's ``values`` differ from another process's (every process publishes its own and reads all
    the others'), None where all agree. Each process compares with all the others, so every one of them sees a
    difference and can stop before the first collective it would hang or corrupt."""
    import jax

    client, me = coordination_client(), jax.process_index()
    client.key_value_set(f"{_PREFIX}/values/{me}", json.dumps(values, sort_keys=True))
    for other in range(jax.process_count()):
        if other == me:
            continue
        theirs = json.loads(client.blocking_key_value_get(f"{_PREFIX}/values/{other}", int(timeout_s * 1000)))
        for key in sorted(set(values) | set(theirs)):
            if values.get(key) != theirs.get(key):
                return (f"{key}={values.get(key)} in process {me}, {key}={theirs.get(key)} in process {other}")
    return None


def preemption_sync_available() -> bool:
    """Whether ``jax.distributed``'s preemption sync service runs here (:mod:`train.preemption`)."""
    from jax_nvfp4.internals import distributed_state
    return distributed_state().preemption_sync_manager is not None


def watch_peers(heartbeat_timeout: float) -> Optional[PeerWatch]:
    """A started :class:`PeerWatch` for this multi-process run (None in a single process)."""
    import jax
    client = coordination_client()
    if client is None or jax.process_count() < 2:
        return None
    # The service's abort can come sooner than its full timeout after a peer freezes (it counts from
    # the last heartbeat received): 0.3 of it leaves a margin that half of it does not.
    limit = max(2.0, 0.3 * heartbeat_timeout)
    return PeerWatch(client, jax.process_index(), jax.process_count(), limit).start()
