"""``master_weights``: an optax wrapper that keeps float32 masters for NVFP4 parameters.

The wrapper holds the float32 master of every parameter (NVFP4 or not) in its state, sharded
across the data axis in the :class:`~jax_nvfp4.sharding.MasterArray` layout, runs any optax
transform on the masters, re-quantizes each NVFP4 leaf shard by shard with the global amax,
and returns updates that ``optax.apply_updates`` adds to the old params to give exactly the
new ones:

- NVFP4 leaves: all three leaves (packed data, scale bytes, amax bits) are unsigned integers,
  so their update is the wrap-around difference, which ``p + u`` undoes exactly. The result is
  bit-identical to quantizing the whole unsharded master.
- Other float leaves: the new value is *defined* as ``p + (master.astype(dtype) - p)`` computed
  in ``p``'s dtype (float32 for the difference when ``p`` is narrower), which is what
  ``optax.apply_updates`` computes, so it is reproduced exactly. It equals
  ``master.astype(dtype)`` whenever old and new values are within a factor of two (Sterbenz),
  i.e. on essentially every step, and is otherwise within one rounding; the master is exact.

Non-finite gradients skip the step (master, params, inner state and key unchanged; the skip is
counted in the state). With ``nonfinite="error"`` the same happens on the device and
:func:`raise_if_skipped`, called on the host after the step, raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jax_nvfp4.array import BLOCK_2D, NVFP4Array, is_nvfp4
from jax_nvfp4.params import DEFAULT_POLICY, Policy, path_str
from jax_nvfp4.sharding import (
    DEFAULT_RULES,
    MasterArray,
    Rules,
    context_mesh,
    is_master,
    master_spec,
    requantize,
    to_master,
    _named,
    _nvfp4_specs,
)


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`.

    Attributes:
      master: params-structured tree of :class:`MasterArray` (float32, sharded).
      inner_state: the inner transform's state (over the masters).
      skipped: int32 count of steps skipped for non-finite gradients.
      key: PRNG key for stochastic re-quantization (None when off).
    """

    master: Any
    inner_state: Any
    skipped: jax.Array
    key: Optional[jax.Array]


def _is_param_leaf(x) -> bool:
    return is_nvfp4(x) or is_master(x)


def master_weights(
    inner: optax.GradientTransformation,
    *,
    policy: Optional[Policy] = None,
    mesh=None,
    rules: Optional[Rules] = None,
    data_axis: str = "data",
    block=BLOCK_2D,
    nonfinite: str = "skip",
    stochastic_rounding: bool = False,
    key: Optional[jax.Array] = None,
    cast_master_bf16: bool = False,
    grad_dtype=None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it updates float32 masters of NVFP4 params.

    Args:
      inner: any optax transformation (``adamw``, ``chain(clip_by_global_norm, adamw)``,
        ``MultiSteps``, ``inject_hyperparams(...)``...). It sees the master tree.
      policy: which float leaves passed to ``init`` are NVFP4 params (the policy given to
        ``quantize_params``; default the default policy). ``NVFP4Array`` leaves always are.
      mesh: the mesh; default the context mesh (``jax.set_mesh``), or none (one device).
      rules: sharding rules (data/tensor axes); default data axis ``data_axis``.
      block: NVFP4 block of re-quantized weights (2D tiles for weights).
      nonfinite: ``"skip"`` (default) or ``"error"`` (the step is not applied either way; with
        ``"error"`` call :func:`raise_if_skipped` after each step to stop with an error).
      stochastic_rounding: re-quantize with stochastic rounding (key carried in the state).
      key: PRNG key for stochastic rounding (default ``jax.random.key(0)``).
      cast_master_bf16: cast the master to bf16 before quantizing (as Transformer Engine does).
      grad_dtype: cast incoming gradients to this dtype before they are summed into the master
        shards (e.g. ``jnp.float32``); default: keep the gradient dtype.

    ``init(params)`` takes the float32 tree (the master is exactly it; ``policy`` says which
    leaves are NVFP4) or a tree with ``NVFP4Array`` leaves (the master starts from their
    dequantized values). ``update(grads, state, params)`` needs ``params``; ``grads`` are float
    and shaped like the dequantized weights (or ``MasterArray`` shards from
    :func:`~jax_nvfp4.sharding.reduce_scatter_grads`).
    """
    if nonfinite not in ("skip", "error"):
        raise ValueError(f"nonfinite must be 'skip' or 'error', got {nonfinite!r}")
    rules = rules or dataclasses.replace(DEFAULT_RULES, data_axis=data_axis)
    policy = policy or DEFAULT_POLICY

    def init_fn(params):
        m = context_mesh(mesh)

        def one(path, leaf):
            p = path_str(path)
            return to_master(p, leaf, m, rules, nvfp4=is_nvfp4(leaf) or policy.wants(p, leaf))

        master = jax.tree_util.tree_map_with_path(one, params, is_leaf=is_nvfp4)
        master = _constrain_master(master, m, rules)
        k = None
        if stochastic_rounding:
            k = key if key is not None else jax.random.key(0)
        return MasterWeightsState(
            master=master,
            inner_state=inner.init(master),
            skipped=jnp.zeros([], jnp.int32),
            key=k,
        )

    def update_fn(grads, state: MasterWeightsState, params=None, **extra):
        if params is None:
            raise ValueError("master_weights: update(grads, state, params) needs the current params")
        for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_nvfp4)[0]:
            if is_nvfp4(g):
                raise TypeError(f"master_weights: the gradient of {path_str(path)!r} is an NVFP4Array; gradients "
                                "must be float arrays shaped like the dequantized weights (take them with respect "
                                "to nv.dequantize_params(params), not the NVFP4 params)")
        m = context_mesh(mesh)
        grads_m = _grads_to_master(grads, state.master, m, rules, grad_dtype)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads_m)]))
        updates_m, inner_state = inner.update(grads_m, state.inner_state, state.master, **extra)
        master = optax.apply_updates(state.master, updates_m)
        master = _constrain_master(master, m, rules)

        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        master = keep(master, state.master)
        inner_state = keep(inner_state, state.inner_state)
        new_key, sub = (None, None)
        if state.key is not None:
            new_key, sub = jax.random.split(state.key)
            new_key = keep(new_key, state.key)

        paths_p, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_param_leaf)
        leaves_m = treedef.flatten_up_to(master)
        updates = []
        for i, ((path, p), mw) in enumerate(zip(paths_p, leaves_m)):
            if is_nvfp4(p) != mw.nvfp4:
                raise ValueError(
                    f"master_weights: parameter {path_str(path)} is {'' if is_nvfp4(p) else 'not '}NVFP4 "
                    f"but its master was initialised as {'' if mw.nvfp4 else 'not '}NVFP4; pass the same "
                    "policy to quantize_params and master_weights"
                )
            if is_nvfp4(p):
                k = jax.random.fold_in(sub, i) if sub is not None else None
                q = requantize(mw, m, rules, block=p.block, key=k, cast_bf16=cast_master_bf16)
                q = _constrain_like(path_str(path), q, m, rules)
                q = keep(q, p)
                updates.append(nvfp4_delta(p, q))
            elif isinstance(p, MasterArray):
                raise TypeError("params must not contain MasterArray leaves")
            elif hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating):
                target = mw.logical().astype(p.dtype)
                wide = jnp.float32 if jnp.finfo(p.dtype).bits < 32 else p.dtype
                u = target.astype(wide) - p.astype(wide)
                updates.append(jnp.where(finite, u, jnp.zeros_like(u)))
            else:
                updates.append(jnp.zeros_like(p))
        new_state = MasterWeightsState(
            master=master,
            inner_state=inner_state,
            skipped=state.skipped + (~finite).astype(jnp.int32),
            key=new_key,
        )
        return jax.tree.unflatten(treedef, updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    """Host-side check for ``nonfinite="error"``: raise ``FloatingPointError`` if the wrapper
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
            f"master_weights: non-finite gradients (NaN or Inf) in {skipped - before} step(s); "
            "those updates were not applied and no state was changed"
        )


def _constrain_master(master, mesh, rules):
    if mesh is None:
        return master
    return jax.tree.map(
        lambda mw: MasterArray(
            jax.lax.with_sharding_constraint(mw.value, _named(mesh, master_spec(mw, rules))),
            mw.shape, mw.data_dim, mw.tensor_dim, mw.nvfp4,
        ),
        master,
        is_leaf=is_master,
    )


def _constrain_like(path: str, q: NVFP4Array, mesh, rules):
    """Move the re-quantized leaf from the master layout to the stored params layout (a no-op
    when the shapes are tile-aligned; otherwise a reshuffle of bytes, never of floats)."""
    if mesh is None:
        return q
    ds, ss, _ = _nvfp4_specs(path, q, mesh, rules)
    data = jax.lax.with_sharding_constraint(q.data, _named(mesh, ds))
    scale = jax.lax.with_sharding_constraint(q.scale_bits, _named(mesh, ss))
    return NVFP4Array(data, scale, q.amax_bits, q.matrix_shape, q.block)


def _grads_to_master(grads, master, mesh, rules, grad_dtype):
    """Float gradients shaped like the logical params -> MasterArray layout (padded, sharded).
    Gradients that already are MasterArray (from ``reduce_scatter_grads``) pass through."""
    leaves_m, treedef = jax.tree.flatten(master, is_leaf=is_master)
    try:
        leaves_g = treedef.flatten_up_to(grads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"master_weights: gradients do not match the params tree: {e}") from None
    out = []
    for g, mw in zip(leaves_g, leaves_m):
        if is_master(g):
            v = g.value
        else:
            if tuple(g.shape) != tuple(mw.shape):
                raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {mw.shape}")
            v = g.astype(grad_dtype) if grad_dtype is not None else g
            pad = [(0, t - s) for t, s in zip(mw.value.shape, v.shape)]
            if any(b for _, b in pad):
                v = jnp.pad(v, pad)
            if mesh is not None:
                v = jax.lax.with_sharding_constraint(v, _named(mesh, master_spec(mw, rules)))
        out.append(MasterArray(v.astype(jnp.float32), mw.shape, mw.data_dim, mw.tensor_dim, mw.nvfp4))
    return jax.tree.unflatten(treedef, out)
