"""Checkpoints of the whole training state, on orbax-checkpoint's standard handlers.

One checkpoint (``<dir>/<step>/``) holds:

- ``state`` (``StandardSave``): the params and the optimizer state as the training holds them:
  ``TiledNVFP4`` and ``Tiled`` leaves are pytree nodes whose arrays orbax writes in the
  tile-major layout (:mod:`jax_nvfp4.layout`), each process its own shards; typed PRNG keys
  are orbax's to store. The layout depends on the data-axis size only through the zero tiles
  that pad each matrix's tile list to a multiple of it, so a checkpoint restores onto any
  data-axis size (``strict=False``: orbax pads or truncates the tile axis, only zero tiles
  are dropped or added); leaves saved with another tensor-axis split are read whole and
  re-laid out on the devices.
- ``meta`` (``JsonSave``): the step, the data iterator position, the loop's base PRNG key, a
  description of every leaf (:func:`describe`, checked on restore: a checkpoint of another
  model or optimizer is refused in one line naming the first leaf that differs) and
  ``run``, the trajectory-defining config that :func:`check_resume` compares.
- ``jax_nvfp4.sha256.json`` and ``jax_nvfp4.sha256.process_<p>.json``: the sha256 and size
  of the files each process wrote (orbax's ``ocdbt.process_<p>/`` and
  ``array_metadatas/process_<p>``; process 0 also the shared metadata), written by that
  process from its own files once the save has committed. No process reads another's files.

Saves are atomic (orbax writes a temporary directory and renames it once every process has
written); a later :class:`Checkpointer` removes a leftover temporary directory. A restore is
preceded by :meth:`Checkpointer.verify`: every process checks the records and the listing
(missing, extra or resized files), hashes the files of its share of the records (on the same
process count: the files it wrote, which hold the shards it reads) and the processes agree on
the first mismatch, so a corrupt file is refused everywhere in one line naming it. A
checkpoint lacking a record (a save killed between its commit and the record) is not trusted.
Non-finite values are refused too; :meth:`Checkpointer.restorable_step` with ``fallback``
takes the newest intact checkpoint and :meth:`Checkpointer.set_aside` renames the damaged
ones ``corrupt-<step>`` once the resume is accepted. Hidden files are ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from train.config import ConfigError

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "Restored", "check_resume", "describe",
           "host_arrays", "run_identity", "FORMAT", "FORMAT_VERSION", "HASHES"]

FORMAT = "jax_nvfp4.train.checkpoint"
# 1: masters saved by their logical values; 2: the tile layout, content hashes and the
# trajectory-defining config (meta["run"]); 3: orbax's standard handlers, hashes per process.
FORMAT_VERSION = 3
HASHES = "jax_nvfp4.sha256.json"  # process 0's record; process p's: _record_name(p)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (incompatible, corrupt, non-finite); one line."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (e.g. the directory became read-only); the
    checkpoints before it are intact. One line."""


@dataclasses.dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any
    base_key: Optional[jax.Array]
    data_state: Dict[str, int]


# ----------------------------------------------------------------------------- the state's leaves
def _is_node(x) -> bool:
    return nv.is_nvfp4(x) or nv.is_tiled(x)


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _named(tree, is_leaf=None) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]`` of ``{"params": ..., "opt_state": ...}``, names ``params/a/0/b``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(nv.path_str(path), leaf) for path, leaf in flat]


def describe(params, opt_state) -> Dict[str, Dict[str, Any]]:
    """``{leaf name: {kind, shape, dtype[, block, tensor_split]}}`` of what a checkpoint of
    this state holds, independent of the mesh (logical shapes). Works on arrays and on
    ``jax.ShapeDtypeStruct`` trees (``jax.eval_shape``)."""
    out = {}
    for name, leaf in _named({"params": params, "opt_state": opt_state}, _is_node):
        if nv.is_nvfp4(leaf) or isinstance(leaf, nv.TiledNVFP4):
            out[name] = {"kind": "nvfp4", "shape": list(leaf.shape), "block": list(leaf.block)}
        elif isinstance(leaf, nv.Tiled):
            out[name] = {"kind": "tiled", "shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.value.dtype))}
        elif _is_key(leaf):
            out[name] = {"kind": "key", "shape": list(leaf.shape), "impl": str(getattr(leaf.dtype, "_impl", leaf.dtype))}
        else:
            out[name] = {"kind": "array", "shape": list(np.shape(leaf)), "dtype": str(jnp.dtype(leaf.dtype))}
        if isinstance(leaf, (nv.Tiled, nv.TiledNVFP4)):
            out[name]["tensor_split"] = [leaf.layout.n_tensor, leaf.layout.tensor_dim]
    return out


def host_arrays(params, opt_state) -> Dict[str, np.ndarray]:
    """``{name: host array}`` of a state's logical values (NVFP4 leaves as their packed
    ``data``, ``scale_bits``, ``amax_bits``, masters and moments unpadded, keys as their key
    data), for comparing states bit for bit across meshes. Single-process."""
    # Every relayout in one program (op by op, each would compile its own for each mesh).
    tree = jax.jit(nv.logical)({"params": params, "opt_state": opt_state})
    return {name: np.asarray(jax.random.key_data(x) if _is_key(x) else x) for name, x in _named(tree)}


@jax.jit
def _finite(tree) -> Dict[str, jax.Array]:
    """``{name: all values finite}`` of the float leaves (amaxes, stored as their float32 bits,
    included), in one program per state structure."""
    out = {}
    for name, x in _named(tree):
        if name.endswith("/amax_bits"):
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        if not _is_key(x) and jnp.issubdtype(x.dtype, jnp.floating):
            out[name] = jnp.all(jnp.isfinite(x.astype(jnp.float32)))
    return out


# ----------------------------------------------------------------------------- the manager
class Checkpointer:
    """Saves and restores training states under ``directory`` (one orbax step directory per
    checkpoint; the ``keep`` most recent are kept).

    Every process of a multi-process run must create it and call :meth:`save`,
    :meth:`restorable_step`, :meth:`verify` and :meth:`restore` together (orbax and the
    verification synchronise them); the directory must be shared.
    """

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint.dir={directory!r}: exists and is not a directory")
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint.dir={directory!r}: cannot create it: {e.strerror or e}") from None
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint.dir={directory!r}: not readable and writable")
        self.async_save = async_save
        self._unhashed: List[int] = []  # steps saved here whose hash record is not written yet
        self._verified: set = set()  # steps verified by this object (restore need not re-hash)
        self._hash_lock = threading.Lock()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # a save killed before its atomic rename left it
            # Each process records its hashes as soon as an asynchronous save has committed. The
            # step's temporary directory is created before save() returns: a directory that cannot
            # be written fails the save there, instead of leaving orbax's background threads
            # waiting (for its 5-minute coordination timeout) for a creation signal.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_hashes,
                                           create_directories_asynchronously=False) if async_save else None)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # noqa: BLE001 - an unusable directory is a user error
            raise CheckpointError(f"checkpoint.dir={directory!r}: cannot use it: {_first_line(e)}") from None
        try:  # orbax removes leftovers in the background: finish now (best effort)
            getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        except OSError:
            pass

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None (unfinished saves are not steps)."""
        try:
            return self.manager.latest_step()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint.dir={self.directory!r}: cannot list it: {_first_line(e)}") from None

    def all_steps(self) -> List[int]:
        return sorted(self.manager.all_steps())

    # -- save
    def save(self, step: int, params, opt_state, *, mesh,
             base_key: Optional[jax.Array] = None, data_state: Optional[Dict[str, int]] = None,
             run: Optional[Dict[str, Any]] = None) -> None:
        """Write checkpoint ``step`` (asynchronously with ``async_save``: the arrays are copied
        off the devices before this returns, the files are written in the background).

        ``run``: the trajectory-defining config (:func:`run_identity`), checked on resume.

        Raises:
          CheckpointWriteError: the directory cannot be written (this save or, asynchronous,
            the previous one); the checkpoints before are intact.
        """
        ocp = self._ocp
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "step": int(step),
                "data_state": {k: int(v) for k, v in (data_state or {}).items()},
                "base_key": None if base_key is None else {"impl": str(jax.random.key_impl(base_key)),
                                                           "data": np.asarray(jax.random.key_data(base_key)).tolist()},
                "leaves": describe(params, opt_state), "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
                "process_count": jax.process_count(), "run": run}
        if self.async_save and self._unhashed:
            self.wait()  # orbax waits for the previous save: report its failure under its own step
        with self._hash_lock:
            self._unhashed.append(int(step))
        with self._writing(step):
            self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), meta=ocp.args.JsonSave(meta)))
        if not self.async_save:
            self._record_hashes()

    def wait(self) -> None:
        """Wait for an asynchronous save; record its hashes.

        Raises:
          CheckpointWriteError: it failed (named by its step).
        """
        with self._writing(self._unhashed[-1] if self._unhashed else None):
            self.manager.wait_until_finished()
        self._record_hashes()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()

    @contextlib.contextmanager
    def _writing(self, step: Optional[int]):
        """Any failure of orbax's writing becomes one :class:`CheckpointWriteError`."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds (OSError, ValueError...)
            what = f"checkpoint {step}" if step is not None else "a checkpoint"
            raise CheckpointWriteError(f"cannot write {what} to {self.directory}: {_first_line(e)}; "
                                       "the checkpoints before it are intact") from None

    # -- content hashes
    def _record_hashes(self) -> None:
        """Write this process's hash record of every step it saved that has committed: the
        sha256 of the files it wrote (:func:`_owner`), read back once, nobody else's.
        Idempotent; called from orbax's thread too."""
        me = jax.process_index()
        with self._hash_lock:
            left = []
            for i, step in enumerate(self._unhashed):
                d = os.path.join(self.directory, str(step))
                if not os.path.isdir(d):
                    left.append(step)  # not committed yet
                    continue
                try:
                    files = {rel: _hash_file(os.path.join(d, rel)) for rel in _listing(d) if _owner(rel) == me}
                    _write_record(d, me, files)
                except OSError as e:
                    self._unhashed = left + self._unhashed[i + 1:]
                    raise CheckpointWriteError(f"cannot write the content hashes of checkpoint {d}: "
                                               f"{e.strerror or e}") from None
            self._unhashed = left

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` (one line naming the file) unless checkpoint ``step``
        is whole: every process's record present and intact, the files those records list and
        no others, of their recorded sizes, and each process's share of the records (record
        ``r`` for process ``r % process_count``) matching its sha256; the processes agree on
        the first file that does not."""
        d = os.path.join(self.directory, str(step))
        where = f"checkpoint {d}"
        records = [self._read_record(d, 0)]
        for p in range(1, int(records[0].get("process_count", 1))):
            records.append(self._read_record(d, p))
        files = {rel: entry for r in records for rel, entry in r["files"].items()}
        names = sorted(files)
        actual = set(_listing(d))
        for rel in sorted(set(names) | actual):
            if rel not in actual:
                raise CheckpointError(f"{where}: corrupt: file {rel} is missing")
            if rel not in files and not _hidden(rel):
                raise CheckpointError(f"{where}: corrupt: file {rel} was not part of the saved checkpoint")
            if rel in files and os.path.getsize(os.path.join(d, rel)) != files[rel]["bytes"]:
                raise CheckpointError(f"{where}: corrupt: file {rel} does not match its sha256 (its size changed)")
        me, count = jax.process_index(), jax.process_count()
        mine = sorted(rel for p, r in enumerate(records) if p % count == me for rel in r["files"])
        bad = next((names.index(rel) for rel in mine if _hash_file(os.path.join(d, rel))["sha256"] != files[rel]["sha256"]),
                   len(names))
        if count > 1:
            from jax.experimental import multihost_utils

            bad = int(np.min(multihost_utils.process_allgather(np.int64(bad))))
        if bad < len(names):
            raise CheckpointError(f"{where}: corrupt: file {names[bad]} does not match its sha256 (altered or damaged)")

    def _read_record(self, d: str, p: int) -> Dict[str, Any]:
        where, name = f"checkpoint {d}", _record_name(p)
        try:
            with open(os.path.join(d, name), "rb") as f:
                record = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            self.read_meta(int(os.path.basename(d)))  # a checkpoint of an older format is refused as such
            raise CheckpointError(f"{where}: no content hashes ({name}): its save did not finish recording "
                                  "them, so it cannot be verified") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{where}: corrupt: its {name} cannot be read ({type(e).__name__})") from None
        files = record.get("files") if isinstance(record, dict) else None
        if not isinstance(files, dict) or record.get("sha256") != _digest_of(files, record.get("process_count")):
            raise CheckpointError(f"{where}: corrupt: its {name} does not match its own hash")
        return record

    def restorable_step(self, fallback: bool = False) -> Tuple[Optional[int], List[Tuple[int, str]]]:
        """``(step, corrupt)``: the step to resume from, the newest one that verifies
        (:meth:`verify`), or None if there is none; and the newer ``(step, why)`` that did not
        verify (only with ``fallback``). Nothing is moved: :meth:`set_aside` does that once
        the resume is accepted.

        Raises:
          CheckpointError: the newest is corrupt and not ``fallback``, or none is intact.
        """
        bad, chosen = [], None
        for step in sorted(self.all_steps(), reverse=True):
            try:
                self.verify(step)
                self._verified.add(step)
            except CheckpointError as e:
                if not fallback:
                    raise CheckpointError(f"{e}; refusing to restore it (--set checkpoint.fallback=true restores "
                                          "the newest intact checkpoint instead)") from None
                bad.append((step, str(e)))
                continue
            chosen = step
            break
        if bad and chosen is None:
            raise CheckpointError(f"no intact checkpoint in {self.directory}: {bad[0][1]}"
                                  + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return chosen, bad

    def set_aside(self, corrupt: List[Tuple[int, str]], chosen: int, log=None) -> None:
        """Rename the ``corrupt`` steps of :meth:`restorable_step` ``corrupt-<step>`` (kept,
        out of orbax's way) and say so; ``log``: where (default: stderr of process 0). Call it
        on every process."""
        if not corrupt:
            return
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        if jax.process_index() == 0:
            for step, why in corrupt:
                aside = _free_name(self.directory, f"corrupt-{step}")
                os.rename(os.path.join(self.directory, str(step)), aside)
                say(f"checkpoint: {why}; moved to {aside}; restoring step {chosen} instead")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jax_nvfp4_checkpoint_fallback")
        self.manager.reload()

    # -- restore
    def read_meta(self, step: int) -> Dict[str, Any]:
        where = os.path.join(self.directory, str(step))
        try:
            meta = self.manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 - any read failure is a bad checkpoint
            raise CheckpointError(f"checkpoint {where}: cannot read its metadata: {_first_line(e)}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {where}: not a {FORMAT} checkpoint")
        if meta.get("version") == 1:
            raise CheckpointError(
                f"checkpoint {where}: format version 1 (masters stored by logical values, before the tile "
                f"layout); this version reads format {FORMAT_VERSION}: resume it with version 0.1.0 or start anew")
        if meta.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {where}: format version {meta.get('version')}, this code reads {FORMAT_VERSION}")
        return meta

    def restore(self, step: int, abstract_params, abstract_state, param_shardings, state_shardings) -> Restored:
        """Restore checkpoint ``step`` (verified first) into the layout of ``abstract_params``
        / ``abstract_state`` (``jax.eval_shape`` trees for the current mesh) with the given
        shardings (``jax_nvfp4.shardings``): masters are re-padded for this mesh.

        Raises:
          CheckpointError: incompatible model/optimizer, unreadable files, or non-finite values.
        """
        ocp = self._ocp
        where = os.path.join(self.directory, str(step))
        if step not in self._verified:
            self.verify(step)
        meta = self.read_meta(step)
        saved = meta.get("leaves", {})
        expected = describe(abstract_params, abstract_state)
        strip = lambda d: {k: {f: v for f, v in e.items() if f != "tensor_split"} for k, e in d.items()}
        _check_compatible(where, strip(saved), strip(expected))
        # Leaves saved with another tensor split: read whole (one shard, no padding tiles),
        # then re-laid out for this mesh on the devices.
        resplit = {k: e["tensor_split"] for k, e in saved.items() if e.get("tensor_split") != expected[k].get("tensor_split")}
        abstract = {"params": abstract_params, "opt_state": abstract_state}
        names = [name for name, _ in _named(abstract, _is_node)]
        leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_node)
        shardings = treedef.flatten_up_to({"params": param_shardings, "opt_state": state_shardings})
        target = treedef.unflatten([_target(x, sh, resplit.get(n)) for n, x, sh in zip(names, leaves, shardings)])
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target, strict=False))).state
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {where}: cannot read its arrays: {_first_line(e)}") from None
        finite = jax.device_get(_finite(state))
        bad = [name for name, ok in finite.items() if not ok]
        if bad:
            raise CheckpointError(f"checkpoint {where}: non-finite values (NaN or Inf) in {bad[0]}"
                                  + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else "")
                                  + "; refusing to restore it")
        out = jax.tree.leaves(state, is_leaf=_is_node)
        moved = [i for i, n in enumerate(names) if n in resplit]
        if moved:  # every re-split leaf into this run's tiles, in one program
            layouts = [leaves[i].layout for i in moved]

            def relayout(xs):
                return [nv.TiledNVFP4.from_array(x.to_array(), lay) if isinstance(x, nv.TiledNVFP4)
                        else nv.Tiled.from_logical(x.logical(), lay) for x, lay in zip(xs, layouts)]

            done = jax.jit(relayout, out_shardings=[shardings[i] for i in moved])([out[i] for i in moved])
            for i, x in zip(moved, done):
                out[i] = x
        state = treedef.unflatten(out)
        base_key = None
        if meta.get("base_key"):
            k = meta["base_key"]
            base_key = jax.random.wrap_key_data(np.asarray(k["data"], np.uint32), impl=k["impl"])
        return Restored(int(meta["step"]), state["params"], state["opt_state"], base_key,
                        dict(meta.get("data_state") or {}))


def _target(leaf, sh, split):
    """The restore target of one leaf (``jax.ShapeDtypeStruct`` with its sharding); a tiled
    leaf saved with the tensor ``split`` as that layout's arrays, whole on every device."""
    sds = lambda shape, dtype, s: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=s)
    if split is None or not isinstance(leaf, (nv.Tiled, nv.TiledNVFP4)):
        return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), leaf, sh)
    nt, tdim = split
    lay = leaf.layout
    lay = nv.Layout(lay.matrix, 1, nt, tdim if nt > 1 else None, lay.data_axis, lay.tensor_axis if nt > 1 else None)
    whole = NamedSharding(jax.tree.leaves(sh)[0].mesh, P())
    batch = tuple(leaf.shape[:-2])
    if isinstance(leaf, nv.Tiled):
        return nv.Tiled(sds(lay.shape(batch), leaf.value.dtype, whole), lay)
    return nv.TiledNVFP4(sds(lay.shape(batch, (16, 8)), jnp.uint8, whole),
                         sds(lay.shape(batch, leaf.scale_bits.shape[len(batch) + 2:]), jnp.uint8, whole),
                         sds(leaf.amax_bits.shape, jnp.uint32, whole), lay, leaf.block)


def _check_compatible(where: str, saved: Dict[str, Any], expected: Dict[str, Any]) -> None:
    for name in expected:
        if name in saved and saved[name] != expected[name]:
            s, e = saved[name], expected[name]
            what = ", ".join(f"{k} {s.get(k)} in the checkpoint but {e.get(k)} here"
                             for k in sorted(set(s) | set(e)) if s.get(k) != e.get(k))
            raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: {name}: {what}")
    missing, extra = [k for k in expected if k not in saved], [k for k in saved if k not in expected]
    parts = ([f"{len(missing)} leaves of this run are not in it (e.g. {missing[0]})"] if missing else []) + \
            ([f"{len(extra)} of its leaves are not in this run (e.g. {extra[0]})"] if extra else [])
    if parts:
        raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: " + "; ".join(parts))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


# ----------------------------------------------------------------------------- hash records
_PROCESS_DIR = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")


def _owner(rel: str) -> int:
    """The process that writes the file ``rel`` of a step directory: orbax's per-process files
    (``state/ocdbt.process_<p>/...``, ``state/array_metadatas/process_<p>``) are process p's,
    the shared metadata process 0's."""
    m = _PROCESS_DIR.search(rel.replace(os.sep, "/"))
    return int(m.group(1)) if m else 0


def _record_name(p: int) -> str:
    return HASHES if p == 0 else HASHES.replace(".json", f".process_{p}.json")


def _listing(d: str) -> List[str]:
    """The relative paths of the files under ``d`` but the hash records (a listing; nothing read)."""
    out = []
    for root, dirs, files in os.walk(d):
        out += [os.path.relpath(os.path.join(root, f), d) for f in files]
    records = re.compile(re.escape(HASHES[:-5]) + r"(\.process_\d+)?\.json$")
    return sorted(rel for rel in out if not records.fullmatch(rel))


def _hash_file(path: str) -> Dict[str, Any]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": n}


def _hidden(rel: str) -> bool:
    """True for a path any of whose components is hidden (starts with a dot)."""
    return any(part.startswith(".") for part in rel.split(os.sep))


def _digest_of(files: Dict[str, Any], process_count) -> str:
    return hashlib.sha256(json.dumps([files, process_count], sort_keys=True).encode()).hexdigest()


def _write_record(d: str, p: int, files: Dict[str, Any]) -> None:
    tmp = os.path.join(d, f".{_record_name(p)}.tmp")
    with open(tmp, "w") as f:
        count = jax.process_count()
        json.dump({"files": files, "process_count": count, "sha256": _digest_of(files, count)}, f, indent=1,
                  sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, _record_name(p)))


def _free_name(directory: str, base: str) -> str:
    path, i = os.path.join(directory, base), 1
    while os.path.exists(path):
        i += 1
        path = os.path.join(directory, f"{base}-{i}")
    return path


# ----------------------------------------------------------------------------- resume rules
# Config keys whose change changes the training trajectory (the data, the model, the updates).
# The mesh is not one of them (restores reshard, bit-identically), nor train.steps itself: the
# schedule's length stands for it.
_TRAJECTORY = {
    "model": None,  # every key
    "data": ("source", "path", "val_path", "val_fraction", "seed", "markov_states", "batch_size"),
    "optim": ("name", "lr", "schedule", "warmup_steps", "weight_decay", "b1", "b2", "clip_norm", "grad_accum"),
    "nvfp4": ("weights", "compute", "keep_bf16", "keep_first_blocks", "keep_last_blocks", "stochastic_rounding",
              "cast_master_bf16", "grad_reduce_dtype"),
    "train": ("seed", "init_from"),
}


# Keys that checkpoints written before they existed do not record, with the value those had.
_BEFORE_RECORDED = {"nvfp4.block": "2d", "train.init_from": None}
# Keys that older checkpoints do not record and whose value then is unknown: not compared.
_UNKNOWN_BEFORE = ("data.val_path", "data.val_fraction", "data.path:content", "data.val_path:content")


def run_identity(cfg) -> Dict[str, Any]:
    """``{"section.key": value}`` of the config values a checkpoint's trajectory depends on,
    plus ``optim.schedule_steps`` resolved (the schedule's length) and ``train.steps``."""
    from train.config import to_dict

    d = to_dict(cfg)
    out = {}
    for section, keys in _TRAJECTORY.items():
        for k in (keys or d[section]):
            out[f"{section}.{k}"] = d[section][k]
    out["nvfp4.block"] = cfg.nvfp4.resolved_block()
    out["optim.schedule_steps"] = cfg.schedule_steps()
    out["train.steps"] = cfg.train.steps
    # The data files' content, not only their names (train.data.file_fingerprint).
    if cfg.data.source in ("file", "tokens"):
        from train.data import file_fingerprint

        for key in ("path", "val_path"):
            path = getattr(cfg.data, key)
            out[f"data.{key}:content"] = file_fingerprint(path) if path else None
    return out


def check_resume(where: str, meta: Dict[str, Any], cfg) -> None:
    """Refuse to resume checkpoint ``meta`` (read from ``where``) with ``cfg`` when that
    would not continue the same run: a changed model, data, optimizer, schedule length or
    NVFP4 recipe, or a checkpoint past ``train.steps``. Keys listed in
    ``checkpoint.allow_change`` may differ (the run then continues with the new values).

    Extending a run: raise ``train.steps`` and keep the schedule's length with
    ``optim.schedule_steps=<its length>`` (the learning rate then stays at the schedule's final
    value), or allow a new length with ``checkpoint.allow_change=[optim.schedule_steps]``
    (the schedule is rebuilt for the new length: the learning rate jumps).

    Raises:
      CheckpointError: one line naming what differs and how to override it.
    """
    step = int(meta.get("step", 0))
    if step > cfg.train.steps:
        raise CheckpointError(f"checkpoint {where} is at step {step}, past train.steps={cfg.train.steps}: nothing "
                              f"to train; raise train.steps to continue it, or use another checkpoint.dir")
    saved = meta.get("run")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {where}: it does not record its config; cannot check that this run "
                              "continues it")
    here = run_identity(cfg)
    allowed = set(cfg.checkpoint.allow_change)
    saved = {**_BEFORE_RECORDED, **saved}
    # A file's content may change where its name is allowed to ("data.path:content" goes with data.path).
    diffs = [k for k in here if k != "train.steps" and k.split(":")[0] not in allowed
             and not (k in _UNKNOWN_BEFORE and k not in saved) and _jsonish(saved.get(k)) != _jsonish(here[k])]
    if not diffs:
        return
    k = diffs[0]
    more = f" (and {len(diffs) - 1} more: {', '.join(diffs[1:4])})" if len(diffs) > 1 else ""
    if k.endswith(":content"):
        key = k.split(":")[0]
        was, now = saved.get(k) or {}, here[k] or {}
        raise CheckpointError(
            f"checkpoint {where} was trained on other data: {key}={getattr(cfg.data, key.split('.')[1])!r} now holds "
            f"{now.get('bytes')} bytes (sha256 {str(now.get('sha256'))[:12]}), the checkpoint's had {was.get('bytes')} "
            f"bytes (sha256 {str(was.get('sha256'))[:12]}){more}; resuming would train on different data. To continue "
            f"on the new content set checkpoint.allow_change=[{key}], or use another checkpoint.dir")
    if k == "optim.schedule_steps":
        hint = (f"to extend the run on its schedule set optim.schedule_steps={saved.get(k)}; to rebuild the "
                f"schedule for the new length set checkpoint.allow_change=[optim.schedule_steps]")
    else:
        hint = f"to continue with the new value set checkpoint.allow_change=[{k}], or use another checkpoint.dir"
    raise CheckpointError(f"checkpoint {where} was trained with {k}={_short(saved.get(k))} but this run has "
                          f"{k}={_short(here[k])}{more}; {hint}")


def _jsonish(v):
    return json.loads(json.dumps(v))


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
