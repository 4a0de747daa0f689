"""Which parameters live in NVFP4: a policy, ``quantize_params`` and ``dequantize_params``."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from jax_nvfp4.array import BLOCK_2D, NVFP4Array, as_array, dequantize, is_nvfp4, quantize


def path_str(path) -> str:
    """A pytree key path as ``a/b/0/c`` (dict keys, attribute names and indices)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Decides which float leaves become NVFP4.

    A leaf becomes NVFP4 when it is floating point, has at least ``min_ndim`` axes, its last
    two axes are both at least ``min_size``, its path (``a/b/c``, see :func:`path_str`)
    matches one of ``include`` (all paths when empty) and none of ``keep``.

    Leaves matched by ``keep`` are stored in ``keep_dtype`` (their own dtype when None);
    other leaves that are not NVFP4 (biases, norms) keep their dtype.
    """

    include: Tuple[str, ...] = ()
    keep: Tuple[str, ...] = ()
    keep_dtype: Optional[Any] = None
    min_ndim: int = 2
    min_size: int = 16
    block: Tuple[int, int] = BLOCK_2D

    def __post_init__(self):
        for pat in (*self.include, *self.keep):
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"Policy: bad regex {pat!r}: {e}") from None
        if self.min_ndim < 2:
            raise ValueError(f"Policy.min_ndim must be >= 2, got {self.min_ndim}")

    def kept(self, path: str) -> bool:
        return any(re.search(p, path) for p in self.keep)

    def wants(self, path: str, leaf, stacked: int = 0) -> bool:
        """Whether the leaf at ``path`` becomes NVFP4; ``stacked``: how many of its leading
        axes stack layers (``nn.scan``), which do not count as matrix axes."""
        shape = jnp.shape(leaf)
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return False
        if len(shape) - stacked < self.min_ndim or min(shape[-2:]) < self.min_size:
            return False
        if self.include and not any(re.search(p, path) for p in self.include):
            return False
        return not self.kept(path)


DEFAULT_POLICY = Policy()


def quantize_params(tree, policy: Optional[Policy] = None, *, rounding="nearest", key=None):
    """Replace the leaves the policy selects by :class:`NVFP4Array` (others keep their dtype,
    or ``policy.keep_dtype`` for kept leaves). Leaves already in NVFP4 pass through."""
    policy = policy or DEFAULT_POLICY

    def one(path, leaf):
        if is_nvfp4(leaf):
            return leaf
        p = path_str(path)
        if policy.wants(p, leaf):
            return quantize(leaf, block=policy.block, rounding=rounding, key=key)
        if policy.keep_dtype is not None and policy.kept(p) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return as_array(leaf).astype(policy.keep_dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_nvfp4)


def dequantize_params(tree, dtype=jnp.bfloat16):
    """NVFP4 leaves dequantized to ``dtype``; other floating leaves cast to ``dtype``;
    non-float leaves unchanged. The result is what a model computes with."""

    def one(leaf):
        if is_nvfp4(leaf):
            return dequantize(leaf, dtype)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree.map(one, tree, is_leaf=is_nvfp4)


__all__ = ["Policy", "DEFAULT_POLICY", "quantize_params", "dequantize_params", "path_str", "NVFP4Array"]
