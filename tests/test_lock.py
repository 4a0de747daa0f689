"""train.lock: one run per folder; a lock that dies with its process. No JAX."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from train.lock import LOCK_NAME, FolderLock, LockError

from conftest import ROOT

HOLD = """
import sys, time
from train.lock import FolderLock
FolderLock(sys.argv[1], "--out").acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_lock_is_refused_naming_the_holder_and_release_cleans_up(tmp_path):
    d = tmp_path / "new" / "run"
    lock = FolderLock(str(d), "--out").acquire()
    assert os.listdir(d) == [LOCK_NAME]
    with pytest.raises(LockError) as e:
        FolderLock(str(d), "--out").acquire()  # another open file: refused like another process
    assert str(e.value).startswith(f"--out {d} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, "
                                   "started ")
    assert str(e.value).endswith("refusing to share it (nothing written)") and "\n" not in str(e.value)
    lock.release()
    # Nothing else was written: the folders the lock created are gone again.
    assert not (tmp_path / "new").exists()
    # A folder with the run's files keeps them; only the lock file goes.
    d.mkdir(parents=True)
    with FolderLock(str(d), "--out"):
        (d / "metrics.jsonl").write_text("{}\n")
    assert os.listdir(d) == ["metrics.jsonl"]


def test_a_lock_taken_an_instant_ago_is_named_once_its_holder_writes_it(tmp_path, monkeypatch):
    """Two runs started together: the loser can find the lock taken before the winner has
    written its record. It waits for the record (up to HOLDER_WAIT_S) to name the holder; a
    record that never comes is said as such."""
    import fcntl
    import threading

    from train import lock as lock_lib

    d = tmp_path / "run"
    d.mkdir()
    fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken, nothing recorded yet
    record = b'{"pid": 4242, "host": "h", "started": "now"}\n'
    writer = threading.Timer(0.3, lambda: os.pwrite(fd, record, 0))
    writer.start()
    with pytest.raises(LockError, match=r"in use by another run \(pid 4242 on h, started now\)"):
        FolderLock(str(d), "--out").acquire()
    writer.join()
    os.ftruncate(fd, 0)
    monkeypatch.setattr(lock_lib, "HOLDER_WAIT_S", 0.1)
    with pytest.raises(LockError, match=r"in use by another run \(its holder not recorded yet\)"):
        FolderLock(str(d), "--out").acquire()
    os.close(fd)


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    d = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(d)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert child.stdout.readline() == "held\n"
        with pytest.raises(LockError, match=f"pid {child.pid} on"):
            FolderLock(str(d), "checkpoint.dir").acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert os.listdir(d) == [LOCK_NAME]  # the file stays, the lock died with its process
    with FolderLock(str(d), "checkpoint.dir"):
        pass


def test_unusable_folders_are_one_line_errors(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    for path, needle in ((f, "exists and is not a folder"), (f / "sub", "cannot create it: Not a directory")):
        with pytest.raises(LockError, match=needle) as e:
            FolderLock(str(path), "--out").acquire()
        assert "\n" not in str(e.value)
    assert os.listdir(tmp_path) == ["f"]
