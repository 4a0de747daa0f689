"""An NVFP4 training state saved with orbax and restored onto any mesh.

A state (params from :func:`jax_nvfp4.shard_params`, the :func:`jax_nvfp4.master_weights` optimizer state)
is an ordinary pytree of :class:`~jax_nvfp4.Tiled`, :class:`~jax_nvfp4.TiledNVFP4`, arrays and PRNG keys:
orbax's ``StandardSave`` writes it as it is, each process its own shards. Restoring it onto another mesh
needs what orbax does not know, and this module gives:

- :func:`describe`: every leaf's kind, logical shape, dtype or block and tensor split, to store beside the
  arrays; :func:`mismatch` says in one line how a saved description differs from a target's.
- :func:`restore_targets`: orbax restore targets. The tile axis is padded to the data-axis size, so a
  restore with ``StandardRestore(targets, strict=False)`` pads or truncates it for another data axis (the
  padding is zeros either way); a leaf saved with another tensor split is read whole in its saved layout.
- :func:`relayout`: those leaves re-laid out into the target's tiles, in one program.
- :func:`nonfinite` and :func:`host_arrays`: checks and bit-for-bit comparisons of restored states.
- :class:`Checkpointer`: all of it on orbax's ``CheckpointManager``: atomic steps, the newest ``keep``
  kept, asynchronous saves, each process's content hashes (:mod:`jax_nvfp4.integrity`) verified before
  a restore, a corrupt newest step refused or set aside, one-line errors.

Typical use, for any model::

    from jax_nvfp4 import checkpoint as nvck

    ckpt = nvck.Checkpointer("ckpt", keep=3)
    ckpt.save(step, {"params": params, "opt_state": opt_state}, meta={"data_position": pos})
    ...  # later, on another mesh: abstract state and shardings from jax.eval_shape / jax_nvfp4.shardings
    step, _ = ckpt.restorable_step()  # the newest that verifies (None: none saved); CheckpointError if corrupt
    if step is not None:
        state, meta = ckpt.restore(step, abstract, shardings)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4 import integrity, internals
from jax_nvfp4.array import is_nvfp4
from jax_nvfp4.layout import Layout, Tiled, TiledNVFP4, is_tiled
from jax_nvfp4.params import path_str
from jax_nvfp4.sharding import logical

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "describe", "host_arrays", "is_key", "mismatch",
           "nonfinite", "relayout", "restore_targets"]


def _is_node(x) -> bool:
    return is_nvfp4(x) or is_tiled(x)


def is_key(x) -> bool:
    """``x`` is a typed PRNG key array (or its abstract value)."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _named(tree, is_leaf=None) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]``, names as :func:`jax_nvfp4.params.path_str` gives them (``params/a/0/b``)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [(path_str(path), leaf) for path, leaf in flat]


def _key_impl(dtype) -> str:
    """A key dtype's implementation's short name, as its public ``str`` shows it (``key<fry>``: ``fry``)."""
    text = str(dtype)
    return text[4:-1] if text.startswith("key<") and text.endswith(">") else text


def describe(tree) -> Dict[str, Dict[str, Any]]:
    """``{leaf name: {kind, shape, dtype | block | impl[, tensor_split]}}`` of a state (arrays or ``jax.eval_shape``
    trees) in logical shapes: ``kind`` ``nvfp4`` / ``tiled`` / ``key`` / ``array``; ``tensor_split`` ``[shards,
    dim]`` of a tiled leaf. JSON-serializable; what :func:`mismatch` and :func:`restore_targets` read."""
    out = {}
    for name, leaf in _named(tree, _is_node):
        if is_nvfp4(leaf) or isinstance(leaf, TiledNVFP4):
            d = {"kind": "nvfp4", "shape": list(leaf.shape), "block": list(leaf.block)}
        elif isinstance(leaf, Tiled):
            d = {"kind": "tiled", "shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.value.dtype))}
        elif is_key(leaf):
            d = {"kind": "key", "shape": list(leaf.shape), "impl": _key_impl(leaf.dtype)}
        else:
            d = {"kind": "array", "shape": list(np.shape(leaf)),  # a Python scalar: as jnp.asarray types it
                 "dtype": str(jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else jnp.result_type(leaf))}
        if isinstance(leaf, (Tiled, TiledNVFP4)):
            d["tensor_split"] = [leaf.layout.n_tensor, leaf.layout.tensor_dim]
        out[name] = d
    return out


def mismatch(saved: Dict[str, Any], expected: Dict[str, Any], *, partial: bool = False) -> str:
    """How the saved :func:`describe` differs from the target's, in one line naming the first leaf that differs
    (``""``: the state restores into it; a different tensor split does, re-laid out). ``partial``: leaves of the
    checkpoint the target does not have are no difference (a restore of part of the state)."""
    strip = lambda d: {k: {f: v for f, v in e.items() if f != "tensor_split"} for k, e in d.items()}
    saved, expected = strip(saved), strip(expected)
    for name in expected:
        if name in saved and saved[name] != expected[name]:
            s, e = saved[name], expected[name]
            return f"{name}: " + ", ".join(f"{k} {s.get(k)} in the checkpoint but {e.get(k)} here"
                                           for k in sorted(set(s) | set(e)) if s.get(k) != e.get(k))
    missing, extra = [k for k in expected if k not in saved], [k for k in saved if k not in expected and not partial]
    return "; ".join(([f"{len(missing)} leaves of this run are not in it (e.g. {missing[0]})"] if missing else []) +
                     ([f"{len(extra)} of its leaves are not in this run (e.g. {extra[0]})"] if extra else []))


def _structure_mismatch(on_disk, target, path: str = "", partial: bool = False) -> str:
    """Where the containers of ``target`` (a state or its ``jax.eval_shape``) differ from those orbax's
    metadata tree ``on_disk`` records (dicts, lists, tuples; a namedtuple as a dict of its fields, an empty
    one as None), in one line (``""``: alike; ``partial``: a dict of ``target`` may hold fewer entries). The
    arrays themselves are :func:`mismatch`'s."""
    def disk_kind(x):
        if x is None:
            return "nothing", None
        if isinstance(x, Mapping):
            return f"the entries {sorted(map(str, x))}", {str(k): v for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return f"a sequence of {len(x)}", {str(i): v for i, v in enumerate(x)}
        return "an array", None

    def target_kind(x):
        if x is None:
            return "nothing", None
        leaves = jax.tree.leaves(x)
        if _is_node(x) or (len(leaves) == 1 and leaves[0] is x):
            return "an array", None
        kids = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
        if type(x) in (list, tuple):
            return f"a sequence of {len(kids)}", {str(i): v for i, (_, v) in enumerate(kids)}
        if not kids and not isinstance(x, Mapping):
            return "nothing", None  # an empty namedtuple (optax's EmptyState) or node
        return f"the entries {sorted(path_str(p) for p, _ in kids)}", {path_str(p): v for p, v in kids}

    (a, on_disk), (b, target) = disk_kind(on_disk), target_kind(target)
    if b == "an array" and a != "nothing":  # a Tiled or TiledNVFP4 is a mapping on disk
        return ""
    entries = partial and a.startswith("the entries") and b.startswith("the entries") and set(target) <= set(on_disk)
    if a != b and not entries:
        return f"{path or 'the state'}: {a} in the checkpoint but {b} here"
    for k in target or ():
        if why := _structure_mismatch(on_disk[k], target[k], f"{path}/{k}" if path else k, partial):
            return why
    return ""


def _resplit(saved: Dict[str, Any], abstract) -> Dict[str, Any]:
    """``{leaf name: saved tensor split}`` of the leaves saved with another split than ``abstract``'s."""
    expected = describe(abstract)
    return {k: e["tensor_split"] for k, e in saved.items()
            if k in expected and e.get("tensor_split") != expected[k].get("tensor_split")}


def _target(leaf, sh, split: Optional[List[int]]):
    """The restore target of one leaf (a ``jax.ShapeDtypeStruct`` with its sharding); a tiled leaf saved with the
    tensor ``split``: that layout's arrays, whole on every device."""
    sds = lambda shape, dtype, s: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=s)
    if split is None or not isinstance(leaf, (Tiled, TiledNVFP4)):
        return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), leaf, sh)
    (nt, tdim), lay = split, leaf.layout
    lay = Layout(lay.matrix, 1, nt, tdim if nt > 1 else None, lay.data_axis, lay.tensor_axis if nt > 1 else None)
    whole, batch = NamedSharding(jax.tree.leaves(sh)[0].mesh, P()), tuple(leaf.shape[:-2])
    if isinstance(leaf, Tiled):
        return Tiled(sds(lay.shape(batch), leaf.value.dtype, whole), lay)
    return TiledNVFP4(sds(lay.shape(batch, (16, 8)), jnp.uint8, whole),
                      sds(lay.shape(batch, leaf.scale_bits.shape[len(batch) + 2:]), jnp.uint8, whole),
                      sds(leaf.amax_bits.shape, jnp.uint32, whole), lay, leaf.block)


def restore_targets(abstract, shardings, saved: Dict[str, Any]):
    """The tree of ``jax.ShapeDtypeStruct`` (with shardings) to pass to orbax's ``StandardRestore(..., strict=False)``
    for the state ``abstract`` (``jax.eval_shape`` of it) placed by ``shardings`` (a matching tree, one
    ``NamedSharding`` per array), saved as ``saved`` (its :func:`describe`)."""
    resplit = _resplit(saved, abstract)
    names = [name for name, _ in _named(abstract, _is_node)]
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_node)
    shs = treedef.flatten_up_to(shardings)
    return treedef.unflatten([_target(x, sh, resplit.get(n)) for n, x, sh in zip(names, leaves, shs)])


def relayout(restored, abstract, shardings, saved: Dict[str, Any]):
    """``restored`` (orbax's result for :func:`restore_targets`) with the leaves saved with another tensor split
    re-laid out into ``abstract``'s tiles and ``shardings``, in one program; the values are unchanged bit for bit."""
    resplit = _resplit(saved, abstract)
    names = [name for name, _ in _named(abstract, _is_node)]
    moved = [i for i, n in enumerate(names) if n in resplit]
    if not moved:
        return restored
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_node)
    shs, out = treedef.flatten_up_to(shardings), jax.tree.leaves(restored, is_leaf=_is_node)

    def one(x, like):
        if isinstance(x, TiledNVFP4):
            return TiledNVFP4.from_array(x.to_array(), like.layout)
        return Tiled.from_logical(x.logical(), like.layout)

    done = jax.jit(lambda xs: [one(x, leaves[i]) for i, x in zip(moved, xs)],
                   out_shardings=[shs[i] for i in moved])([out[i] for i in moved])
    for i, x in zip(moved, done):
        out[i] = x
    return treedef.unflatten(out)


@jax.jit
def _finite(tree) -> Dict[str, jax.Array]:
    out = {}
    for name, x in _named(tree):
        x = jax.lax.bitcast_convert_type(x, jnp.float32) if name.endswith("/amax_bits") else x
        if not is_key(x) and jnp.issubdtype(x.dtype, jnp.floating):
            out[name] = jnp.all(jnp.isfinite(x.astype(jnp.float32)))
    return out


def nonfinite(tree) -> List[str]:
    """The names of the float leaves of ``tree`` holding a NaN or Inf (NVFP4 amaxes read as the floats of their
    bits), in tree order."""
    return [name for name, ok in jax.device_get(_finite(tree)).items() if not ok]


def host_arrays(tree) -> Dict[str, np.ndarray]:
    """``{name: host array}`` of a state's logical values (NVFP4 leaves as ``data``, ``scale_bits``,
    ``amax_bits``; keys as key data), to compare states bit for bit across meshes. Single-process."""
    tree = jax.jit(logical)(tree)  # one program
    return {name: np.asarray(jax.random.key_data(x) if is_key(x) else x) for name, x in _named(tree)}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, unreadable, another model's, non-finite); one line."""


class CheckpointWriteError(Exception):
    """A checkpoint that could not be written (the storage failed); the ones before it are intact. One line."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


# The keys of a checkpoint's ``meta`` the checkpointer writes itself: the step it was saved as (a step folder
# renamed or copied is then told from the step it names) and the state's description.
RESERVED = ("saved_step", "leaves")


class Checkpointer:
    """Saves and restores states under ``directory``: orbax step folders ``<directory>/<step>`` holding ``state``
    (the pytree, each process writing its shards), ``meta`` (JSON: the caller's ``meta``, ``saved_step`` and ``leaves``,
    :func:`describe` of the state) and each process's content hashes; the ``keep`` newest kept. ``async_save``:
    saves write in the background, their hashes recorded once committed. Every process creates it and calls
    :meth:`save`, :meth:`restorable_step`, :meth:`verify` and :meth:`restore` together; the directory is shared.
    Errors name the directory ``{dir_name}={directory!r}`` and say how to restore past a corrupt step
    (``fallback_hint``); a subclass may name its own settings. ``keep``: at least 1, or None (every step).
    """

    dir_name = "directory"
    fallback_hint = "restorable_step(fallback=True) restores the newest intact checkpoint instead"

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = False):
        name = self.dir_name
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r}: must be a positive number of checkpoints, or None to keep every one")
        import orbax.checkpoint as ocp

        self._ocp, self.async_save = ocp, async_save
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)  # a file there: FileExistsError
        except OSError as e:
            raise CheckpointError(f"{name}={directory!r}: cannot create it: {e.strerror or e}") from None
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise CheckpointError(f"{name}={directory!r}: not readable and writable")
        self._unhashed: List[int] = []  # steps saved here whose hash record is not written yet
        self._verified: set = set()
        self._hash_lock = threading.Lock()
        # Asynchronous: hashes recorded once a save has committed; the temporary directory made in
        # save(), so an unwritable one fails there (not in orbax's threads, 5 minutes at exit).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=functools.partial(self._record_hashes, True),
                                           create_directories_asynchronously=False) if async_save else None)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # noqa: BLE001 - an unusable directory is a user error
            raise CheckpointError(f"{name}={directory!r}: cannot use it: {_first_line(e)}") from None
        with contextlib.suppress(OSError):  # orbax removes a killed save's temporary directory in the background
            internals.await_orbax_tmp_cleanup(self.manager)

    def _dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def all_steps(self) -> List[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: Optional[Dict[str, Any]] = None) -> None:
        """Write checkpoint ``step`` of ``state`` with the JSON ``meta`` (``async_save``: in the background);
        ``step`` must be newer than every step in the directory. CheckpointWriteError: this save (or the previous
        asynchronous one) failed; CheckpointError: the step is not newer, or ``state`` holds non-finite values
        (:meth:`restore` would refuse them); TypeError: ``meta`` is not a JSON object, or holds a key of
        :data:`RESERVED`."""
        ocp = self._ocp
        reserved = [k for k in RESERVED if isinstance(meta, Mapping) and k in meta]
        if not isinstance(meta := {} if meta is None else meta, Mapping) or reserved:
            raise TypeError(f"meta: expected a mapping without the keys {', '.join(map(repr, RESERVED))} (what the "
                            f"checkpointer records), got {type(meta).__name__}"
                            + (f" with {reserved[0]!r}" if reserved else ""))
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(f"meta: not JSON-serializable: {e}") from None
        # The steps on disk too: another Checkpointer of this folder may have written newer ones since this one
        # listed them (its save would silently replace theirs).
        on_disk = [int(n) for n in os.listdir(self.directory) if n.isdigit()] if os.path.isdir(self.directory) else []
        latest = max([s for s in (self.manager.latest_step(), *on_disk) if s is not None], default=None)
        if latest is not None and int(step) <= latest:
            raise CheckpointError(f"checkpoint {step} not written: {self.directory} holds step {latest}, and a "
                                  "save must be newer than the newest (restore from an earlier step: remove the "
                                  "newer ones first)")
        bad = nonfinite(state)
        if bad:  # restore refuses them: a newest checkpoint that can never be restored
            raise CheckpointError(f"checkpoint {step} not written: non-finite values (NaN or Inf) in {bad[0]}"
                                  + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""))
        leaves = describe(state)
        empty = [name for name, d in leaves.items() if 0 in d["shape"]]
        if empty:  # orbax refuses them in the write, which would read as a storage failure
            shape = tuple(leaves[empty[0]]["shape"])
            raise CheckpointError(f"checkpoint {step} not written: {empty[0]} has shape {shape}, no elements, which "
                                  "orbax cannot save; keep it out of the state")
        meta = {**meta, "saved_step": int(step), "leaves": leaves}
        if self.async_save and self._unhashed:
            self.wait()  # orbax waits for the previous save: report its failure under its own step
        with self._hash_lock:
            self._unhashed.append(int(step))
        with self._writing(step):
            self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                 meta=ocp.args.JsonSave(meta)))
        if not self.async_save:
            self._record_hashes()

    def wait(self) -> None:
        """Wait for an asynchronous save and record its hashes (CheckpointWriteError: it failed)."""
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
        except (CheckpointError, CheckpointWriteError):
            raise
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds (OSError, ValueError...)
            what = f"checkpoint {step}" if step is not None else "a checkpoint"
            raise CheckpointWriteError(f"cannot write {what} to {self.directory}: {_first_line(e)}; "
                                       "the checkpoints before it are intact") from None

    def _record_hashes(self, finalized: bool = False) -> None:
        """Write this process's hash record of each committed step it saved (idempotent). ``finalized``: orbax's
        thread, once a save's files are final and before its temporary directory takes the step's name (a process
        ending between the two, or before the next save, would leave a checkpoint no resume accepts): the record
        goes into that directory."""
        with self._hash_lock:
            for step in list(self._unhashed):
                where = self._dir(step)
                if not os.path.isdir(where) and finalized:
                    tmp = glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*"))
                    where = tmp[0] if len(tmp) == 1 and os.path.isdir(tmp[0]) else where
                if not os.path.isdir(where):
                    continue
                self._unhashed.remove(step)  # committed, or its files final
                try:
                    integrity.record(where)
                except OSError as e:
                    raise CheckpointWriteError(f"cannot write the content hashes of checkpoint {self._dir(step)}: "
                                               f"{e.strerror or e}") from None

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` (one line naming the file) unless checkpoint ``step`` holds
        what its processes recorded (:func:`jax_nvfp4.integrity.verify`, on every process). A save of
        this process still under way is waited for first."""
        if self._unhashed:
            self.wait()
        try:
            integrity.verify(self._dir(step))
        except integrity.IntegrityError as e:
            if isinstance(e, integrity.Unrecorded):
                self.read_meta(step)  # a subclass's read_meta refuses a checkpoint of another format as such
            raise CheckpointError(f"checkpoint {self._dir(step)}: {e}") from None
        self.read_meta(step)  # the step it holds (a folder renamed or copied verifies: its hashes are relative)

    def restorable_step(self, fallback: bool = False) -> Tuple[Optional[int], List[Tuple[int, str]]]:
        """``(step, corrupt)``: the newest step that verifies (None: there is none) and, with
        ``fallback``, the newer ``(step, why)`` that did not (:meth:`set_aside` moves them).
        CheckpointError: the newest is corrupt and not ``fallback``, or none is intact."""
        bad = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                self.verify(step)
            except CheckpointError as e:
                if not fallback:
                    raise CheckpointError(f"{e}; refusing to restore it ({self.fallback_hint})") from None
                bad.append((step, str(e)))
                continue
            self._verified.add(step)
            return step, bad
        if bad:
            raise CheckpointError(f"no intact checkpoint in {self.directory}: {bad[0][1]}"
                                  + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return None, bad

    def set_aside(self, corrupt: List[Tuple[int, str]], chosen: int, log: Optional[Callable[[str], Any]] = None):
        """Rename the ``corrupt`` steps of :meth:`restorable_step` ``corrupt-<step>`` and say so
        (``log``; default: process 0's stderr). On every process."""
        if not corrupt:
            return
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        if jax.process_index() == 0:
            for step, why in corrupt:
                aside, i = os.path.join(self.directory, f"corrupt-{step}"), 1
                while os.path.exists(aside):
                    i += 1
                    aside = os.path.join(self.directory, f"corrupt-{step}-{i}")
                os.rename(self._dir(step), aside)
                say(f"{why}; moved to {aside}; restoring step {chosen} instead")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("jax_nvfp4_checkpoint_fallback")
        self.manager.reload()

    def read_meta(self, step: int) -> Dict[str, Any]:
        """Checkpoint ``step``'s ``meta`` (CheckpointError: it cannot be read)."""
        try:
            meta = self.manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 - any read failure is a bad checkpoint
            raise CheckpointError(f"checkpoint {self._dir(step)}: cannot read its metadata: {_first_line(e)}") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {self._dir(step)}: its metadata is not a JSON object")
        if meta.get("saved_step", step) != step:  # a checkpoint written before the step was recorded has none
            raise CheckpointError(f"checkpoint {self._dir(step)}: holds step {meta['saved_step']!r}, not {step} (its "
                                  "folder was renamed or copied)")
        return meta

    def _structure_mismatch(self, where: str, abstract, partial: bool) -> str:
        """:func:`_structure_mismatch` of checkpoint folder ``where`` and ``abstract`` (``""`` where its
        metadata cannot be read: the caller's error stands)."""
        from etils import epath  # orbax's path type

        try:
            on_disk = self._ocp.StandardCheckpointHandler().metadata(epath.Path(where) / "state")
        except Exception:  # noqa: BLE001
            return ""
        return _structure_mismatch(getattr(on_disk, "tree", on_disk), abstract, partial=partial)

    def restore(self, step: int, abstract, shardings, *, partial: bool = False) -> Tuple[Any, Dict[str, Any]]:
        """``(state, meta)`` of checkpoint ``step`` (verified first), in the layout of ``abstract`` (``jax.eval_shape``
        of the state) placed by ``shardings``, whatever data axis and tensor split it was saved from.
        ``partial``: ``abstract`` may be part of the saved state, e.g. ``{"params": ...}`` of a saved ``{"params":
        ..., "opt_state": ...}`` (an evaluation or serving job: only those arrays are read); its leaves must still
        match the checkpoint's. CheckpointError: corrupt or unreadable files, another model or optimizer,
        non-finite values."""
        if step is None:
            raise CheckpointError(f"no checkpoint to restore in {self.directory}")
        where = self._dir(step)
        if step not in self._verified:
            self.verify(step)
        meta = self.read_meta(step)
        saved = meta.get("leaves", {})
        expected = describe(abstract)
        why = mismatch(saved, expected, partial=partial)
        if why:
            tops, extra = {k.split("/")[0] for k in expected}, [k for k in saved if k not in expected]
            part = not partial and all(k in saved for k in expected) and all(k.split("/")[0] not in tops for k in extra)
            raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: {why}"
                                  + (" (restore(..., partial=True) reads part of a state)" if part else ""))
        targets = restore_targets(abstract, shardings, saved)  # ValueError: shardings do not match abstract
        try:
            if partial:  # orbax's PyTree handler reads the saved state's subtree (StandardRestore reads it whole)
                from etils import epath  # orbax's path type

                ocp = self._ocp
                args = jax.tree.map(lambda a: dataclasses.replace(a, strict=False) if hasattr(a, "strict") else a,
                                    ocp.checkpoint_utils.construct_restore_args(targets))
                state = ocp.PyTreeCheckpointHandler().restore(epath.Path(where) / "state", args=ocp.args.PyTreeRestore(
                    targets, restore_args=args, partial_restore=True))
            else:
                args = self._ocp.args.Composite(state=self._ocp.args.StandardRestore(targets, strict=False))
                state = self.manager.restore(step, args=args).state
        except Exception as e:  # noqa: BLE001
            # Another optax chain around the same arrays (adamw's three states, adam's two) is named.
            refused = any(w in str(e) for w in ("tree structure", "Length mismatch"))  # orbax's, either reader's
            why = self._structure_mismatch(where, abstract, partial) if refused else ""
            if why:
                raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: {why}") from None
            raise CheckpointError(f"checkpoint {where}: cannot read its arrays: {_first_line(e)}") from None
        bad = nonfinite(state)
        if bad:
            raise CheckpointError(f"checkpoint {where}: non-finite values (NaN or Inf) in {bad[0]}"
                                  + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else "")
                                  + "; refusing to restore it")
        return relayout(state, abstract, shardings, saved), meta  # leaves saved with another tensor split
