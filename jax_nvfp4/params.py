"""Which parameters live in NVFP4: a policy, ``quantize_params`` and ``dequantize_params``."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Dict, Optional, Tuple

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

    ``shared_amax``: regexes with one capture group each; the NVFP4 leaves a pattern matches
    whose paths differ only in the captured part share one global amax, the maximum of
    theirs (per matrix of a stacked leaf), e.g. ``r"attn/(q|k|v)/kernel$"``: the q, k and v
    of a layer, as a fused ``qkv`` projection of a serving engine (vLLM, SGLang) has one
    global scale. Their block scales stay their own.

    ``four_over_six``: every quantization of these leaves (here, in :func:`master_weights`'s
    re-quantization and in :func:`jax_nvfp4.hf.load_hf`) chooses each block's scale by
    :func:`jax_nvfp4.array.four_over_six_scales`. Off, the bits are the reference recipe's.
    """

    include: Tuple[str, ...] = ()
    keep: Tuple[str, ...] = ()
    keep_dtype: Optional[Any] = None
    min_ndim: int = 2
    min_size: int = 16
    block: Tuple[int, int] = BLOCK_2D
    shared_amax: Tuple[str, ...] = ()
    four_over_six: bool = False

    def __post_init__(self):
        for pat in (*self.include, *self.keep, *self.shared_amax):
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"Policy: bad regex {pat!r}: {e}") from None
        for pat in self.shared_amax:
            if re.compile(pat).groups != 1:
                raise ValueError(f"Policy.shared_amax: {pat!r} needs exactly one capture group (the part that "
                                 "differs between the leaves sharing an amax, e.g. 'attn/(q|k|v)/kernel$')")
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


    def amax_group(self, path: str) -> Optional[str]:
        """The key of the group of leaves whose amax the leaf at ``path`` shares (the first
        ``shared_amax`` pattern it matches, its captured part replaced by ``*``), or None."""
        for i, pat in enumerate(self.shared_amax):
            m = re.search(pat, path)
            if m:
                return f"{i}:{path[:m.start(1)]}*{path[m.end(1):]}"
        return None


DEFAULT_POLICY = Policy()


def shared_amaxes(amaxes: Dict[str, jax.Array], policy: Optional[Policy]) -> Dict[str, jax.Array]:
    """``{path: amax}`` of NVFP4 leaves (``[...]`` float32, one per matrix) -> the amax each
    is quantized with: the elementwise maximum over its :meth:`Policy.amax_group` (NaN wins,
    as an integer maximum of the bits), or its own. A group's leaves must stack the same
    number of matrices."""
    groups: Dict[str, list] = {}
    for path in amaxes:
        key = policy.amax_group(path) if policy is not None else None
        if key is not None:
            groups.setdefault(key, []).append(path)
    out = dict(amaxes)
    for key, paths in groups.items():
        shapes = {tuple(jnp.shape(amaxes[p])) for p in paths}
        if len(shapes) > 1:
            raise ValueError(f"Policy.shared_amax: {', '.join(paths)} share an amax but stack different numbers "
                             f"of matrices {sorted(shapes)}")
        bits = [jax.lax.bitcast_convert_type(jnp.asarray(amaxes[p], jnp.float32), jnp.uint32) for p in paths]
        shared = jax.lax.bitcast_convert_type(functools.reduce(jnp.maximum, bits), jnp.float32)
        out.update({p: shared for p in paths})
    return out


def matrix_amax(leaf) -> jax.Array:
    """max(|x|) of each matrix of a float leaf (NaN-propagating), as quantize computes it."""
    from jax_nvfp4 import numerics as nx

    return nx.abs_max(jnp.asarray(leaf), axis=(-2, -1))


def quantize_params(tree, policy: Optional[Policy] = None, *, rules=None, rounding="nearest", key=None):
    """Replace the leaves the policy selects by :class:`NVFP4Array` (others keep their dtype,
    or ``policy.keep_dtype`` for kept leaves). Leaves already in NVFP4 pass through. ``rules``
    (:class:`~jax_nvfp4.rules.Rules`): its ``stacked`` patterns name leaves whose leading axis
    stacks layers (``nn.scan``), which is not a matrix axis, as in
    :func:`~jax_nvfp4.sharding.shard_params` (a stacked ``[L, d]`` norm scale stays a vector)."""
    policy = policy or DEFAULT_POLICY
    wants = lambda p, x: policy.wants(p, x, rules.stacked_axes(p) if rules is not None else 0)
    amax = shared_amaxes({path_str(k): matrix_amax(x) for k, x in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=is_nvfp4)[0] if not is_nvfp4(x) and wants(path_str(k), x)
        and policy.amax_group(path_str(k))}, policy)

    def one(path, leaf):
        if is_nvfp4(leaf):
            return leaf
        p = path_str(path)
        if wants(p, leaf):
            return quantize(leaf, block=policy.block, rounding=rounding, key=key, amax=amax.get(p),
                            four_over_six=policy.four_over_six)
        if policy.keep_dtype is not None and policy.kept(p) and jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
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


__all__ = ["Policy", "DEFAULT_POLICY", "quantize_params", "dequantize_params", "path_str", "matrix_amax", "shared_amaxes",
           "NVFP4Array"]
