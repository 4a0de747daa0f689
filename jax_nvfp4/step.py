"""The sharded train step and evaluation for any Flax model: FSDP one layer at a time, times
tensor parallelism.

:func:`make_step` takes the user's loss function, the ``master_weights`` optimizer and the
mesh, and returns the step. Inside one ``shard_map`` each parameter reaches the loss function
as a :class:`~jax_nvfp4.fetch.Shard` box in the params tree: the Flax layer that reads it
(``self.param`` in Linen: ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Embed``...;
``variable[...]``, ``.value`` or its operators in NNX: ``nnx.Linear``...) all-gathers its packed bytes
over the data axes right there, inside the model's scan or loop over blocks, and dequantizes.
The gather's VJP reduce-scatters the weight gradient straight into this device's float32
master tiles, summed in a fixed order (bitwise the same for any process layout). The model's
code is unchanged; rematerialise its blocks (``nn.remat`` / ``nnx.remat``, as any FSDP model
does) and no device holds more than one block's weights.

Tensor parallelism, two ways (``tensor=``):

- ``"gspmd"`` (stock layers): the rules (:class:`~jax_nvfp4.Rules`, e.g. from the kernels'
  logical axis names with :func:`tensor_rules_from_logical`) say which kernels split along
  their outputs (-1) or inputs (-2). The ``shard_map`` is manual over the data axes only; each
  split weight is gathered by a nested ``shard_map`` over the tensor axis, so every rank
  gathers its own sub-matrix (1/t of the bytes, over the data axes only) and the model sees
  the logical weight sharded over the tensor axis. XLA's SPMD partitioner then runs the
  layers (activation collectives over the tensor axis are XLA's; mark sequence-parallel
  regions with ``nn.with_logical_constraint`` / sharding constraints). The tensor axis must
  be an Auto mesh axis.
- ``"manual"`` (a model written for it, e.g. with :class:`~jax_nvfp4.TensorParallel`): the
  ``shard_map`` is manual over every axis, a split weight reaches the model as this rank's
  sub-matrix, and the model writes its own tensor collectives (Megatron style).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4.collectives import LOSS_SCOPE, all_gather_bits, ordered_mean
from jax_nvfp4.fetch import GatherConfig, _manual_specs, shard_tree
from jax_nvfp4.layout import TiledNVFP4, is_tiled
from jax_nvfp4.optim import MasterWeightsState, find_state, is_master_weights
from jax_nvfp4.params import path_str
from jax_nvfp4.rules import DEFAULT_RULES, Rules, axis_size, batch_axes
from jax_nvfp4.sharding import constrain, partition_specs
from jax_nvfp4.tensor_parallel import TensorParallel

__all__ = ["batch_axes", "make_step", "make_eval", "tensor_parallel", "tensor_rules_from_logical"]

TENSOR_MODES = ("gspmd", "manual")


def tensor_parallel(mesh, rules: Rules = DEFAULT_RULES) -> TensorParallel:
    """The mesh's tensor axis as a ``tensor="manual"`` model sees it inside the step."""
    size = axis_size(mesh, rules.tensor_axis)
    return TensorParallel(rules.tensor_axis if size > 1 else None, size)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where the step's ``shard_map`` is manual, and how the boxes gather."""

    mesh: Any
    batch: Tuple[str, ...]
    manual: Tuple[str, ...]
    gather: GatherConfig
    tensor: TensorParallel

    def specs(self, tree):
        return jax.tree.map(lambda s: _manual_specs(s, self.manual), partition_specs(tree),
                            is_leaf=lambda x: isinstance(x, P))

    def check_layouts(self, tree, who: str) -> None:
        """A clear error where a stored leaf of ``tree`` was laid out for another mesh (its data or
        tensor shards are not this mesh's), before the gathers would misread its tiles."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_tiled)[0]:
            if not is_tiled(leaf):
                continue
            lay = leaf.layout  # a leaf split over the tensor axis: its shards there too
            axes = (lay.data_axis,) + ((lay.tensor_axis,) if lay.n_tensor > 1 else ())
            stored, here = (lay.n_data, lay.n_tensor)[:len(axes)], tuple(axis_size(self.mesh, a) for a in axes)
            if stored != here:
                raise ValueError(
                    f"{who}: {path_str(path)!r} is stored as {' x '.join(map(str, stored))} shards over "
                    f"{' x '.join(map(repr, axes))}, which this mesh {dict(self.mesh.shape)} makes "
                    f"{' x '.join(map(str, here))}: build the state on the mesh the step runs on "
                    "(nv.sharded_state(params, tx, mesh, rules)), or restore a checkpoint onto it")

    def shard_map(self, fn, in_specs, out_specs):
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                               axis_names=set(self.manual), check_vma=False)

        def run(*args):
            try:
                return mapped(*args)
            except NotImplementedError as e:
                if "Closing over inputs to shard_map" not in str(e):
                    raise
                raise NotImplementedError(
                    "the model or loss closes over an array sharded over Explicit mesh axes, which jax.shard_map "
                    "cannot take in: pass it as one of the step's extra arguments (step(params, opt_state, batch, "
                    "key, *args)) or in the batch instead") from e
        return run


# Primitives that name a mesh axis without moving data between its devices.
_NOT_COMMUNICATION = frozenset({"axis_index", "pvary", "pcast", "preduced", "vary_unreduced_cast_p"})


def _sends_over(jaxpr, axis: str) -> bool:
    """Whether ``jaxpr`` (or one nested in it: a scan, remat, custom VJP...) moves data over ``axis``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _NOT_COMMUNICATION:
            for key in ("axes", "axis_name"):
                names = eqn.params.get(key)
                if axis in (names if isinstance(names, (tuple, list)) else (names,)):
                    return True
        if any(_sends_over(sub, axis) for sub in jex_core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _check_manual_model(plan: "_Plan", params, forward, *args) -> None:
    """Under ``tensor="manual"`` a weight split over the tensor axis reaches the model as this
    rank's sub-matrix: a model that never communicates over that axis (stock ``nn.Dense`` /
    ``nnx.Linear`` layers) would compute a different partial result on each rank and train on it
    silently. Refused at trace time, from the forward's jaxpr (``forward(*args)``)."""
    if not plan.tensor.on:
        return
    split = [path_str(path) for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_tiled)[0]
             if is_tiled(leaf) and leaf.layout.n_tensor > 1]
    if not split:
        return
    try:
        jaxpr = jax.make_jaxpr(forward)(*args).jaxpr
    except Exception as e:  # noqa: BLE001 - a stock layer checks the shard's shape against its own features
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"tensor='manual': the model failed on this rank's sub-matrices of the {len(split)} weights split over "
            f"the tensor axis {plan.tensor.axis!r} (e.g. {split[0]!r}): {type(e).__name__}: {first}. If it is made of "
            "stock layers (nn.Dense, nnx.Linear), they run with tensor='gspmd'; a model written for tensor='manual' "
            "takes its shards and combines its ranks' results (nv.TensorParallel)") from e
    if not _sends_over(jaxpr, plan.tensor.axis):
        raise ValueError(
            f"tensor='manual': {len(split)} weights split over the tensor axis {plan.tensor.axis!r} reach the model as "
            f"this rank's sub-matrix (e.g. {split[0]!r}), but the model sends nothing over that axis, so each rank "
            "would compute a different partial result. Stock layers (nn.Dense, nnx.Linear) run with tensor='gspmd'; "
            "a model written for tensor='manual' combines its ranks' results (nv.TensorParallel's sum, "
            "gather_sequence, scatter_sequence)")


def _rows(batch) -> int:
    """The rows of a batch: an array's leading axis, or a tree's (a tuple or dict of arrays), which
    every leaf shares (a clear error otherwise)."""
    shapes = [jnp.shape(x) for x in jax.tree.leaves(batch)]
    if not shapes or any(not shape for shape in shapes) or len({shape[0] for shape in shapes}) > 1:
        raise ValueError(f"a batch is an array of rows, or a tree of arrays sharing their leading axis (rows); got "
                         f"leaves of shapes {shapes}")
    return shapes[0][0]


def _split_rows(batch, plan: _Plan):
    """The batch placed with its rows split over the batch axes (a clear error if they do not divide)."""
    n, rows = int(np.prod([plan.mesh.shape[a] for a in plan.batch])), _rows(batch)
    if rows % n:
        raise ValueError(f"the batch's {rows} rows do not split evenly over the batch axes {plan.batch} "
                         f"({n} devices): use a multiple of {n}")
    return jax.tree.map(lambda x: constrain(x, NamedSharding(plan.mesh, P(plan.batch))), batch)


@contextlib.contextmanager
def _stack_hint(rules: Optional[Rules]):
    """Around the model's call on the boxed params: an IndexError there, with no stacked params in the
    rules, gets a note. It is how ``nnx.scan`` (``jax.lax.scan``) reports a stack of layers the rules
    do not declare: it slices a per-matrix scalar (the amax). Linen's ``nn.scan`` meets
    :meth:`~jax_nvfp4.fetch.Shard.remove_axis`'s own error first."""
    try:
        yield
    except IndexError as e:
        if not (rules or DEFAULT_RULES).stacked:
            e.add_note("jax_nvfp4: if the model scans or vmaps over a stack of layers (nnx.scan, nnx.vmap), declare "
                       "their params stacked: nv.Rules(stacked=(a regex of their paths,)), e.g. ('^blocks/',)")
        raise


def _plan(mesh, rules: Rules, dtype, packed: bool, tensor: str) -> _Plan:
    if tensor not in TENSOR_MODES:
        raise ValueError(f"tensor must be one of {TENSOR_MODES}, got {tensor!r}")
    rules = rules or DEFAULT_RULES
    batch = batch_axes(mesh, rules)
    t_on = axis_size(mesh, rules.tensor_axis) > 1
    gspmd = t_on and tensor == "gspmd"
    if gspmd:
        kind = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()))).get(rules.tensor_axis)
        if kind is not None and not str(kind).endswith("Auto"):
            raise ValueError(f"tensor='gspmd' needs the tensor axis {rules.tensor_axis!r} to be an Auto mesh axis "
                             f"(jax.make_mesh(..., axis_types=...)), got {kind}")
    manual = tuple(a for a in mesh.axis_names if not (gspmd and a == rules.tensor_axis))
    cfg = GatherConfig(rules.data_axis, dtype, packed=packed, replica_axis=rules.replica_axis,
                       tensor_axis=rules.tensor_axis if t_on and not gspmd else None,
                       tensor_gspmd=rules.tensor_axis if gspmd else None)
    tp = tensor_parallel(mesh, rules) if t_on and not gspmd else TensorParallel()
    return _Plan(mesh, batch, manual, cfg, tp)


def make_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh, rules: Optional[Rules] = None, *,
              dtype=jnp.bfloat16, packed: bool = True, grad_accum: int = 1, tensor: str = "gspmd"):
    """The sharded train step ``step(params, opt_state, batch, key=None, *args)`` ->
    ``(params, opt_state, {"loss", "skipped"})``. Call it under ``jax.jit`` (donate the
    params and state). ``batch``: an array of rows, or a tree of them (``(inputs, labels)``, a
    dict) sharing their leading axis; its rows are split over the batch axes.

    Args:
      loss_fn: ``loss_fn(params, rows, key, *args) -> scalar``: the mean loss of this
        device's ``rows`` of the batch, ``params`` the stored tree with every leaf boxed as a
        :class:`~jax_nvfp4.fetch.Shard` (pass it to ``model.apply({"params": params}, ...)``,
        or merge it into an NNX graph); ``key`` this device's key (``key`` folded with its
        batch index, and tensor index with ``tensor="manual"``) or None; ``args`` the step's
        extra arguments (replicated), e.g. a schedule value.
      tx: a :func:`~jax_nvfp4.master_weights` optimizer (any optax transform inside).
      mesh: the mesh; its axes named in ``rules`` (data, replica, tensor).
      rules: the :class:`~jax_nvfp4.Rules` the params were sharded with.
      dtype: the dtype the weights are dequantized to (their gradients arrive in it).
      packed: gather the packed NVFP4 bytes (False: gather dequantized values, the bf16-gather
        reference; bit-identical results).
      grad_accum: split each device's rows into this many micro-batches, summing gradients.
      tensor: ``"gspmd"`` or ``"manual"`` (see the module docstring).

    The loss is averaged over the batch axes in a fixed order; every gradient lands in its
    master's layout (this device's tiles) through the gathers' VJPs; ``tx`` updates and
    re-quantizes each shard. A step whose loss or gradients are not all finite changes nothing
    and is counted in ``metrics["skipped"]``.
    """
    plan = _plan(mesh, rules, dtype, packed, tensor)
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")

    def local(params, masters, rows, key, *args):
        if key is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(plan.batch))
            if plan.tensor.on:
                key = jax.random.fold_in(key, plan.tensor.index())

        def value(masters, r, k):
            with _stack_hint(rules):
                return loss_fn(shard_tree(params, masters, plan.gather), r, k, *args)

        _check_manual_model(plan, params, value, masters, rows, key)
        grad_fn = jax.value_and_grad(value)
        if grad_accum == 1:
            loss, grads = grad_fn(masters, rows, key)
        else:
            n = _rows(rows)
            b = n // grad_accum
            if b * grad_accum != n:
                raise ValueError(f"{n} rows per device are not divisible by grad_accum={grad_accum}")

            def body(carry, xs):
                i, r = xs
                l, g = grad_fn(masters, r, None if key is None else jax.random.fold_in(key, i))
                return jax.tree.map(jnp.add, carry, (l, g)), None

            zero = jax.tree.map(jnp.zeros_like, (jnp.zeros([], jnp.float32), masters))
            micro = jax.tree.map(lambda r: r.reshape(grad_accum, b, *r.shape[1:]), rows)
            (loss, grads), _ = jax.lax.scan(body, zero, (jnp.arange(grad_accum), micro))
            loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / np.float32(grad_accum), grads)
        with jax.named_scope(LOSS_SCOPE):
            return ordered_mean(jnp.asarray(loss, jnp.float32), plan.batch), grads

    def step(params, opt_state, batch, key=None, *args):
        batch = _split_rows(batch, plan)
        state = find_state(opt_state)
        if state is None:
            raise TypeError("make_step: opt_state holds no nv.master_weights state (the step updates the float32 "
                            "masters); build it from tx = nv.master_weights(optax.adamw(...), rules=rules) with "
                            "nv.sharded_state(params, tx, ...)")
        if isinstance(opt_state, MasterWeightsState) and not is_master_weights(tx):
            raise TypeError("make_step: opt_state is a nv.master_weights state but tx is not that optimizer; pass "
                            "tx = nv.master_weights(optax..., rules=rules), the one the state was built with, not "
                            "the optax transform inside it")
        if not _outermost(opt_state):
            raise TypeError(f"make_step: {OUTERMOST}")
        masters = state.master
        plan.check_layouts(params, "make_step")
        plan.check_layouts(masters, "make_step")
        m_specs = plan.specs(masters)
        arg_specs = tuple(P() for _ in args)  # replicated: placed so, whatever sharding they come with
        args = jax.tree.map(lambda a: constrain(a, NamedSharding(plan.mesh, P())) if isinstance(a, jax.Array) else a,
                            args)
        if key is None:
            fn = lambda p, m, r, *a: local(p, m, r, None, *a)
            specs = (plan.specs(params), m_specs, P(plan.batch), *arg_specs)
            loss, grads = plan.shard_map(fn, specs, (P(), m_specs))(params, masters, batch, *args)
        else:
            specs = (plan.specs(params), m_specs, P(plan.batch), P(), *arg_specs)
            loss, grads = plan.shard_map(local, specs, (P(), m_specs))(params, masters, batch, key, *args)
        # A non-finite loss is a non-finite step even where its gradients are finite (e.g. a
        # target id past the vocabulary): master_weights skips a step whose gradients are not
        # all finite, so the loss's verdict is folded into them.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        _check_byte_updates(params, updates)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "skipped": find_state(opt_state).skipped}

    return step


OUTERMOST = ("nv.master_weights must be the outermost transform: its updates of NVFP4 params are byte differences, "
             "which a transform after or around it (optax.chain(nv.master_weights(...), optax.scale(...)), "
             "optax.apply_if_finite(nv.master_weights(...))) turns into floats or other bytes that corrupt the stored "
             "weights; put the other transforms inside it, nv.master_weights(optax.chain(...)) (it skips non-finite "
             "steps itself)")


def _outermost(opt_state) -> bool:
    """Whether the optimizer state is one whose transform returns master_weights' updates as they are: its own
    state, ``optax.MultiSteps``' around it (zero updates between steps), ``optax.inject_hyperparams``' around it, or
    the last of a chain's (the transforms before it act on the gradients; ``optax.named_chain``'s too)."""
    if isinstance(opt_state, MasterWeightsState):
        return True
    if isinstance(opt_state, optax.MultiStepsState):
        return _outermost(opt_state.inner_opt_state)
    if isinstance(opt_state, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)):
        return _outermost(opt_state.inner_state)
    if (type(opt_state) is tuple or isinstance(opt_state, dict)) and opt_state:
        *before, last = opt_state.values() if isinstance(opt_state, dict) else opt_state
        return _outermost(last) and find_state(before) is None
    return False


def _check_byte_updates(params, updates) -> None:
    """TypeError unless the update of every NVFP4 param has its bytes' dtypes (see :data:`OUTERMOST`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_tiled)
    for (path, p), u in zip(flat, treedef.flatten_up_to(updates)):
        if isinstance(p, TiledNVFP4) and [x.dtype for x in jax.tree.leaves(u)] != [x.dtype for x in jax.tree.leaves(p)]:
            raise TypeError(f"make_step: the update of {path_str(path)!r} is not in its stored bytes' dtypes; "
                            f"{OUTERMOST}")


def make_eval(fn: Callable, mesh, rules: Optional[Rules] = None, *, dtype=jnp.bfloat16, packed: bool = True,
              tensor: str = "gspmd"):
    """``evaluate(params, batch)``: ``fn(params, rows)`` on each device's rows with the step's
    per-layer gathers (forward only: no device ever holds the whole model), its per-row
    results (``[rows, ...]`` arrays or a tree of them, e.g. each row's loss) gathered as bits
    in row order and returned replicated, so a host-side mean does not depend on how devices
    sum. Call it under ``jax.jit``. Arguments as :func:`make_step`."""
    plan = _plan(mesh, rules, dtype, packed, tensor)

    def local(params, rows):
        _check_manual_model(plan, params, lambda p, r: fn(shard_tree(p, None, plan.gather), r), params, rows)
        with _stack_hint(rules):
            out, n = fn(shard_tree(params, None, plan.gather), rows), _rows(rows)
        shapes = [jnp.shape(o) for o in jax.tree.leaves(out)]
        if not shapes or any(shape[:1] != (n,) for shape in shapes):
            raise ValueError(f"make_eval: fn(params, rows) returns per-row results, arrays (or a tree of them) whose "
                             f"leading axis is this device's {n} rows; got shapes {shapes}")
        with jax.named_scope(LOSS_SCOPE):
            return jax.tree.map(lambda o: all_gather_bits(o, plan.batch, tiled=True), out)

    def evaluate(params, batch):
        plan.check_layouts(params, "make_eval")
        batch = _split_rows(batch, plan)
        return plan.shard_map(local, (plan.specs(params), P(plan.batch)), P())(params, batch)

    return evaluate


def _logical_names(leaf):
    """The logical axis names a boxed param carries: Linen's ``nn.LogicallyPartitioned``
    (``names``), NNX's variable metadata (``out_sharding``; ``sharding_names`` /
    ``sharding`` in older Flax), or None."""
    names = getattr(leaf, "names", None)
    if names is None and hasattr(leaf, "get_metadata"):
        meta_ = leaf.get_metadata()
        names = next((meta_[k] for k in ("out_sharding", "sharding_names", "sharding") if meta_.get(k)), None)
    return tuple(names) if isinstance(names, (tuple, list)) else None


def tensor_rules_from_logical(params, axes: Sequence[str] = ("mlp", "heads", "kv", "vocab", "q_heads", "kv_heads"),
                              ) -> Tuple[Tuple[str, int], ...]:
    """Tensor rules (:attr:`Rules.tensor`) from the logical axis names on a model's params: a
    kernel whose last axis is named in ``axes`` is split along its outputs (-1), one whose
    second-to-last axis is, along its inputs (-2); anything else is not split.

    ``params``: the boxed params, before unboxing: Linen's ``jax.eval_shape(model.init,
    ...)["params"]`` with kernels made by ``nn.with_logical_partitioning``, or an NNX state
    (``nnx.state(model)``, kernels made with ``nnx.with_partitioning`` /
    ``nnx.Param(..., out_sharding=...)``). Returns ``((f"^{path}$", -1 | -2), ...)``."""
    from flax import nnx
    from flax.core import meta

    from jax_nvfp4.params import path_str

    boxed = lambda x: isinstance(x, (meta.AxisMetadata, nnx.Variable))
    rules = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=boxed)[0]:
        names = _logical_names(leaf)
        if names is None or len(names) < 2:
            continue
        p = path_str(path)
        p = p[: -len("/value")] if p.endswith("/value") else p
        if names[-1] in axes:
            rules.append((f"^{p}$", -1))
        elif names[-2] in axes:
            rules.append((f"^{p}$", -2))
    return tuple(rules)
