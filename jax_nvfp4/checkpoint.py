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

Typical use, for any model::

    import orbax.checkpoint as ocp
    from jax_nvfp4 import checkpoint as nvck

    state = {"params": params, "opt_state": opt_state}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave({"leaves": nvck.describe(state)})))
    ...  # later, on another mesh: abstract state and shardings from jax.eval_shape / jax_nvfp4.shardings
    saved = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta["leaves"]
    if why := nvck.mismatch(saved, nvck.describe(abstract)):
        raise ValueError(why)
    targets = nvck.restore_targets(abstract, shardings, saved)
    raw = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(targets, strict=False)))
    state = nvck.relayout(raw.state, abstract, shardings, saved)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4.array import is_nvfp4
from jax_nvfp4.layout import Layout, Tiled, TiledNVFP4, is_tiled
from jax_nvfp4.params import path_str
from jax_nvfp4.sharding import logical

__all__ = ["describe", "host_arrays", "is_key", "mismatch", "nonfinite", "relayout", "restore_targets"]


def _is_node(x) -> bool:
    return is_nvfp4(x) or is_tiled(x)


def is_key(x) -> bool:
    """``x`` is a typed PRNG key array (or its abstract value)."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _named(tree, is_leaf=None) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]``, names as :func:`jax_nvfp4.params.path_str` gives them (``params/a/0/b``)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [(path_str(path), leaf) for path, leaf in flat]


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
            d = {"kind": "key", "shape": list(leaf.shape), "impl": str(getattr(leaf.dtype, "_impl", leaf.dtype))}
        else:
            d = {"kind": "array", "shape": list(np.shape(leaf)), "dtype": str(jnp.dtype(leaf.dtype))}
        if isinstance(leaf, (Tiled, TiledNVFP4)):
            d["tensor_split"] = [leaf.layout.n_tensor, leaf.layout.tensor_dim]
        out[name] = d
    return out


def mismatch(saved: Dict[str, Any], expected: Dict[str, Any]) -> str:
    """How the saved :func:`describe` differs from the target's, in one line naming the first leaf that differs
    (``""``: the state restores into it; a different tensor split does, re-laid out)."""
    strip = lambda d: {k: {f: v for f, v in e.items() if f != "tensor_split"} for k, e in d.items()}
    saved, expected = strip(saved), strip(expected)
    for name in expected:
        if name in saved and saved[name] != expected[name]:
            s, e = saved[name], expected[name]
            return f"{name}: " + ", ".join(f"{k} {s.get(k)} in the checkpoint but {e.get(k)} here"
                                           for k in sorted(set(s) | set(e)) if s.get(k) != e.get(k))
    missing, extra = [k for k in expected if k not in saved], [k for k in saved if k not in expected]
    return "; ".join(([f"{len(missing)} leaves of this run are not in it (e.g. {missing[0]})"] if missing else []) +
                     ([f"{len(extra)} of its leaves are not in this run (e.g. {extra[0]})"] if extra else []))


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
