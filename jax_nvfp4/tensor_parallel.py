"""Megatron tensor parallelism with sequence parallelism, written as explicit collectives
inside a ``shard_map`` that is manual over the tensor axis.

Between blocks the residual stream is split along the sequence over the tensor axis
(``[B, S/t, D]``). Before a column-parallel GEMM (a weight split along its outputs) the
activations are all-gathered along the sequence (:meth:`TensorParallel.gather_sequence`); a
row-parallel GEMM (split along its inputs) leaves partial sums, reduce-scattered back to the
sequence split (:meth:`TensorParallel.scatter_sequence`). Embedding, head and loss are split
along the vocabulary (:func:`vocab_embed`, :func:`vocab_token_losses`): no ``[B, S, V]``
array is ever gathered.

Every sum over the tensor axis that feeds the trajectory moves bits and folds in shard order
(:mod:`jax_nvfp4.collectives`), so a run is bitwise the same for any process layout of the
same mesh. A different tensor-axis size sums in a different order and may round differently.

With ``size == 1`` (or no axis) every method is the identity and the functions are the plain
single-device computations, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_nvfp4.collectives import TENSOR_SCOPE, all_gather_bits, ordered_sum, ordered_sum_scatter

__all__ = ["TensorParallel", "vocab_embed", "vocab_token_losses"]


@functools.lru_cache(maxsize=None)
def _sequence_ops(axis: str, dim: int):
    """``(gather, scatter)``: the sequence all-gather whose backward is the ordered
    reduce-scatter, and the ordered reduce-scatter whose backward is the all-gather (each
    the other's transpose)."""

    def all_gather(x):
        with jax.named_scope(TENSOR_SCOPE):
            return all_gather_bits(x, axis, dim=dim, tiled=True)

    def reduce_scatter(x):
        with jax.named_scope(TENSOR_SCOPE):
            return ordered_sum_scatter(x, axis, dim)

    @jax.custom_vjp
    def gather(x):
        return all_gather(x)

    gather.defvjp(lambda x: (all_gather(x), None), lambda _, ct: (reduce_scatter(ct),))

    @jax.custom_vjp
    def scatter(x):
        return reduce_scatter(x)

    scatter.defvjp(lambda x: (reduce_scatter(x), None), lambda _, ct: (all_gather(ct),))
    return gather, scatter


@functools.lru_cache(maxsize=None)
def _sum_op(axis: str):
    """The ordered all-reduce of a value every tensor rank then uses identically (a loss
    term): its backward is the identity (Megatron's "reduce from the tensor-parallel
    region")."""

    def reduce(x):
        with jax.named_scope(TENSOR_SCOPE):
            return ordered_sum(x, axis)

    @jax.custom_vjp
    def total(x):
        return reduce(x)

    total.defvjp(lambda x: (reduce(x), None), lambda _, ct: (ct,))
    return total


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor axis as the layers inside a ``shard_map`` see it: its mesh-axis name and
    size (static; a Flax attribute). ``TensorParallel()`` is off: one device computes
    everything."""

    axis: Optional[str] = None
    size: int = 1

    @property
    def on(self) -> bool:
        return self.axis is not None and self.size > 1

    def index(self):
        """This device's tensor rank (0 when off)."""
        return jax.lax.axis_index(self.axis) if self.on else 0

    def split(self, n: int, what: str = "dimension") -> int:
        """``n / size``: this rank's share of ``n`` heads, features or vocabulary rows."""
        if n % self.size:
            raise ValueError(f"{what} {n} is not divisible by the tensor axis size {self.size}")
        return n // self.size

    def gather_sequence(self, x: jax.Array, dim: int = 1) -> jax.Array:
        """``[B, S/t, ...]`` -> ``[B, S, ...]`` (all-gather; backward: ordered reduce-scatter)."""
        return _sequence_ops(self.axis, dim)[0](x) if self.on else x

    def scatter_sequence(self, x: jax.Array, dim: int = 1) -> jax.Array:
        """Partial sums ``[B, S, ...]`` -> this rank's summed chunk ``[B, S/t, ...]`` (ordered
        reduce-scatter; backward: all-gather)."""
        return _sequence_ops(self.axis, dim)[1](x) if self.on else x

    def sum(self, x: jax.Array) -> jax.Array:
        """Ordered sum over the tensor axis of a value then used alike on every rank."""
        return _sum_op(self.axis)(x) if self.on else x

    def max(self, x: jax.Array) -> jax.Array:
        """Maximum over the tensor axis (exact in any order; not differentiated)."""
        if not self.on:
            return x
        with jax.named_scope(TENSOR_SCOPE):
            return jax.lax.pmax(jax.lax.stop_gradient(x), self.axis)


def vocab_embed(table: jax.Array, tokens: jax.Array, tp: TensorParallel) -> jax.Array:
    """Embedding lookup ``table[tokens]`` with ``table`` this rank's rows of the vocabulary
    (``[V/t, D]``, rows ``rank * V/t ...``): ``[B, S] -> [B, S/t, D]``, sequence-split. Ids
    outside the rank's rows give zeros; the ranks' rows are summed by the ordered
    reduce-scatter (exactly one rank holds each id, so the sum is exact)."""
    if not tp.on:
        return table[tokens]
    rows = table.shape[0]
    local = tokens - tp.index() * rows
    inside = (local >= 0) & (local < rows)
    picked = jnp.where(inside[..., None], table[jnp.clip(local, 0, rows - 1)], jnp.zeros((), table.dtype))
    return tp.scatter_sequence(picked)


def vocab_token_losses(logits: jax.Array, targets: jax.Array, tp: TensorParallel) -> jax.Array:
    """Next-token cross-entropy in nats of every position, ``[..., V/t] -> [...]`` float32,
    with ``logits`` this rank's vocabulary columns (vocab-parallel: the maximum and the sum of
    exponentials are combined over the tensor axis, the target's logit comes from the rank
    that holds it). Off: ``-log_softmax(logits)[target]`` as one device computes it."""
    logits = logits.astype(jnp.float32)
    if not tp.on:
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    cols = logits.shape[-1]
    top = tp.max(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits - top
    lse = jnp.log(tp.sum(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)))[..., 0]
    local = targets - tp.index() * cols
    inside = (local >= 0) & (local < cols)
    picked = jnp.take_along_axis(shifted, jnp.clip(local, 0, cols - 1)[..., None], axis=-1)[..., 0]
    target = tp.sum(jnp.where(inside, picked, 0.0))
    return lse - target
