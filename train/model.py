"""A Llama-style decoder in Flax linen whose linear layers can run the NVFP4 recipe.

RMSNorm, rotary positions, grouped-query attention and the SwiGLU MLP follow Hugging Face's
``LlamaForCausalLM`` definitions (same formulas, rounding order and rotary channel layout), so
:func:`jax_nvfp4.export.export_hf` writes checkpoints ``transformers`` and vLLM load without any
permutation. Blocks run under ``nn.scan`` so every stacked kernel is one
``[layers, in, out]`` array (one NVFP4 amax per layer). Blocks kept in bf16 (the first/last N)
live in their own scanned segments, ``blocks_first`` and ``blocks_last``, so a path regex can
keep them out of NVFP4.

Parameter paths (``jax_nvfp4.path_str``): ``embed``, ``blocks/attn/{q,k,v,out}/kernel``,
``blocks/mlp/{gate,up,down}/kernel``, ``blocks/norm{1,2}/scale``, ``norm_f/scale``,
``head/kernel`` (absent with ``tie_embeddings``: the head is ``embed`` transposed). The k/v
kernels are ``[d_model, kv_heads * head_dim]``.
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
    """HF ``LlamaRMSNorm``: normalize in float32, round to the activation dtype, then scale
    (``weight * x.to(input_dtype)``, the product in the activation dtype)."""

    eps: float = 1e-5
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        scale = param(self, "scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale.astype(self.dtype)


def rotary(x, theta: float):
    """Rotary position embedding on ``x [batch, seq, heads, head_dim]``.

    HF Llama's layout (``rotate_half``): channel ``i`` pairs with channel ``i + head_dim/2``,
    frequency ``theta ** (-2i / head_dim)``; cos/sin are computed in float32 and rounded to
    the activation dtype before the products, as HF does.
    """
    _, seq, _, hd = x.shape
    half = hd // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def linear(features: int, name: str, compute: str, dtype, init_std: float) -> NVFP4Dense:
    """A bias-free linear layer whose GEMM follows ``compute`` (dequant or the NVFP4 recipe)."""
    return NVFP4Dense(features, compute=compute, dtype=dtype, name=name,
                      kernel_init=nn.initializers.normal(init_std))


def attention_implementation(choice: str, head_dim: int, dtype) -> str:
    """``jax.nn.dot_product_attention``'s ``implementation`` for ``choice`` (auto | xla | cudnn).

    In jax 0.10 its own default is always XLA; ``auto`` asks for cuDNN's fused (flash)
    kernel on GPU when the shapes and dtype are ones cuDNN takes (bf16/fp16, head size a
    multiple of 8 up to 128), and XLA elsewhere (CPU, TPU)."""
    if choice != "auto":
        return choice
    fits = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if jax.default_backend() == "gpu" and fits else "xla"


class Attention(nn.Module):
    """Causal grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value
    heads (``heads % kv_heads == 0``; ``kv_heads == heads`` is multi-head attention), through
    ``jax.nn.dot_product_attention`` (see :func:`attention_implementation`)."""

    d_model: int
    heads: int
    kv_heads: int
    rope_theta: float
    compute: str
    init_std: float
    dtype: Any = jnp.bfloat16
    implementation: str = "auto"

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        hd = self.d_model // self.heads
        dense = lambda name, f: linear(f, name, self.compute, self.dtype, self.init_std)
        q = dense("q", self.heads * hd)(x).reshape(b, t, self.heads, hd)
        k = dense("k", self.kv_heads * hd)(x).reshape(b, t, self.kv_heads, hd)
        v = dense("v", self.kv_heads * hd)(x).reshape(b, t, self.kv_heads, hd)
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        out = jax.nn.dot_product_attention(q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype),
                                           is_causal=True,
                                           implementation=attention_implementation(self.implementation, hd, self.dtype))
        return dense("out", self.d_model)(out.reshape(b, t, self.heads * hd))


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
    kv_heads: int
    hidden: int
    rope_theta: float
    norm_eps: float
    compute: str
    init_std: float
    dtype: Any = jnp.bfloat16
    attention: str = "auto"

    @nn.compact
    def __call__(self, x, _):
        h = RMSNorm(self.norm_eps, self.dtype, name="norm1")(x)
        x = x + Attention(self.d_model, self.heads, self.kv_heads, self.rope_theta, self.compute, self.init_std,
                          self.dtype, self.attention, name="attn")(h)
        h = RMSNorm(self.norm_eps, self.dtype, name="norm2")(x)
        x = x + MLP(self.d_model, self.hidden, self.compute, self.init_std, self.dtype, name="mlp")(h)
        return x, None


class GPT(nn.Module):
    """Decoder-only transformer (the Llama architecture).

    ``compute``: ``"dequant"`` (weights dequantized by the caller, GEMMs in ``dtype``) or
    ``"nvfp4"`` (the recipe's quantized GEMMs; stored NVFP4 kernels come in through the
    ``"nvfp4"`` collection, see :func:`nvfp4_collection`).
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    hidden: int
    kv_heads: Optional[int] = None  # None: = heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "auto"  # auto | xla | cudnn, see attention_implementation
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
            x, _ = stack(self.d_model, self.heads, self.kv_heads or self.heads, self.hidden, self.rope_theta,
                         self.norm_eps, self.compute, self.init_std, self.dtype, self.attention, name=name)(x, None)
        x = RMSNorm(self.norm_eps, self.dtype, name="norm_f")(x)
        if self.tie_embeddings:
            # Logits in the activation dtype, like the untied head (and HF's lm_head).
            return jnp.einsum("btd,vd->btv", x, embed.astype(self.dtype)).astype(jnp.float32)
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
        kv_heads=model_cfg.n_kv_heads,
        hidden=model_cfg.mlp_hidden,
        rope_theta=model_cfg.rope_theta,
        norm_eps=model_cfg.norm_eps,
        tie_embeddings=model_cfg.tie_embeddings,
        attention=model_cfg.attention,
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
