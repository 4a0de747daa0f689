"""A GPT-style decoder in Flax linen whose linear layers can run the NVFP4 recipe.

RMSNorm, rotary attention, SwiGLU MLP; blocks under ``nn.scan`` so every stacked kernel is one
``[layers, in, out]`` array (one NVFP4 amax per layer). Blocks kept in bf16 (the first/last N)
live in their own scanned segments, ``blocks_first`` and ``blocks_last``, so a path regex can
keep them out of NVFP4.

Parameter paths (``jax_nvfp4.path_str``): ``embed``, ``blocks/attn/{q,k,v,out}/kernel``,
``blocks/mlp/{gate,up,down}/kernel``, ``blocks/norm{1,2}/scale``, ``norm_f/scale``,
``head/kernel``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_nvfp4.nn import NVFP4_COLLECTION, ROUNDING_RNG, NVFP4Dense, param

# Tensor-parallel splits: column-parallel inputs, row-parallel outputs (Megatron style).
TENSOR_RULES = (
    (r"attn/(q|k|v)/kernel", -1),
    (r"attn/out/kernel", -2),
    (r"mlp/(gate|up)/kernel", -1),
    (r"mlp/down/kernel", -2),
)
SEGMENTS = ("blocks_first", "blocks", "blocks_last")


class RMSNorm(nn.Module):
    eps: float = 1e-6
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        scale = param(self, "scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rotary(x, theta: float):
    """Rotary position embedding on ``x [batch, seq, heads, head_dim]`` (half-split form)."""
    _, seq, _, hd = x.shape
    half = hd // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def linear(features: int, name: str, compute: str, dtype, init_std: float) -> NVFP4Dense:
    """A bias-free linear layer whose GEMM follows ``compute`` (dequant or the NVFP4 recipe)."""
    return NVFP4Dense(features, compute=compute, dtype=dtype, name=name,
                      kernel_init=nn.initializers.normal(init_std))


class Attention(nn.Module):
    d_model: int
    heads: int
    rope_theta: float
    compute: str
    init_std: float
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        hd = self.d_model // self.heads
        dense = lambda name: linear(self.d_model, name, self.compute, self.dtype, self.init_std)
        q, k, v = (dense(n)(x).reshape(b, t, self.heads, hd) for n in ("q", "k", "v"))
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(hd).astype(jnp.float32)
        mask = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(mask[None, None], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, self.d_model)
        return dense("out")(out)


class MLP(nn.Module):
    d_model: int
    hidden: int
    compute: str
    init_std: float
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        dense = lambda n, f: linear(f, n, self.compute, self.dtype, self.init_std)
        h = jax.nn.silu(dense("gate", self.hidden)(x)) * dense("up", self.hidden)(x)
        return dense("down", self.d_model)(h)


class Block(nn.Module):
    d_model: int
    heads: int
    hidden: int
    rope_theta: float
    compute: str
    init_std: float
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x, _):
        h = RMSNorm(dtype=self.dtype, name="norm1")(x)
        x = x + Attention(self.d_model, self.heads, self.rope_theta, self.compute, self.init_std, self.dtype, name="attn")(h)
        h = RMSNorm(dtype=self.dtype, name="norm2")(x)
        x = x + MLP(self.d_model, self.hidden, self.compute, self.init_std, self.dtype, name="mlp")(h)
        return x, None


class GPT(nn.Module):
    """Decoder-only transformer over byte tokens.

    ``compute``: ``"dequant"`` (weights dequantized by the caller, GEMMs in ``dtype``) or
    ``"nvfp4"`` (the recipe's quantized GEMMs; stored NVFP4 kernels come in through the
    ``"nvfp4"`` collection, see :func:`nvfp4_collection`).
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    hidden: int
    rope_theta: float = 10000.0
    init_std: float = 0.02
    keep_first: int = 0
    keep_last: int = 0
    compute: str = "dequant"
    dtype: Any = jnp.bfloat16
    remat: Optional[str] = None

    @nn.compact
    def __call__(self, tokens):
        embed = param(self, "embed", nn.initializers.normal(self.init_std), (self.vocab, self.d_model), jnp.float32)
        x = embed.astype(self.dtype)[tokens]
        counts = (self.keep_first, self.layers - self.keep_first - self.keep_last, self.keep_last)
        for name, n in zip(SEGMENTS, counts):
            if n == 0:
                continue
            stack = nn.scan(
                _remat(Block, self.remat),
                variable_axes={"params": 0, NVFP4_COLLECTION: 0},
                split_rngs={"params": True, ROUNDING_RNG: True},
                length=n,
            )
            x, _ = stack(self.d_model, self.heads, self.hidden, self.rope_theta, self.compute,
                         self.init_std, self.dtype, name=name)(x, None)
        x = RMSNorm(dtype=self.dtype, name="norm_f")(x)
        head = linear(self.vocab, "head", self.compute, self.dtype, self.init_std)
        return head(x).astype(jnp.float32)


# Remat policies for the scanned blocks. None keeps every residual (one program for the whole
# model); the sharded step recomputes each layer in the backward pass instead of keeping
# every layer's gathered weights alive: "nothing" saves only the carries, "dots" also the
# outputs of the weight matmuls (never the weights themselves: they are not dot outputs).
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _remat(block, policy: Optional[str]):
    if policy is None:
        return block
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat policy must be one of {sorted(REMAT_POLICIES)}, got {policy!r}")
    return nn.remat(block, policy=REMAT_POLICIES[policy], prevent_cse=False)


def from_config(model_cfg, nvfp4_cfg) -> GPT:
    return GPT(
        vocab=model_cfg.vocab,
        d_model=model_cfg.d_model,
        layers=model_cfg.layers,
        heads=model_cfg.heads,
        hidden=model_cfg.mlp_hidden,
        rope_theta=model_cfg.rope_theta,
        init_std=model_cfg.init_std,
        keep_first=nvfp4_cfg.keep_first_blocks,
        keep_last=nvfp4_cfg.keep_last_blocks,
        compute=nvfp4_cfg.compute if nvfp4_cfg.weights == "nvfp4" else "dequant",
    )


def nvfp4_collection(tree) -> Optional[Dict[str, Any]]:
    """The sub-tree of ``tree`` (nested dicts) holding only its ``NVFP4Array`` leaves, as the
    ``"nvfp4"`` variable collection; None when there are none."""
    from jax_nvfp4 import is_nvfp4

    if is_nvfp4(tree):
        return tree
    if isinstance(tree, dict) or hasattr(tree, "items"):
        out = {k: nvfp4_collection(v) for k, v in tree.items()}
        out = {k: v for k, v in out.items() if v is not None}
        return out or None
    return None


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in nats."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
