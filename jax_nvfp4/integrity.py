"""Content hashes of a directory that several processes write (a checkpoint step,
:class:`jax_nvfp4.checkpoint.Checkpointer`), each process hashing and verifying its own share
(no process reads another's files). Process ``p`` owns the files under a path
component ``process_<p>`` or ``ocdbt.process_<p>`` (orbax's per-process data); process 0 also every
other file. Hidden files are not part of a directory's content, nor is orbax's bookkeeping of a step
(:data:`BOOKKEEPING`: timestamps and a commit marker it writes as it commits, after the content is final)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Dict, List

import jax
import numpy as np

__all__ = ["IntegrityError", "Unrecorded", "RECORD", "record", "verify", "owner"]

RECORD = "jax_nvfp4.sha256.json"  # process 0's record; process p's is jax_nvfp4.sha256.process_<p>.json
BOOKKEEPING = ("_CHECKPOINT_METADATA", "commit_success.txt")  # orbax's, rewritten or written at its commit


class IntegrityError(ValueError):
    """A directory whose content is not what was recorded; one line naming the file."""


class Unrecorded(IntegrityError):
    """A record is missing (its writer stopped before writing it)."""


def owner(rel: str) -> int:
    """The process that writes the file ``rel`` (relative to the directory)."""
    m = re.search(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)", rel.replace(os.sep, "/"))
    return int(m.group(1)) if m else 0


def record_name(p: int) -> str:
    return RECORD if p == 0 else RECORD.replace(".json", f".process_{p}.json")


def listing(d: str) -> List[str]:
    """The files under ``d`` (relative paths) but the records and hidden files; nothing read."""
    out = [os.path.relpath(os.path.join(root, f), d) for root, _, files in os.walk(d) for f in files]
    return sorted(rel for rel in out if not any(part.startswith(".") for part in rel.split(os.sep))
                  and not re.fullmatch(re.escape(RECORD[:-5]) + r"(\.process_\d+)?\.json", rel)
                  and rel not in BOOKKEEPING)


def hash_file(path: str) -> Dict[str, Any]:
    with open(path, "rb") as f:
        return {"sha256": hashlib.file_digest(f, "sha256").hexdigest(), "bytes": f.tell()}


def _digest(rec: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()


def record(d: str) -> None:
    """Write this process's record of ``d``: the sha256 and size of the files it owns, and the
    process count (how many records make the whole). Raises OSError."""
    me = jax.process_index()
    rec = {"files": {rel: hash_file(os.path.join(d, rel)) for rel in listing(d) if owner(rel) == me},
           "process_count": jax.process_count()}
    tmp = os.path.join(d, f".{record_name(me)}.tmp")
    with open(tmp, "w") as f:
        json.dump({**rec, "sha256": _digest(rec)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, record_name(me)))


def _read(d: str, p: int) -> Dict[str, Any]:
    name = record_name(p)
    try:
        with open(os.path.join(d, name), "rb") as f:
            rec = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise Unrecorded(f"no content hashes ({name}): its save did not finish recording them, so it cannot be "
                         "verified") from None
    except (OSError, ValueError) as e:
        raise IntegrityError(f"corrupt: its {name} cannot be read ({type(e).__name__})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("files"), dict) or \
            rec.get("sha256") != _digest({k: v for k, v in rec.items() if k != "sha256"}):
        raise IntegrityError(f"corrupt: its {name} does not match its own hash")
    return rec


def verify(d: str) -> None:
    """Raise :class:`IntegrityError` unless ``d`` holds what its records list, no more (hidden files
    aside), at the recorded sizes, and this process's share of the records (record ``r`` for process
    ``r % process_count``) matches its sha256; the processes agree on the first bad file. Every
    process calls it together."""
    records = [_read(d, 0)]
    records += [_read(d, p) for p in range(1, int(records[0].get("process_count", 1)))]
    files = {rel: entry for r in records for rel, entry in r["files"].items() if rel not in BOOKKEEPING}
    names, actual = sorted(files), set(listing(d))
    for rel in sorted(set(names) | actual):
        if rel not in actual:
            raise IntegrityError(f"corrupt: file {rel} is missing")
        if rel not in files:
            raise IntegrityError(f"corrupt: file {rel} was not part of the saved checkpoint")
        if os.path.getsize(os.path.join(d, rel)) != files[rel]["bytes"]:
            raise IntegrityError(f"corrupt: file {rel} does not match its sha256 (its size changed)")
    me, count = jax.process_index(), jax.process_count()
    mine = sorted(rel for p, r in enumerate(records) if p % count == me for rel in r["files"])
    bad = _first(next((names.index(rel) for rel in mine if hash_file(os.path.join(d, rel)) != files[rel]), len(names)))
    if bad < len(names):
        raise IntegrityError(f"corrupt: file {names[bad]} does not match its sha256 (altered or damaged)")


def _first(index: int) -> int:
    """The smallest ``index`` of every process (a collective when there are several)."""
    if jax.process_count() == 1:
        return index
    from jax.experimental import multihost_utils
    return int(np.min(multihost_utils.process_allgather(np.int64(index))))
