"""Checkpoints of the whole training state, with orbax-checkpoint.

What one checkpoint (``<dir>/<step>/``) holds:

- ``state``: every array of the params (``NVFP4Array`` leaves as their packed ``data``,
  ``scale_bits`` and ``amax_bits``) and of the optimizer state. Float32 masters — and every
  master-shaped leaf of the inner optimizer state (Adam moments...), which are
  :class:`~jax_nvfp4.MasterArray` nodes too — are saved by their LOGICAL (unpadded) values, so
  a checkpoint does not depend on the mesh: it restores onto any data/tensor axis sizes, where
  they are padded again into that mesh's layout. Typed PRNG keys (the wrapper's stochastic
  rounding key) are saved as their key data.
- ``meta`` (JSON): the step, the data iterator position, the loop's base PRNG key, and a
  description of every saved leaf (kind, logical shape, dtype, block), checked on restore so
  that a checkpoint of another model or optimizer is refused with a one-line error naming the
  first leaf that differs.

Saves are atomic: orbax writes into a temporary directory and renames it to ``<step>`` once
every process has written its shards; a save interrupted at any point leaves the previous
checkpoints untouched, and a later :class:`Checkpointer` removes the leftover temporary
directory. Restores refuse non-finite values (NaN/Inf) in params, masters or optimizer state.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from train.config import ConfigError

__all__ = ["CheckpointError", "Checkpointer", "Restored", "describe", "host_arrays", "FORMAT", "FORMAT_VERSION"]

FORMAT = "jax_nvfp4.train.checkpoint"
FORMAT_VERSION = 1
_NVFP4_FIELDS = ("data", "scale_bits", "amax_bits")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (incompatible, corrupt, non-finite); one line."""


@dataclasses.dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any
    base_key: Optional[jax.Array]
    data_state: Dict[str, int]


# ----------------------------------------------------------------------------- tree <-> names
def _is_node(x) -> bool:
    return nv.is_nvfp4(x) or isinstance(x, nv.MasterArray)


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaves(tree, prefix: str) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]`` with ``NVFP4Array`` and ``MasterArray`` nodes as leaves; names are
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
        if nv.is_nvfp4(leaf):
            out[name] = {"kind": "nvfp4", "shape": list(leaf.shape), "block": list(leaf.block)}
        elif isinstance(leaf, nv.MasterArray):
            out[name] = {"kind": "master", "shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.value.dtype)),
                         "nvfp4": bool(leaf.nvfp4)}
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
    """``{name: host array}`` of what a checkpoint of this state holds (logical masters, key
    data), for comparing states bit for bit; names as in :func:`describe` (NVFP4 leaves
    split into ``name/data``, ``name/scale_bits``, ``name/amax_bits``). Single-process."""
    out = {}
    for name, leaf in _leaves(params, "params") + _leaves(opt_state, "opt_state"):
        if nv.is_nvfp4(leaf):
            for f in _NVFP4_FIELDS:
                out[f"{name}/{f}"] = np.asarray(getattr(leaf, f))
        elif isinstance(leaf, nv.MasterArray):
            out[name] = np.asarray(leaf.logical())
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
def _logical_spec(mw, mesh, rules: nv.Rules) -> P:
    """The master's partition spec, minus the axes that do not divide the logical shape."""
    spec = tuple(nv.partition_specs({"m": mw}, mesh, rules)["m"].value)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    entries = []
    for d, e in zip(mw.shape, spec):
        entries.append(e if e is not None and d % sizes.get(e, 1) == 0 else None)
    return P(*entries)


def _saveable_fn(params, opt_state, mesh, rules: nv.Rules):
    """A jitted function ``(params, opt_state) -> {name: array}``: the mesh-independent save
    form (logical masters, key data), sharded where the logical shapes allow."""
    named = _leaves(params, "params") + _leaves(opt_state, "opt_state")
    replicated = NamedSharding(mesh, P())

    def kept(x):  # the array's own layout when it lives on this mesh, else replicated
        sh = getattr(x, "sharding", None)
        return sh if isinstance(sh, NamedSharding) and sh.mesh == mesh else replicated

    shardings = {}
    for name, leaf in named:
        if nv.is_nvfp4(leaf):
            for f in _NVFP4_FIELDS:
                shardings[f"{name}/{f}"] = kept(getattr(leaf, f))
        elif isinstance(leaf, nv.MasterArray):
            shardings[name] = NamedSharding(mesh, _logical_spec(leaf, mesh, rules))
        elif _is_key(leaf):
            shardings[name] = replicated
        else:
            shardings[name] = kept(leaf)

    def fn(params, opt_state):
        out = {}
        for name, leaf in _leaves(params, "params") + _leaves(opt_state, "opt_state"):
            if nv.is_nvfp4(leaf):
                for f in _NVFP4_FIELDS:
                    out[f"{name}/{f}"] = getattr(leaf, f)
            elif isinstance(leaf, nv.MasterArray):
                out[name] = leaf.logical()
            elif _is_key(leaf):
                out[name] = jax.random.key_data(leaf)
            else:
                out[name] = jnp.asarray(leaf)
        return out

    return jax.jit(fn, out_shardings=shardings)


# ----------------------------------------------------------------------------- restore form
def _put(value: np.ndarray, sharding) -> jax.Array:
    """A global array with ``sharding`` from a host copy every process holds."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def _nonfinite(value: np.ndarray) -> bool:
    if value.dtype.kind == "f" or value.dtype.name in ("bfloat16",) or value.dtype.name.startswith("float8"):
        return not bool(np.all(np.isfinite(value.astype(np.float32))))
    return False


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            # A save killed before its atomic rename leaves a temporary directory: remove it.
            cleanup_tmp_directories=True,
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
        self._save_fn = None
        self._save_key = None

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
    def save(self, step: int, params, opt_state, *, mesh, rules: Optional[nv.Rules] = None,
             base_key: Optional[jax.Array] = None, data_state: Optional[Dict[str, int]] = None) -> None:
        """Write checkpoint ``step`` (asynchronously with ``async_save``: the arrays are copied
        off the devices before this returns, the files are written in the background)."""
        ocp = self._ocp
        rules = rules or nv.Rules()
        key = (jax.tree.structure(params, is_leaf=_is_node), jax.tree.structure(opt_state, is_leaf=_is_node), id(mesh))
        if self._save_key != key:
            self._save_fn, self._save_key = _saveable_fn(params, opt_state, mesh, rules), key
        flat = self._save_fn(params, opt_state)
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
            "mesh": {str(k): int(v) for k, v in zip(mesh.axis_names, mesh.axis_sizes)},
            "process_count": jax.process_count(),
        }
        self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(_nest(flat)), meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

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
        meta = self.read_meta(step)
        _check_compatible(where, meta.get("leaves", {}), describe(abstract_params, abstract_state))

        expect = {}
        for name, leaf in _leaves(abstract_params, "params") + _leaves(abstract_state, "opt_state"):
            if nv.is_nvfp4(leaf):
                for f in _NVFP4_FIELDS:
                    expect[f"{name}/{f}"] = None
            else:
                expect[name] = None
        restore_args = _nest({k: ocp.RestoreArgs(restore_type=np.ndarray) for k in expect})
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(restore_args=restore_args))).state
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {where}: cannot read its arrays: {_first_line(e)}") from None
        flat = _flatten_nested(state)
        missing = sorted(set(expect) - set(flat))
        if missing:
            raise CheckpointError(f"checkpoint {where}: arrays missing: {missing[0]}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        bad = [name for name in expect if _nonfinite(_finite_view(name, flat[name]))]
        if bad:
            raise CheckpointError(f"checkpoint {where}: non-finite values (NaN or Inf) in {bad[0]}"
                                  + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else "")
                                  + "; refusing to restore it")

        params = _assemble(abstract_params, param_shardings, flat, "params")
        opt_state = _assemble(abstract_state, state_shardings, flat, "opt_state")
        base_key = None
        if meta.get("base_key"):
            k = meta["base_key"]
            base_key = jax.random.wrap_key_data(np.asarray(k["data"], np.uint32), impl=k["impl"])
        return Restored(int(meta["step"]), params, opt_state, base_key, dict(meta.get("data_state") or {}))


def _finite_view(name: str, value: np.ndarray) -> np.ndarray:
    # NVFP4 amax is stored as its float32 bit pattern; the packed bytes have no NaN.
    if name.endswith("/amax_bits"):
        return np.asarray(value).view(np.float32)
    if name.endswith("/data") or name.endswith("/scale_bits"):
        return np.zeros(0, np.float32)
    return np.asarray(value)


def _assemble(abstract, shardings, flat: Dict[str, np.ndarray], prefix: str):
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_node)
    shard_leaves = treedef.flatten_up_to(shardings)
    names = [name for name, _ in _leaves(abstract, prefix)]
    out = []
    for name, leaf, sh in zip(names, leaves, shard_leaves):
        if nv.is_nvfp4(leaf):
            out.append(nv.NVFP4Array(*(_put(flat[f"{name}/{f}"], getattr(sh, f)) for f in _NVFP4_FIELDS),
                                     leaf.matrix_shape, leaf.block))
        elif isinstance(leaf, nv.MasterArray):
            logical = np.asarray(flat[name])
            pad = [(0, p - s) for p, s in zip(leaf.value.shape, logical.shape)]
            value = np.pad(logical, pad) if any(b for _, b in pad) else logical
            out.append(nv.MasterArray(_put(value.astype(leaf.value.dtype), sh.value), leaf.shape,
                                      leaf.data_dim, leaf.tensor_dim, leaf.nvfp4))
        elif _is_key(leaf):
            impl = _key_impl_name(leaf.dtype)
            data = _put(np.asarray(flat[name], np.uint32), sh)
            out.append(jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=sh)(data))
        else:
            out.append(_put(np.asarray(flat[name]).astype(leaf.dtype), sh))
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
