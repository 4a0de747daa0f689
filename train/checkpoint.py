"""Checkpoints of the whole training state, with orbax-checkpoint.

What one checkpoint (``<dir>/<step>/``) holds:

- ``state``: every array of the params (``TiledNVFP4`` leaves as their packed ``data``,
  ``scale_bits`` and ``amax_bits``) and of the optimizer state, in the tile-major layout they
  live in (:mod:`jax_nvfp4.layout`), each process writing its own shards. The layout depends
  on the data-axis size only through the zero tiles that pad each matrix's tile list to a
  multiple of it, so a checkpoint restores onto any data-axis size: orbax reads each target
  shard straight from the files into its device, padding or truncating the tile axis (only
  zero tiles are dropped or added); leaves saved with another tensor-axis split are read whole
  and re-laid out on the devices. Typed PRNG keys
  (the wrapper's stochastic rounding key) are saved as their key data.
- ``meta`` (JSON): the step, the data iterator position, the loop's base PRNG key, and a
  description of every saved leaf (kind, logical shape, dtype, block), checked on restore so
  that a checkpoint of another model or optimizer is refused with a one-line error naming the
  first leaf that differs.
- ``meta["run"]``: the config values that define the training trajectory (model, data
  source, seed and validation split, the data files' content fingerprints, optimizer, schedule
  length, NVFP4 recipe); :func:`check_resume` compares them with the resuming run's config.
- ``jax_nvfp4.sha256.json``: the sha256 of every file of the step directory, written by
  process 0 once the save has committed (for asynchronous saves, from orbax's
  post-finalization callback). Hashing the finished files rather than the arrays keeps it
  independent of how the arrays are laid out and written (sharded, several processes), and
  costs no device-to-host copy. :meth:`Checkpointer.verify` checks it before anything is
  read; a checkpoint without it (a save killed between its commit and the record) is not
  trusted either.

Saves are atomic: orbax writes into a temporary directory and renames it to ``<step>`` once
every process has written its shards; a save interrupted at any point leaves the previous
checkpoints untouched, and a later :class:`Checkpointer` removes the leftover temporary
directory. Restores refuse non-finite values (NaN/Inf) in params, masters or optimizer state,
and files whose content hash does not match; :meth:`Checkpointer.restorable_step` with
``fallback`` picks the newest intact checkpoint instead; :meth:`Checkpointer.set_aside` renames
the damaged ones ``corrupt-<step>`` (never deleted) once the resume is accepted. Hidden files
(``.DS_Store``) that were not saved are ignored by the verification; any other extra file fails
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
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
# 1: masters saved by their logical values; 2: the tile layout, content hashes (HASHES) and
# the trajectory-defining config (meta["run"]).
FORMAT_VERSION = 2
HASHES = "jax_nvfp4.sha256.json"
_NVFP4_FIELDS = ("data", "scale_bits", "amax_bits")


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


# ----------------------------------------------------------------------------- tree <-> names
def _is_node(x) -> bool:
    return nv.is_nvfp4(x) or nv.is_tiled(x)


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaves(tree, prefix: str) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]`` with ``TiledNVFP4`` and ``Tiled`` nodes as leaves; names are
    ``prefix/a/b/0/c`` (see :func:`jax_nvfp4.path_str`)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)
    out = []
    for path, leaf in flat:
        name = "/".join(p for p in (prefix, nv.path_str(path)) if p)
        for part in name.split("/"):
            if not part or "." in part:
                raise ValueError(f"cannot checkpoint the leaf {name!r}: path components must be non-empty and without '.'")
        out.append((name, leaf))
    return out


def describe(params, opt_state) -> Dict[str, Dict[str, Any]]:
    """``{leaf name: {kind, shape, dtype[, block, nvfp4]}}`` of what a checkpoint of this state
    holds, independent of the mesh (logical shapes). Works on arrays and on
    ``jax.ShapeDtypeStruct`` trees (``jax.eval_shape``)."""
    out = {}
    for name, leaf in _leaves(params, "params") + _leaves(opt_state, "opt_state"):
        if nv.is_nvfp4(leaf) or isinstance(leaf, nv.TiledNVFP4):
            out[name] = {"kind": "nvfp4", "shape": list(leaf.shape), "block": list(leaf.block)}
            if isinstance(leaf, nv.TiledNVFP4):
                out[name]["tensor_split"] = [leaf.layout.n_tensor, leaf.layout.tensor_dim]
        elif isinstance(leaf, nv.Tiled):
            out[name] = {"kind": "tiled", "shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.value.dtype)),
                         "tensor_split": [leaf.layout.n_tensor, leaf.layout.tensor_dim]}
        elif _is_key(leaf):
            out[name] = {"kind": "key", "shape": list(leaf.shape), "impl": _key_impl_name(leaf.dtype)}
        else:
            out[name] = {"kind": "array", "shape": list(np.shape(leaf)), "dtype": str(jnp.dtype(leaf.dtype))}
    return out


def _key_impl_name(dtype) -> str:
    """The PRNG implementation name (``"threefry2x32"``) of a typed key dtype; works for
    abstract keys too, where ``jax.random.key_impl`` does not."""
    impl = getattr(dtype, "_impl", None)
    return str(getattr(impl, "name", None) or dtype)


def host_arrays(params, opt_state) -> Dict[str, np.ndarray]:
    """``{name: host array}`` of a state's logical values (NVFP4 leaves as their logical
    packed bytes, masters and moments unpadded, key data), for comparing states bit for bit
    across meshes; names as in :func:`describe` (NVFP4 leaves split into ``name/data``,
    ``name/scale_bits``, ``name/amax_bits``). Single-process."""
    out = {}
    # Every relayout in one program (op by op, each would compile its own for each mesh).
    params, opt_state = jax.jit(nv.logical)((params, opt_state))
    for name, leaf in _leaves(params, "params") + _leaves(opt_state, "opt_state"):
        if nv.is_nvfp4(leaf):
            for f in _NVFP4_FIELDS:
                out[f"{name}/{f}"] = np.asarray(getattr(leaf, f))
        elif _is_key(leaf):
            out[name] = np.asarray(jax.random.key_data(leaf))
        else:
            out[name] = np.asarray(leaf)
    return out


def _nest(flat: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _flatten_nested(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten_nested(v, name))
        else:
            out[name] = v
    return out


# ----------------------------------------------------------------------------- save form
def _arrays(params, opt_state) -> Dict[str, Any]:
    """``{name: array}``: what a checkpoint stores, as the state holds it (sharded; no copy)."""
    out = {}
    for name, leaf in _leaves(params, "params") + _leaves(opt_state, "opt_state"):
        if isinstance(leaf, nv.TiledNVFP4):
            for f in _NVFP4_FIELDS:
                out[f"{name}/{f}"] = getattr(leaf, f)
        elif isinstance(leaf, nv.Tiled):
            out[name] = leaf.value
        elif _is_key(leaf):
            out[name] = jax.random.key_data(leaf)
        else:
            out[name] = leaf
    return out


@jax.jit
def _finite(flat: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """``{name: all values finite}`` for the float leaves of a flat state (amaxes, stored as
    their float32 bits, included), in one program per state structure (a check per leaf
    would compile one program per leaf shape)."""
    out = {}
    for name, x in flat.items():
        if name.endswith("/amax_bits"):
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        if jnp.issubdtype(x.dtype, jnp.floating):
            out[name] = jnp.all(jnp.isfinite(x.astype(jnp.float32)))
    return out


# ----------------------------------------------------------------------------- the manager
class Checkpointer:
    """Saves and restores training states under ``directory`` (one ``orbax`` step directory
    per checkpoint; the ``keep`` most recent are kept).

    Every process of a multi-process run must create it and call :meth:`save` /
    :meth:`restore` together (orbax synchronises them); the directory must be shared.
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
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            # A save killed before its atomic rename leaves a temporary directory: remove it.
            cleanup_tmp_directories=True,
            # Record the content hashes as soon as an asynchronous save has committed. The step's
            # temporary directory is created before save() returns: a directory that cannot be
            # written fails the save there, where the caller sees it, instead of leaving orbax's
            # background threads waiting for a creation signal that never comes (they held the
            # process at its exit for orbax's 5-minute coordination timeout).
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_hashes,
                                           create_directories_asynchronously=False) if async_save else None,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # noqa: BLE001 - an unusable directory is a user error
            raise CheckpointError(f"checkpoint.dir={directory!r}: cannot use it: {_first_line(e)}") from None
        # orbax removes leftovers in the background; finish now so the directory is tidy
        # (best effort: a leftover never hides or damages a committed checkpoint).
        try:
            getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        except OSError:
            pass

    # -- queries
    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None (temporary directories of unfinished saves
        are not steps)."""
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
        ocp = self._ocp  # (the layouts travel with the state's Tiled / TiledNVFP4 nodes)
        flat = _arrays(params, opt_state)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": int(step),
            "data_state": {k: int(v) for k, v in (data_state or {}).items()},
            "base_key": None if base_key is None else {
                "impl": str(jax.random.key_impl(base_key)),
                "data": np.asarray(jax.random.key_data(base_key)).tolist(),
            },
            "leaves": describe(params, opt_state),
            "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
            "process_count": jax.process_count(),
            "run": run,
        }
        if self.async_save and self._unhashed:
            # orbax waits for the previous save before it starts this one: wait here, so that
            # a failure of that save is reported under its own step.
            self.wait()
        with self._hash_lock:
            self._unhashed.append(int(step))
        with self._writing(step):
            self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(_nest(flat)), meta=ocp.args.JsonSave(meta)))
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

    # -- content hashes
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

    def _record_hashes(self) -> None:
        """Write the hash record of every step this object saved that has committed (process
        0; others only forget them). Idempotent; called from orbax's thread too."""
        with self._hash_lock:
            left = []
            for i, step in enumerate(self._unhashed):
                d = os.path.join(self.directory, str(step))
                if not os.path.isdir(d):
                    left.append(step)  # not committed yet
                    continue
                if jax.process_index() == 0:
                    try:
                        _write_record(d, _hash_files(d))
                    except OSError as e:
                        self._unhashed = left + self._unhashed[i + 1:]
                        raise CheckpointWriteError(f"cannot write the content hashes of checkpoint {d}: "
                                                   f"{e.strerror or e}") from None
            self._unhashed = left

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` (one line naming the file) unless every file of
        checkpoint ``step`` matches the sha256 recorded when it was saved."""
        d = os.path.join(self.directory, str(step))
        where = f"checkpoint {d}"
        rec = os.path.join(d, HASHES)
        try:
            with open(rec, "rb") as f:
                record = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            self.read_meta(step)  # a checkpoint of an older format is refused as such, in one line
            raise CheckpointError(f"{where}: no content hashes ({HASHES}): its save did not finish recording "
                                  "them, so it cannot be verified") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{where}: corrupt: its {HASHES} cannot be read ({type(e).__name__})") from None
        files = record.get("files") if isinstance(record, dict) else None
        if not isinstance(files, dict) or record.get("sha256") != _digest_of(files):
            raise CheckpointError(f"{where}: corrupt: its {HASHES} does not match its own hash")
        actual = _hash_files(d)
        for name in sorted(set(files) | set(actual)):
            if name not in actual:
                raise CheckpointError(f"{where}: corrupt: file {name} is missing")
            if name not in files and _hidden(name):
                continue  # e.g. a .DS_Store a file browser left: not part of the checkpoint, not read
            if name not in files:
                raise CheckpointError(f"{where}: corrupt: file {name} was not part of the saved checkpoint")
            if files[name] != actual[name]:
                raise CheckpointError(f"{where}: corrupt: file {name} does not match its sha256 (altered or damaged)")

    def restorable_step(self, fallback: bool = False) -> Tuple[Optional[int], List[Tuple[int, str]]]:
        """``(step, corrupt)``: the step to resume from, the newest one that verifies
        (:meth:`verify`), or None if there is none; and the newer ``(step, why)`` that did not
        verify (only with ``fallback``). Nothing is moved: :meth:`set_aside` does that once
        the resume is accepted.

        Args:
          fallback: if the newest is corrupt, take the newest intact one instead.

        Raises:
          CheckpointError: the newest is corrupt and not ``fallback``, or none is intact.
        """
        steps = sorted(self.all_steps(), reverse=True)
        bad = []
        chosen = None
        for step in steps:
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
        out of orbax's way: their steps will be saved again) and say so; ``log``: where
        (default: stderr of process 0). Call it on every process."""
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
        ocp = self._ocp
        where = os.path.join(self.directory, str(step))
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
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
        """Restore checkpoint ``step`` into the layout of ``abstract_params`` /
        ``abstract_state`` (``jax.eval_shape`` trees for the current mesh) with the given
        shardings (``jax_nvfp4.shardings``): masters are re-padded for this mesh.

        Raises:
          CheckpointError: incompatible model/optimizer, unreadable files, or non-finite values.
        """
        ocp = self._ocp
        where = os.path.join(self.directory, str(step))
        if step not in self._verified:
            self.verify(step)
        meta = self.read_meta(step)
        saved_leaves = meta.get("leaves", {})
        expected = describe(abstract_params, abstract_state)
        strip = lambda d: {k: {f: v for f, v in e.items() if f != "tensor_split"} if isinstance(e, dict) else e
                           for k, e in d.items()}
        _check_compatible(where, strip(saved_leaves), strip(expected))
        # Leaves saved with another tensor split: read whole (one shard, no padding tiles),
        # then re-laid out for this mesh on the devices.
        resplit = {k: e["tensor_split"] for k, e in saved_leaves.items()
                   if isinstance(e, dict) and "tensor_split" in e and e["tensor_split"] != expected[k].get("tensor_split")}
        targets = _targets(abstract_params, param_shardings, "params", resplit)
        targets.update(_targets(abstract_state, state_shardings, "opt_state", resplit))
        restore_args = _nest({k: ocp.ArrayRestoreArgs(sharding=sh, global_shape=shape, dtype=dtype, strict=False)
                              for k, (shape, dtype, sh) in targets.items()})
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(restore_args=restore_args))).state
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {where}: cannot read its arrays: {_first_line(e)}") from None
        flat = _flatten_nested(state)
        missing = sorted(set(targets) - set(flat))
        if missing:
            raise CheckpointError(f"checkpoint {where}: arrays missing: {missing[0]}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        finite = jax.device_get(_finite({name: flat[name] for name in targets}))
        bad = [name for name in targets if not finite.get(name, True)]
        if bad:
            raise CheckpointError(f"checkpoint {where}: non-finite values (NaN or Inf) in {bad[0]}"
                                  + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else "")
                                  + "; refusing to restore it")

        params = _assemble(abstract_params, param_shardings, flat, "params", resplit)
        opt_state = _assemble(abstract_state, state_shardings, flat, "opt_state", resplit)
        base_key = None
        if meta.get("base_key"):
            k = meta["base_key"]
            base_key = jax.random.wrap_key_data(np.asarray(k["data"], np.uint32), impl=k["impl"])
        return Restored(int(meta["step"]), params, opt_state, base_key, dict(meta.get("data_state") or {}))


def _saved_layout(leaf, split) -> "nv.Layout":
    nt, tdim = split
    lay = leaf.layout
    return nv.Layout(lay.matrix, 1, nt, tdim if nt > 1 else None, lay.data_axis, lay.tensor_axis if nt > 1 else None)


def _targets(abstract, shardings, prefix: str, resplit) -> Dict[str, tuple]:
    """``{name: (global shape, dtype, sharding)}`` of every array to restore."""
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_node)
    shard_leaves = treedef.flatten_up_to(shardings)
    names = [name for name, _ in _leaves(abstract, prefix)]
    out = {}
    for name, leaf, sh in zip(names, leaves, shard_leaves):
        if isinstance(leaf, (nv.Tiled, nv.TiledNVFP4)) and name in resplit:
            lay = _saved_layout(leaf, resplit[name])
            whole = NamedSharding(jax.tree.leaves(sh)[0].mesh, P())
            batch = tuple(leaf.shape[:-2])
            if isinstance(leaf, nv.TiledNVFP4):
                out[f"{name}/data"] = (lay.shape(batch, (16, 8)), jnp.uint8, whole)
                out[f"{name}/scale_bits"] = (lay.shape(batch, leaf.scale_bits.shape[len(batch) + 2:]), jnp.uint8, whole)
                out[f"{name}/amax_bits"] = (tuple(leaf.amax_bits.shape), jnp.uint32, whole)
            else:
                out[name] = (lay.shape(batch), leaf.value.dtype, whole)
        elif isinstance(leaf, nv.TiledNVFP4):
            for f in _NVFP4_FIELDS:
                a = getattr(leaf, f)
                out[f"{name}/{f}"] = (tuple(a.shape), a.dtype, getattr(sh, f))
        elif isinstance(leaf, nv.Tiled):
            out[name] = (tuple(leaf.value.shape), leaf.value.dtype, sh.value)
        elif _is_key(leaf):
            out[name] = (tuple(leaf.shape) + (2,), jnp.uint32, NamedSharding(sh.mesh, P()))
        else:
            out[name] = (tuple(leaf.shape), leaf.dtype, sh)
    return out


def _assemble(abstract, shardings, flat: Dict[str, Any], prefix: str, resplit):
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_node)
    shard_leaves = treedef.flatten_up_to(shardings)
    names = [name for name, _ in _leaves(abstract, prefix)]
    out, moved = [], []  # moved: (index in out, this run's layout, sharding) of the re-split leaves
    for name, leaf, sh in zip(names, leaves, shard_leaves):
        if isinstance(leaf, nv.TiledNVFP4):
            out.append(nv.TiledNVFP4(*(flat[f"{name}/{f}"] for f in _NVFP4_FIELDS),
                                     _saved_layout(leaf, resplit[name]) if name in resplit else leaf.layout, leaf.block))
        elif isinstance(leaf, nv.Tiled):
            out.append(nv.Tiled(flat[name], _saved_layout(leaf, resplit[name]) if name in resplit else leaf.layout))
        elif _is_key(leaf):
            impl = _key_impl_name(leaf.dtype)
            out.append(jax.random.wrap_key_data(flat[name], impl=impl))
        else:
            out.append(flat[name])
        if name in resplit and isinstance(leaf, (nv.Tiled, nv.TiledNVFP4)):
            moved.append((len(out) - 1, leaf.layout, sh))
    if moved:
        # Saved with another tensor split: every such leaf into this run's tiles, in one program.
        layouts = [lay for _, lay, _ in moved]

        def relayout(xs):
            return [nv.TiledNVFP4.from_array(x.to_array(), lay) if isinstance(x, nv.TiledNVFP4)
                    else nv.Tiled.from_logical(x.logical(), lay) for x, lay in zip(xs, layouts)]

        done = jax.jit(relayout, out_shardings=[sh for _, _, sh in moved])([out[i] for i, _, _ in moved])
        for (i, _, _), x in zip(moved, done):
            out[i] = x
    return treedef.unflatten(out)


def _check_compatible(where: str, saved: Dict[str, Any], expected: Dict[str, Any]) -> None:
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    for name in expected:
        if name in saved and saved[name] != expected[name]:
            s, e = saved[name], expected[name]
            what = ", ".join(f"{k} {s.get(k)} in the checkpoint but {e.get(k)} here"
                             for k in sorted(set(s) | set(e)) if s.get(k) != e.get(k))
            raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: {name}: {what}")
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} leaves of this run are not in it (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} of its leaves are not in this run (e.g. {extra[0]})")
        raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: " + "; ".join(parts))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


# ----------------------------------------------------------------------------- content hashes
def _hash_files(d: str) -> Dict[str, str]:
    """``{relative path: sha256}`` of every file under ``d`` but the hash record."""
    out = {}
    for root, dirs, files in os.walk(d):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, d)
            if rel == HASHES:
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[rel] = h.hexdigest()
    return out


def _hidden(rel: str) -> bool:
    """True for a path any of whose components is hidden (starts with a dot)."""
    return any(part.startswith(".") for part in rel.split(os.sep))


def _digest_of(files: Dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _write_record(d: str, files: Dict[str, str]) -> None:
    tmp = os.path.join(d, f".{HASHES}.tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files, "sha256": _digest_of(files)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, HASHES))


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
