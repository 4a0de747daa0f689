"""``master_weights``: an optax wrapper that keeps float32 masters for NVFP4 parameters.

The wrapper holds the float32 master of every parameter (NVFP4 or not) in its state, in the
parameter's own layout (:mod:`jax_nvfp4.layout`: tile-major and sharded over the data axis for
large leaves, replicated for small ones), runs any optax transform on the masters,
re-quantizes each NVFP4 leaf shard by shard with the global amax, and returns updates that
``optax.apply_updates`` adds to the old params to give exactly the new ones:

- NVFP4 leaves: all three leaves (packed data, scale bytes, amax bits) are unsigned integers,
  so their update is the wrap-around difference, which ``p + u`` undoes exactly. The result is
  bit-identical to quantizing the whole unsharded master, and (for stored
  :class:`~jax_nvfp4.layout.TiledNVFP4` params) it is the stored shard itself: no relayout.
- float32 leaves: the inner optimizer's own update, as plain optax applies it, which the
  master also adds. The param equals its master bit for bit where XLA computes the two
  additions alike; XLA:CPU recomputes the update in each addition's fusion and may contract
  one of them into a multiply-add, so a float32 plain param (a norm scale, a bias) can sit a
  few ulp from its master (up to 6 over 200 Adam steps of a ``(16, 1)`` leaf).
- Narrower float leaves (bf16): ``master.astype(dtype) - p`` in float32, which ``p + u``
  reproduces (exactly whenever old and new values are within a factor 2**16).

Non-finite gradients, or an update that makes a master non-finite (a float32 overflow), skip the
step (master, params, inner state and key unchanged; the skip is counted in the state). What to
do about a skipped step is the host's decision: :func:`raise_if_skipped`, called after the step,
turns it into an error.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import types
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jax_nvfp4.array import NVFP4Array, is_nvfp4
from jax_nvfp4.collectives import OPTIMIZER_SCOPE
from jax_nvfp4.layout import Tiled, TiledNVFP4, is_tiled
from jax_nvfp4.params import DEFAULT_POLICY, Policy, path_str, shared_amaxes
from jax_nvfp4.rules import DEFAULT_RULES, Rules, batch_axes, layout_for
from jax_nvfp4.sharding import (_split_spec, constrain, context_mesh, global_amax, global_norm, requantize,
                                scatter_replicated, shard_params, shardings, typed_mesh)


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`.

    Attributes:
      master: params-structured tree of float32 masters: :class:`~jax_nvfp4.layout.Tiled`
        (sharded) for large leaves, plain arrays for small replicated ones.
      inner_state: the inner transform's state (over the masters).
      skipped: int32 count of steps skipped for non-finite gradients or masters.
      key: PRNG key for stochastic re-quantization (None when off).
    """

    master: Any
    inner_state: Any
    skipped: jax.Array
    key: Optional[jax.Array]


def _is_param_leaf(x) -> bool:
    return is_nvfp4(x) or is_tiled(x)


# Collections a Linen model writes in its call (mutable=...), not weights.
_MODEL_STATE = {"batch_stats", "cache", "intermediates"}

# The policies of the master_weights inits a state_init traces (it may be wrapped: chain, MultiSteps...).
_INIT_POLICIES: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("master_weights_policies",
                                                                                 default=None)


def master_weights(
    inner: optax.GradientTransformation,
    *,
    policy: Optional[Policy] = None,
    mesh=None,
    rules: Optional[Rules] = None,
    data_axis: str = "data",
    stochastic_rounding: bool = False,
    key: Optional[jax.Array] = None,
    cast_master_bf16: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it updates float32 masters of NVFP4 params.

    Args:
      inner: any optax transformation (``adamw``, ``chain(clip_by_global_norm, adamw)``,
        ``MultiSteps``, ``inject_hyperparams(...)``...). It sees the master tree.
      policy: which float leaves passed to ``init`` are NVFP4 params (the policy given to
        ``quantize_params``; default the default policy). ``NVFP4Array`` leaves always are.
        Its ``four_over_six`` applies to every re-quantization.
      mesh: the mesh; default the context mesh (``jax.set_mesh``), else (in the update) the mesh
        the masters' types name on Explicit axes, else none (one device).
      rules: sharding rules (data/tensor axes); default data axis ``data_axis``.
      stochastic_rounding: re-quantize with stochastic rounding (key carried in the state).
      key: PRNG key for stochastic rounding (default ``jax.random.key(0)``).
      cast_master_bf16: cast the master to bf16 before quantizing (as Transformer Engine does).

    ``init(params)`` takes the float32 tree (the master is exactly it; ``policy`` says which
    leaves are NVFP4) or a tree with ``NVFP4Array`` leaves (the master starts from their
    dequantized values). ``update(grads, state, params)`` needs ``params``; ``grads`` are float
    and shaped like the dequantized weights, or already in the masters' layout
    (:class:`~jax_nvfp4.layout.Tiled` shards from :func:`~jax_nvfp4.fetch.gather_weight`).
    """
    rules = rules or dataclasses.replace(DEFAULT_RULES, data_axis=data_axis)
    policy = policy or DEFAULT_POLICY

    def init_fn(params):
        if (seen := _INIT_POLICIES.get()) is not None:
            seen.append((policy, cast_master_bf16))
        if isinstance(params, Mapping) and "params" in params and (state := sorted(set(params) & _MODEL_STATE)):
            raise TypeError(f"master_weights: the params hold Flax's {state[0]!r} collection: every leaf given is "
                            "trained as a weight, so its statistics would be; pass variables['params'] and keep the "
                            "state the model writes (nn.BatchNorm's, with mutable=[...]) out of the params")
        m = context_mesh(mesh)

        def one(path, leaf):
            p = path_str(path)
            if isinstance(leaf, TiledNVFP4):
                return Tiled(leaf.dequantize_tiles(jnp.float32), leaf.layout)
            # A float32 param's master is a copy, never the param's own buffer: the step
            # donates both.
            if isinstance(leaf, Tiled):
                return Tiled(jnp.array(leaf.value, jnp.float32, copy=True), leaf.layout)
            if not is_nvfp4(leaf) and not jnp.issubdtype(dtype := jnp.asarray(leaf).dtype, jnp.floating):
                raise TypeError(f"master_weights: param {p!r} is {dtype}: only float params are trained (each has a "
                                "float32 master); keep integer, boolean and RNG-key state out of the params tree "
                                "(NNX: nnx.split(model, nnx.Param, ...))")
            nvfp4 = is_nvfp4(leaf) or policy.wants(p, leaf, rules.stacked_axes(p))
            value = leaf.dequantize(jnp.float32) if is_nvfp4(leaf) else jnp.array(leaf, jnp.float32, copy=True)
            lay = layout_for(p, value.shape, nvfp4, m, rules)
            return Tiled.from_logical(value, lay) if lay is not None else value

        master = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_param_leaf)
        master = _constrain_master(master, m)
        k = None
        if stochastic_rounding:
            k = key if key is not None else jax.random.key(0)
        tiles = any(isinstance(t, Tiled) for t in jax.tree.leaves(master, is_leaf=is_tiled))
        if tiles:
            _refuse_tile_blind(inner)
        inner_state = inner.init(master)
        _refuse_matrix_state(inner_state, master)
        return MasterWeightsState(
            master=master,
            inner_state=inner_state,
            skipped=jnp.zeros([], jnp.int32),
            key=k,
        )

    def update_fn(grads, state: MasterWeightsState, params=None, **extra):
        with jax.named_scope(OPTIMIZER_SCOPE):
            return _update(grads, state, params, **extra)

    def _update(grads, state: MasterWeightsState, params=None, **extra):
        if params is None:
            raise ValueError("master_weights: update(grads, state, params) needs the current params")
        for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_nvfp4)[0]:
            if is_nvfp4(g):
                raise TypeError(f"master_weights: the gradient of {path_str(path)!r} is an NVFP4Array; gradients "
                                "must be float arrays shaped like the dequantized weights (take them with respect "
                                "to nv.dequantize_params(params), not the NVFP4 params)")
        _check_stored_form(params, state.master)
        m = context_mesh(mesh) or typed_mesh(state.master)
        grads_m = _grads_to_master(grads, state.master, m)
        fresh = jax.eval_shape(inner.init, state.master)
        if jax.tree.structure(fresh) != jax.tree.structure(state.inner_state):  # else optax fails in its own words
            kinds = lambda s: (f"({', '.join(map(kinds, s))})" if type(s) in (tuple, list) else type(s).__name__)
            raise ValueError("master_weights: the optimizer state was built by another inner optimizer than this "
                             f"one's (a state {kinds(state.inner_state)} where its init makes {kinds(fresh)}); build "
                             "the state with the tx that steps it")
        updates_m, inner_state = inner.update(grads_m, state.inner_state, state.master, **extra)
        # The update of a float32 plain param is materialised once: master + u and param + u
        # are then the same addition (XLA may otherwise contract one of them into a
        # multiply-add). Other leaves keep their update fused into the master's.
        f32_plain = _f32_plain_mask(params, updates_m)
        updates_m = jax.tree.map(lambda u, b: jax.lax.optimization_barrier(u) if b else u, updates_m, f32_plain)
        master = optax.apply_updates(state.master, updates_m)
        # Padding stays zero (re-quantization reads whole tiles) whatever the inner transform adds there.
        master = jax.tree.map(lambda x: x.zero_padding() if isinstance(x, Tiled) else x, master, is_leaf=is_tiled)
        master = _constrain_master(master, m)
        # Non-finite gradients skip the step, and so does an update that overflows a master (finite
        # gradients, a float32 sum past its range): one verdict over both.
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((grads_m, master))]))

        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        master = keep(master, state.master)
        inner_state = _keep_state_after_master(inner, finite, inner_state, state.inner_state, master)
        new_key, sub = (None, None)
        if state.key is not None:
            new_key, sub = jax.random.split(state.key)
            new_key = keep(new_key, state.key)

        paths_p, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_param_leaf)
        try:
            leaves_m = treedef.flatten_up_to(master)
            leaves_u = treedef.flatten_up_to(updates_m)
        except (ValueError, TypeError) as e:
            raise ValueError(f"master_weights: params do not match the state's masters: {e}") from None
        # Shared amaxes (policy.shared_amax): each group's members re-quantize with the maximum
        # of their global amaxes, the same bits on every shard.
        shared = shared_amaxes({path_str(path): global_amax(mw, m, cast_bf16=cast_master_bf16)
                                for (path, p), mw in zip(paths_p, leaves_m)
                                if isinstance(p, (TiledNVFP4, NVFP4Array)) and isinstance(mw, Tiled)
                                and policy.amax_group(path_str(path))}, policy)
        updates = []
        for i, ((path, p), mw, um) in enumerate(zip(paths_p, leaves_m, leaves_u)):
            name = path_str(path)
            if _backs_nvfp4(p) and not isinstance(mw, Tiled):
                raise ValueError(f"master_weights: parameter {name} is NVFP4 but its master was initialised as "
                                 "a plain leaf; pass the same policy to quantize_params and master_weights")
            if isinstance(p, (TiledNVFP4, NVFP4Array)):
                if isinstance(p, TiledNVFP4) and p.layout != mw.layout:
                    raise ValueError(f"master_weights: parameter {name} has layout {p.layout} but its master "
                                     f"{mw.layout}; pass the same mesh and rules to shard_params and master_weights")
                k = jax.random.fold_in(sub, i) if sub is not None else None
                q = requantize(mw, m, block=p.block, key=k, cast_bf16=cast_master_bf16, amax=shared.get(name),
                               four_over_six=policy.four_over_six)
                if isinstance(p, NVFP4Array):
                    q = q.to_array()  # params kept logical by the caller: a relayout of bytes
                updates.append(nvfp4_delta(p, keep(q, p)))
            elif hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating):
                updates.append(_plain_update(p, mw, um, finite))
            else:
                updates.append(jax.tree.map(jnp.zeros_like, p))
        new_state = MasterWeightsState(
            master=master,
            inner_state=inner_state,
            skipped=state.skipped + (~finite).astype(jnp.int32),
            key=new_key,
        )
        return jax.tree.unflatten(treedef, updates), new_state

    update_fn.master_weights = True  # what is_master_weights reads
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Optax transforms that would compute something else on the masters' tiles than on the matrices, with nothing in
# their state to show it (see _refuse_matrix_state for those whose state does): what each does.
_TILE_BLIND = {
    "clip_by_block_rms": "clips each leaf by its root mean square, which the zero padding of the tiles lowers",
    "scale_by_param_block_rms": "scales each leaf by its root mean square, which the zero padding of the tiles lowers",
    "adaptive_grad_clip": "clips by norms along a leaf's axes, which are the tiles' axes, not its rows and columns",
    "centralize": "subtracts means along a leaf's axes, which are the tiles' axes, not its rows and columns",
    "lookahead": "keeps fast and slow weights in the params it updates (optax.LookaheadParams), which the masters "
                 "are not",
}


def _factories(x, seen: set) -> set:
    """The names of the functions that make up the optax transform ``x``: the factories whose local functions its
    ``init`` and ``update`` are, found through closures, partials, bound methods and optax's own objects."""
    if id(x) in seen:
        return set()
    seen.add(id(x))
    found = set()
    if isinstance(x, (tuple, list)):
        parts = list(x)
    elif isinstance(x, dict):
        parts = list(x.values())
    elif isinstance(x, types.MethodType):  # a bound method (optax.MultiSteps.update)
        parts = [x.__func__, x.__self__]
    elif isinstance(x, types.FunctionType):
        parts = []
        for cell in x.__closure__ or ():
            try:
                parts.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
        if (x.__module__ or "").startswith("optax"):
            found.add(x.__qualname__.split(".<locals>")[0])
        else:  # a function of the user's (a factory given to inject_hyperparams): the optax functions it names
            names = x.__code__.co_names
            for name in names:
                g = x.__globals__.get(name)
                if isinstance(g, types.ModuleType) and g.__name__.startswith("optax"):
                    parts += [f for f in (getattr(g, n, None) for n in names) if isinstance(f, types.FunctionType)]
                elif isinstance(g, types.FunctionType):
                    parts.append(g)
    elif isinstance(x, functools.partial):
        parts = [x.func, *x.args, *x.keywords.values()]
    elif type(x).__module__.startswith("optax"):
        parts = list(vars(x).values()) if hasattr(x, "__dict__") else []
    else:
        parts = []
    for part in parts:
        found |= _factories(part, seen)
    return found


def _refuse_tile_blind(inner) -> None:
    """TypeError if ``inner`` contains a transform of :data:`_TILE_BLIND`."""
    for name in sorted(_factories(inner, set()) & set(_TILE_BLIND)):
        raise TypeError(f"master_weights: the inner transform contains optax.{name}, which {_TILE_BLIND[name]}: on "
                        "the masters, stored as 16x16 tiles, it would compute something else than on the matrices. "
                        "Use element-wise transforms and global norms (adam, adamw, lion, sgd, clip_by_global_norm, "
                        "...)")


def _refuse_matrix_state(inner_state, master) -> None:
    """The inner optimizer sees each matrix's master as its 16x16 tiles ``[..., nt, T, 16, 16]``:
    element-wise state (the tiles' shape) and per-matrix scalars are what they are for the
    matrix; any other state (factored moments, per-row or per-column statistics) was built from
    the tiles' axes, not the matrix's rows and columns, and is refused."""
    tiles = {t.value.shape for t in jax.tree.leaves(master, is_leaf=is_tiled) if isinstance(t, Tiled)}
    # Muon picks its matrices by their number of axes (the tiles have four): its state would be
    # masked out and every matrix silently trained by its Adam branch.
    muon = getattr(getattr(optax, "contrib", None), "MuonState", ())
    if tiles and any(isinstance(x, muon) for x in jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(x, muon))):
        raise TypeError("master_weights: the inner optimizer is Muon, which orthogonalises each matrix by its rows and "
                        "columns; it would see 16x16 tiles and train every matrix with its Adam branch. Use an "
                        "element-wise optimizer (adam, adamw, lion, sgd, ...)")
    for path, node in jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=is_tiled)[0]:
        if not isinstance(node, Tiled):
            continue
        for leaf in jax.tree.leaves(node.value):
            if jnp.shape(leaf) != () and jnp.shape(leaf) not in tiles:
                raise TypeError(
                    f"master_weights: the inner optimizer keeps state of shape {jnp.shape(leaf)} at "
                    f"{jax.tree_util.keystr(path)} for a matrix stored as 16x16 tiles {node.layout.matrix}: it sees "
                    "the tiles, not the matrix's rows and columns, so transforms that factor or precondition a "
                    "matrix (adafactor, sm3, shampoo, muon) are not supported; use an element-wise one (adam, "
                    "adamw, lion, sgd, ...)")


def is_master_weights(tx) -> bool:
    """Whether ``tx`` is a :func:`master_weights` optimizer (not a transform wrapping one)."""
    return getattr(getattr(tx, "update", None), "master_weights", False) is True


def _sharded(layout) -> bool:
    return layout.n_data > 1 or layout.n_tensor > 1


def _check_stored_form(params, master) -> None:
    """Params whose masters are sharded over the mesh must come in their stored form.

    A logical param (an ``NVFP4Array`` or a plain array from ``quantize_params``) would need its
    new value gathered from the master's shards every step, as float32 for a plain leaf; on a
    mesh with Explicit axes JAX refuses the relayout outright."""
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_param_leaf)
    try:
        leaves_m = treedef.flatten_up_to(master)
    except (ValueError, TypeError):
        return  # reported with the full message once the masters are compared leaf by leaf
    for (path, p), mw in zip(leaves_p, leaves_m):
        if isinstance(mw, Tiled) and _sharded(mw.layout) and not is_tiled(p):
            raise ValueError(
                f"master_weights: parameter {path_str(path)} is in its logical form ({type(p).__name__}) but its "
                f"master is sharded over the mesh; pass the stored params: params = nv.shard_params(params), "
                "then jax.device_put(params, nv.shardings(params, mesh))")


def _keep_state_after_master(inner, finite, new, old, master):
    """``where(finite, new, old)`` over the inner optimizer's state, each param's state only
    once that param's new master exists.

    The new master is computed from the new state (Adam's moments, say), and XLA fuses that
    computation into the master's update, where it reads the old state. The selected state is
    written in place over the old, so unless the state's selects come after the master's
    update XLA copies every state buffer first, and the copies are live at once (two float32
    copies of every master with Adam). The order comes from a data dependence, element by
    element and so without communication: a state leaf shaped like its param's master is
    selected where ``finite and (master bits | 1) != 0``, which is ``finite``."""
    try:
        by_leaf = optax.tree_map_params(inner, lambda _, mm: mm, old, master, transform_non_params=lambda _: None)
        masters = jax.tree.structure(old).flatten_up_to(by_leaf)
    except Exception:  # a state optax cannot map to its params: the same selects, unordered
        masters = [None] * len(jax.tree.leaves(old))

    def select(a, b, mm):
        if mm is None or jnp.shape(mm) != jnp.shape(a) or jnp.dtype(mm) != jnp.float32:
            return jnp.where(finite, a, b)
        after = (jax.lax.bitcast_convert_type(mm, jnp.uint32) | 1) != 0
        return jnp.where(finite & after, a, b)

    leaves_new, treedef = jax.tree.flatten(new)
    return jax.tree.unflatten(treedef, [select(a, b, mm) for a, b, mm in zip(leaves_new, jax.tree.leaves(old), masters)])


def _f32_plain_mask(params, updates_m):
    """A tree like ``updates_m`` (its array leaves): True where the param is a float32 plain leaf."""
    leaves_p, treedef = jax.tree.flatten(params, is_leaf=_is_param_leaf)
    subtrees = treedef.flatten_up_to(updates_m)
    out = []
    for p, u in zip(leaves_p, subtrees):
        pv = p.value if isinstance(p, Tiled) else p
        f32 = (not _backs_nvfp4(p) and hasattr(pv, "dtype") and jnp.issubdtype(pv.dtype, jnp.floating)
               and jnp.finfo(pv.dtype).bits >= 32)
        out.append(jax.tree.map(lambda _: f32, u))
    return treedef.unflatten(out)


def _backs_nvfp4(p) -> bool:
    return is_nvfp4(p) or isinstance(p, TiledNVFP4)


def _plain_update(p, mw, um, finite):
    """The update of a plain float param ``p`` (a ``Tiled`` or an array) whose master is
    ``mw`` (already updated) and whose inner update was ``um``."""
    tiled_p = isinstance(p, Tiled)
    pv = p.value if tiled_p else p
    if jnp.finfo(pv.dtype).bits >= 32:
        # The inner optimizer's own update: p + u is computed exactly as m + u was.
        u = um.value if isinstance(um, Tiled) else um
        if isinstance(um, Tiled) and not tiled_p:
            u = um.logical()
        u = u.astype(pv.dtype)
    else:
        target = mw.value if isinstance(mw, Tiled) else mw
        if isinstance(mw, Tiled) and not tiled_p:
            target = mw.logical()
        u = target.astype(pv.dtype).astype(jnp.float32) - pv.astype(jnp.float32)
    u = jnp.where(finite, u, jnp.zeros_like(u))
    return Tiled(u, p.layout) if tiled_p else u


def nvfp4_delta(old: NVFP4Array, new: NVFP4Array) -> NVFP4Array:
    """An update that ``optax.apply_updates`` adds to ``old`` to give exactly ``new``: every
    leaf is an unsigned integer, so the wrap-around difference is exact."""
    return jax.tree.map(lambda n, o: n - o, new, old)


def apply_updates(params, updates):
    """``optax.apply_updates`` for trees with NVFP4 leaves, checking that every update was
    produced for these params (same structure, NVFP4 metadata and shapes)."""
    p_struct = jax.tree.structure(params, is_leaf=is_nvfp4)
    u_struct = jax.tree.structure(updates, is_leaf=is_nvfp4)
    if p_struct != u_struct:
        raise ValueError(f"updates do not match params: {u_struct} vs {p_struct}")
    return optax.apply_updates(params, updates)


def _same_storage(stored, theirs) -> None:
    """ValueError if a param ``stored`` in float by one policy is NVFP4 by ``theirs``, the master_weights
    optimizer's: its master would be laid out for NVFP4 beside a float param. (The other way round the optimizer
    follows the stored NVFP4 layout, and the re-quantization each stored param's blocks.)"""
    flat, treedef = jax.tree_util.tree_flatten_with_path(stored, is_leaf=is_tiled)
    for (path, mine), other in zip(flat, treedef.flatten_up_to(theirs)):
        if not isinstance(mine, TiledNVFP4) and isinstance(other, TiledNVFP4):
            raise ValueError(f"sharded_state: the policy stores {path_str(path)!r} as float, the nv.master_weights "
                             "optimizer's policy as NVFP4; pass the same policy to both, "
                             "nv.master_weights(..., policy=policy)")


def state_init(tx, mesh=None, rules: Optional[Rules] = None, policy: Optional[Policy] = None):
    """The pure function :func:`sharded_state` compiles: float params -> ``(stored params, optimizer state)``,
    :func:`~jax_nvfp4.sharding.shard_params` with ``mesh``, ``rules``, ``policy``, and ``tx.init`` with the float32
    masters set to the float params in the stored layouts. Compose it with a model's init and ``jit`` it with
    ``out_shardings`` from ``jax.eval_shape`` (:func:`~jax_nvfp4.sharding.shardings`) to build a state from
    arguments (a seed's key) in one program compiled once; on a mesh with Explicit axes, inside
    ``jax.sharding.auto_axes(..., out_sharding=those shardings)`` as :func:`sharded_state` does (else each device
    computes the whole state its explicit types call replicated). ``policy`` None: the one ``tx``'s
    :func:`master_weights` re-quantizes with (its default, unless it was given one). TypeError (when traced):
    ``tx`` holds no :func:`master_weights` state while a param is NVFP4."""
    mesh = context_mesh(mesh)
    if mesh is None:
        raise ValueError("state_init / sharded_state: no mesh: pass mesh= or call it under jax.set_mesh")

    def float_in(stored, x):
        x = x.dequantize(jnp.float32) if is_nvfp4(x) else x
        return Tiled.from_logical(jnp.asarray(x, jnp.float32), stored.layout) if is_tiled(stored) else x

    def init(params):
        """``tx.init(params)`` and the ``(policy, cast_master_bf16)`` of the ``master_weights`` inits it ran."""
        token = _INIT_POLICIES.set(seen := [])
        try:
            return tx.init(params), seen
        finally:
            _INIT_POLICIES.reset(token)

    def state(tree):
        own = policy
        if own is None:  # master_weights' own (its default included), found by tracing its init
            seen = []
            jax.eval_shape(lambda t: seen.extend(init(t)[1]), tree)
            if any(other != seen[0][0] for other, _ in seen):
                raise ValueError("sharded_state: tx holds nv.master_weights with different policies; pass the one "
                                 "the params are quantized with, policy=...")
            own = seen[0][0] if seen else None
        stored = shard_params(tree, mesh, rules, own)
        opt_state, seen = init(jax.tree.map(float_in, stored, tree, is_leaf=is_tiled))
        for other in [other for other, _ in seen if own is not None and other != own]:
            _same_storage(stored, jax.eval_shape(lambda t: shard_params(t, mesh, rules, other), tree))
        requantized = lambda p: {"shared_amax": p.shared_amax, "four_over_six": p.four_over_six}
        if own is not None and any(requantized(other) != requantized(own) for other, _ in seen):
            raise ValueError(f"sharded_state: the policy quantizes with {requantized(own)}, the nv.master_weights "
                             f"optimizer re-quantizes after every step with {requantized(seen[0][0])}; pass the same "
                             "policy to both, nv.master_weights(..., policy=policy)")
        casts = {cast for _, cast in seen}
        if len(casts) > 1:
            raise ValueError("sharded_state: tx holds nv.master_weights that differ in cast_master_bf16; the stored "
                             "weights can be quantized one way only")
        if casts == {True}:  # stored as its re-quantization writes them: from the masters cast to bf16
            stored = shard_params(tree, mesh, rules, own, cast_bf16=True)
        if find_state(opt_state) is None and any(isinstance(x, TiledNVFP4) for x in
                                                 jax.tree.leaves(stored, is_leaf=is_tiled)):
            raise TypeError("sharded_state: tx holds no nv.master_weights state, so the NVFP4 params would be updated "
                            "as 4-bit codes; wrap the optax transform: tx = nv.master_weights(optax.adamw(...), "
                            "rules=rules)")
        return stored, opt_state

    return state


def sharded_state(params, tx, mesh=None, rules: Optional[Rules] = None, policy: Optional[Policy] = None):
    """``(stored params, optimizer state)`` of float ``params`` (a tree, or a function of no arguments returning one,
    such as a model's init), in one jitted program whose outputs are laid out where they live
    (:func:`~jax_nvfp4.sharding.shardings`): :func:`state_init`'s, with the float32 masters set to the float params
    (those values, not their 4-bit quantization: what fine-tuning a pretrained model needs). ``tx`` is
    :func:`master_weights` (or an optax state holding it) wherever a param is NVFP4. No device holds an unsharded
    copy of the state; from a function, not of the float params either (each device initialises what its shards
    need; the init's values may then differ by a few float32 ulps from another compilation of it, as XLA compiles it
    with the quantization)."""
    state, mesh = state_init(tx, mesh, rules, policy), context_mesh(mesh)  # state_init refuses no mesh
    batch_axes(mesh, rules or DEFAULT_RULES)  # a mesh without them would replicate the whole state
    fn, args = ((lambda: state(params())), ()) if callable(params) else (state, (params,))
    out = shardings(jax.eval_shape(fn, *args), mesh)
    explicit = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)
    if explicit:  # the compiler places the work from the outputs' shardings, as on Auto axes
        typed = jax.tree.map(lambda s: NamedSharding(s.mesh, _split_spec(s.spec, explicit)), out)
        fn = jax.sharding.auto_axes(fn, axes=explicit, out_sharding=typed)
    return jax.jit(fn, out_shardings=out)(*args)


def find_state(state) -> Optional[MasterWeightsState]:
    """The :class:`MasterWeightsState` inside ``state`` (which may be nested in other optax
    states, e.g. ``MultiSteps`` or ``chain``), or None."""
    found = []

    def visit(x):
        if isinstance(x, MasterWeightsState):
            found.append(x)
            return True
        return False

    jax.tree.leaves(state, is_leaf=visit)
    return found[0] if found else None


def raise_if_skipped(state, before: int = 0) -> None:
    """Host-side check for a run that treats a skipped step as an error: raise ``FloatingPointError`` if the wrapper
    has skipped more than ``before`` steps. Call it after a step (it reads one scalar).

    Raising from inside a compiled multi-device step would leave the other devices waiting in
    their next collective, so the step itself never raises: it leaves every parameter and the
    optimizer state untouched, and this check turns that into an error.
    """
    mw = find_state(state)
    if mw is None:
        raise ValueError("raise_if_skipped: no master_weights state found")
    skipped = int(mw.skipped)
    if skipped > before:
        raise FloatingPointError(
            f"master_weights: non-finite gradients or updated masters (NaN or Inf) in {skipped - before} step(s); "
            "those updates were not applied and no state was changed"
        )


def _constrain_master(master, mesh):
    if mesh is None:
        return master
    return jax.tree.map(
        lambda mw: Tiled(constrain(mw.value, NamedSharding(mesh, mw.spec())), mw.layout) if isinstance(mw, Tiled) else mw,
        master,
        is_leaf=is_tiled,
    )


def _grads_to_master(grads, master, mesh):
    """Float gradients -> the masters' layout. ``Tiled`` gradients (from the training step's
    per-layer reduce-scatter) pass through; logical gradients shaped like the params (every
    device holds them whole: the gradients of gathered weights) are laid out tile-major, each
    device keeping its own tiles (:func:`~jax_nvfp4.sharding.scatter_replicated`)."""
    leaves_m, treedef = jax.tree.flatten(master, is_leaf=is_tiled)
    try:
        leaves_g = treedef.flatten_up_to(grads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"master_weights: gradients do not match the params tree: {e}") from None
    out = []
    for g, mw in zip(leaves_g, leaves_m):
        if is_nvfp4(g) or isinstance(g, TiledNVFP4):
            raise TypeError("master_weights: a gradient is an NVFP4 array; gradients must be float arrays "
                            "(take them against the dequantized weights)")
        if isinstance(g, Tiled):
            out.append(Tiled(g.value.astype(jnp.float32), mw.layout) if isinstance(mw, Tiled)
                       else g.logical().astype(jnp.float32))
            continue
        shape = mw.shape if isinstance(mw, Tiled) else jnp.shape(mw)
        if tuple(jnp.shape(g)) != tuple(shape):
            raise ValueError(f"gradient of shape {tuple(jnp.shape(g))} for a parameter of shape {tuple(shape)}")
        if isinstance(mw, Tiled):
            # Laid out in the gradient's own dtype, then widened.
            t = scatter_replicated(g, mw.layout, mesh)
            out.append(Tiled(t.value.astype(jnp.float32), t.layout))
        else:
            out.append(jnp.asarray(g, jnp.float32))
    return jax.tree.unflatten(treedef, out)


def logical_mask(fn: Callable):
    """A mask or labels function for the optax transforms inside :func:`master_weights`
    (``optax.masked``, ``optax.adamw(mask=...)``, ``optax.multi_transform``): ``fn`` is called
    on each param as a ``jax.ShapeDtypeStruct`` of its logical shape. The inner transform sees
    the masters, whose tiled leaves are ``[..., nt, T, 16, 16]`` arrays: a function of their
    ``shape`` or ``ndim`` would see the tiles (``lambda p: p.ndim == 2`` would mask out every
    matrix). Its result holds ``fn``'s value where the masters hold a tiled node (a tree prefix
    of the masters, as optax's masks may be)."""

    def mask(tree):
        return jax.tree.map(lambda x: fn(jax.ShapeDtypeStruct(x.shape if is_tiled(x) else jnp.shape(x),
                                                              jnp.result_type(x.dtype if is_tiled(x) else x))),
                            tree, is_leaf=is_tiled)

    return mask


def clip_by_global_norm(max_norm: float, mesh=None, rules: Optional[Rules] = None) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` whose norm is summed in a fixed order across devices
    (:func:`jax_nvfp4.sharding.global_norm`), for the master-layout gradients the
    :func:`master_weights` wrapper's inner transform sees; without a mesh, optax's own."""
    rules = rules or DEFAULT_RULES

    def update_fn(updates, state, params=None):
        del params
        m = context_mesh(mesh)
        g_norm = global_norm(updates, m, rules)
        trigger = g_norm < max_norm
        clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
