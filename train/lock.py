"""One run per folder: ``fcntl.flock`` on ``<folder>/.train.lock``, which names its holder. The lock dies
with its process (``kill -9`` too), so a leftover file is never stale; release removes the file while
still locked (a run that opened it meanwhile sees it replaced and tries again). On NFS ``flock`` is a
whole-file POSIX lock."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

__all__ = ["FolderLock", "LockError", "LOCK_NAME"]

LOCK_NAME = ".train.lock"
HOLDER_WAIT_S = 2.0  # how long a refused run waits for the holder's record, to name it


class LockError(RuntimeError):
    """The folder cannot be locked (another run holds it, or it cannot be created or written); one line."""


class FolderLock:
    """An exclusive lock on ``folder``; ``what`` names it in messages (``"--out"``, ``"checkpoint.dir"``)."""

    def __init__(self, folder: str, what: str):
        self.folder, self.what = os.path.abspath(os.fspath(folder)), what
        self.path = os.path.join(self.folder, LOCK_NAME)
        self._fd: Optional[int] = None
        self._created: list = []  # folders this lock created, innermost first

    def acquire(self) -> "FolderLock":
        """Take the lock, creating the folder if needed; LockError if another run holds it (naming it),
        or the folder is a file, cannot be created or is not writable."""
        where = f"{self.what} {self.folder}"
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise LockError(f"{where}: exists and is not a folder")
        try:
            missing, d = [], self.folder
            while not os.path.exists(d):
                missing.append(d)
                d = os.path.dirname(d)
            for d in reversed(missing):
                os.mkdir(d)
                self._created.insert(0, d)
        except OSError as e:
            self._remove_created()
            raise LockError(f"{where}: cannot create it: {e.strerror or e}") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self._remove_created()
                raise LockError(f"{where}: cannot write there: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                held = e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
                holder = _holder(fd, wait_s=HOLDER_WAIT_S if held else 0.0)
                os.close(fd)
                if not held:
                    raise LockError(f"{where}: cannot lock {LOCK_NAME}: {e.strerror or e}") from None
                raise LockError(f"{where} is in use by another run ({holder}); refusing to share it "
                                "(nothing written)") from None
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            os.close(fd)  # the holder removed it between our open and our lock: try the new one
        self._fd = fd
        started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (info + "\n").encode(), 0)
        except OSError as e:
            self.release()
            raise LockError(f"{where}: cannot write there: {e.strerror or e}") from None
        return self

    def release(self) -> None:
        """Remove the lock file, then release the lock and the folders it created if empty. Idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for d in self._created:
            try:
                os.rmdir(d)  # only if empty
            except OSError:
                break
        self._created = []

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int, wait_s: float) -> str:
    """The holder recorded in a lock file, in words; a holder that has just taken the lock writes its record right
    after, so an empty or partial record is read again for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return "its holder not recorded yet"
            time.sleep(0.01)
