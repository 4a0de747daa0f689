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

import dataclasses
import math

from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.export import HFNames
from jax_nvfp4.nn import NVFP4_COLLECTION, ROUNDING_RNG, NVFP4Dense, Recipe
from jax_nvfp4.params import Policy
from jax_nvfp4.tensor_parallel import TensorParallel, vocab_embed, vocab_token_losses
from train.attention import attention

# Tensor-parallel splits (Megatron style): column-parallel q/k/v/gate/up (split along their
# outputs), row-parallel out/down (along their inputs), the embedding and head along the
# vocabulary. Heads split with their columns; the residual stream between blocks is split
# along the sequence (sequence parallelism, see jax_nvfp4.tensor_parallel).
TENSOR_RULES = (
    (r"attn/(q|k|v)/kernel", -1),
    (r"attn/out/kernel", -2),
    (r"mlp/(gate|up)/kernel", -1),
    (r"mlp/down/kernel", -2),
    (r"^embed$", -2),
    (r"^head/kernel$", -1),
)


def tensor_rules(kv_heads: int, tensor: int) -> tuple:
    """:data:`TENSOR_RULES` for ``kv_heads`` key/value heads on a tensor axis of ``tensor``:
    with fewer key/value heads than tensor ranks the k and v kernels are not split but
    replicated over the tensor axis (Megatron's choice), each rank using the head its query
    heads share (see :class:`Attention`)."""
    if kv_heads % tensor == 0:
        return TENSOR_RULES
    return ((r"attn/q/kernel", -1),) + tuple(r for r in TENSOR_RULES if not r[0].startswith("attn/(q|k|v)"))
SEGMENTS = ("blocks_first", "blocks", "blocks_last")
# The segments of the blocks kept in bf16: stored in bf16 (train.plan.policy_for) and, under
# compute="nvfp4", run with bf16 GEMMs.
KEPT_SEGMENTS = ("blocks_first", "blocks_last")


# The Hugging Face names of this model's params (``LlamaForCausalLM``): the model's rotary
# layout, RMSNorm and SwiGLU are HF Llama's own, so the weights map one to one
# (jax_nvfp4.export writes them, train.hf_import reads them).
HF_NAMES = HFNames.of(
    top={"embed": "model.embed_tokens", "norm_f/scale": "model.norm", "head/kernel": "lm_head"},
    layer={"attn/q/kernel": "self_attn.q_proj", "attn/k/kernel": "self_attn.k_proj",
           "attn/v/kernel": "self_attn.v_proj", "attn/out/kernel": "self_attn.o_proj",
           "mlp/gate/kernel": "mlp.gate_proj", "mlp/up/kernel": "mlp.up_proj", "mlp/down/kernel": "mlp.down_proj",
           "norm1/scale": "input_layernorm", "norm2/scale": "post_attention_layernorm"},
    segments=SEGMENTS,
)


def llama_config(*, vocab: int, d_model: int, layers: int, heads: int, mlp_hidden: int,
                 kv_heads: Optional[int] = None, rope_theta: float = 10000.0, rope_scaling: Any = None,
                 norm_eps: float = 1e-5, tie_embeddings: bool = False, max_position_embeddings: int = 2048,
                 bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None) -> Dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with these shapes (bf16); ``rope_scaling``
    (:func:`rope_frequencies`) is written as transformers' ``rope_scaling`` (``rope_type: llama3``)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": int(d_model), "intermediate_size": int(mlp_hidden),
        "num_hidden_layers": int(layers), "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads or heads), "head_dim": int(d_model) // int(heads),
        "hidden_act": "silu", "rms_norm_eps": float(norm_eps), "rope_theta": float(rope_theta),
        "rope_scaling": _rope_scaling_json(rope_scaling), "max_position_embeddings": int(max_position_embeddings),
        "tie_word_embeddings": bool(tie_embeddings), "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }


class RMSNorm(nn.Module):
    """HF ``LlamaRMSNorm``: normalize in float32, round to the activation dtype, then scale
    (``weight * x.to(input_dtype)``, the product in the activation dtype)."""

    eps: float = 1e-5
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale.astype(self.dtype)


# The keys of a Llama 3.x rotary scaling (transformers' rope_type "llama3").
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling_json(scaling) -> Optional[Dict[str, Any]]:
    """``scaling`` (None, a mapping or an object with :data:`ROPE_SCALING_KEYS`) as the
    ``rope_scaling`` of a ``config.json``."""
    if scaling is None:
        return None
    get = scaling.get if isinstance(scaling, dict) else lambda k: getattr(scaling, k)
    out = {"rope_type": "llama3"}
    for k in ROPE_SCALING_KEYS:
        out[k] = int(get(k)) if k == "original_max_position_embeddings" else float(get(k))
    return out


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim / 2] float32``, as transformers computes them
    (``_compute_default_rope_parameters`` and, with ``scaling``, ``_compute_llama3_parameters``),
    step by step in float32 on the host: ``1 / theta ** (2i / head_dim)`` (the float32 base's
    power correctly rounded: torch's float32 power is not always, so for some shapes an entry
    differs by an ulp or two; for Llama 3 / 3.1's shapes none does); then Llama 3.x's scaling
    (``scaling``: a :class:`train.config.RopeScaling`, or a mapping of
    :data:`ROPE_SCALING_KEYS`): frequencies whose wavelength ``2 pi / f`` exceeds
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
    below ``original / high_freq_factor`` are kept, the ones between interpolate with
    ``s = (original / wavelength - low) / (high - low)``: ``(1 - s) f / factor + s f``."""
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    inv_freq = f32(1) / (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(f32)
    s = _rope_scaling_json(scaling)
    if s is None:
        return inv_freq
    factor, low, high = f32(s["factor"]), f32(s["low_freq_factor"]), f32(s["high_freq_factor"])
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = f32(old / s["low_freq_factor"]), f32(old / s["high_freq_factor"])
    wavelen = np.reciprocal(inv_freq) * f32(2 * math.pi)  # torch: 2 * pi / t is t.reciprocal() * (2 * pi)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (np.reciprocal(wavelen) * f32(old) - low) / f32(s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rotary(x, theta: float, scaling=None):
    """Rotary position embedding on ``x [batch, seq, heads, head_dim]``.

    HF Llama's layout (``rotate_half``): channel ``i`` pairs with channel ``i + head_dim/2``,
    frequency :func:`rope_frequencies` (``theta ** (-2i / head_dim)``, with Llama 3.x's
    ``scaling`` if given); the angles and cos/sin are computed in float32 and rounded to the
    activation dtype before the products, as HF does.
    """
    _, seq, _, hd = x.shape
    half = hd // 2
    inv_freq = jnp.asarray(rope_frequencies(hd, theta, scaling))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def linear(features: int, name: str, compute: str, dtype, init_std: float, recipe: Recipe = Recipe()) -> NVFP4Dense:
    """A bias-free linear layer whose GEMM follows ``compute`` (dequant or the NVFP4 recipe)."""
    return NVFP4Dense(features, compute=compute, dtype=dtype, name=name,
                      kernel_init=nn.initializers.normal(init_std), recipe=recipe)


@dataclasses.dataclass(frozen=True)
class Dims:
    """The hyperparameters the layers of a block read (frozen, hashable: a Flax attribute)."""

    d_model: int
    heads: int
    kv_heads: int
    hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    compute: str = "dequant"
    init_std: float = 0.02
    dtype: Any = jnp.bfloat16
    attention: str = "auto"  # see train.attention.attention
    tensor: TensorParallel = TensorParallel()
    recipe: Recipe = Recipe()
    rope_scaling: Any = None  # Llama 3.x rotary scaling (rope_frequencies); hashable

    def dense(self, name: str, features: int) -> NVFP4Dense:
        return linear(features, name, self.compute, self.dtype, self.init_std, self.recipe)


class Attention(nn.Module):
    """Causal grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value
    heads (``heads % kv_heads == 0``; ``kv_heads == heads`` is multi-head attention), through
    :func:`train.attention.attention`.

    Tensor parallel (``dims.tensor``): the sequence-split input is gathered, each rank runs
    its ``heads / t`` query heads and ``kv_heads / t`` key/value heads (column-parallel q, k,
    v), and the row-parallel output projection's partial sums are reduce-scattered back to
    the sequence split. With fewer key/value heads than ranks (``t % kv_heads == 0``) the k
    and v kernels are replicated (:func:`tensor_rules`): each rank computes every key/value
    head and keeps the one its query heads share."""

    dims: Dims

    @nn.compact
    def __call__(self, x):
        d, tp = self.dims, self.dims.tensor
        x = tp.gather_sequence(x)
        b, t, _ = x.shape
        hd = d.d_model // d.heads
        heads = tp.split(d.heads, "model.heads")
        replicated = d.kv_heads % tp.size != 0
        kv = d.kv_heads if replicated else tp.split(d.kv_heads, "model.kv_heads")
        q = d.dense("q", heads * hd)(x).reshape(b, t, heads, hd)
        k = d.dense("k", kv * hd)(x).reshape(b, t, kv, hd)
        v = d.dense("v", kv * hd)(x).reshape(b, t, kv, hd)
        if replicated:  # the one key/value head this rank's query heads share
            mine = tp.index() * d.kv_heads // tp.size
            k, v = (jax.lax.dynamic_slice_in_dim(a, mine, 1, axis=2) for a in (k, v))
        q, k = rotary(q, d.rope_theta, d.rope_scaling), rotary(k, d.rope_theta, d.rope_scaling)
        out = attention(q.astype(d.dtype), k.astype(d.dtype), v.astype(d.dtype), d.attention)
        return tp.scatter_sequence(d.dense("out", d.d_model)(out.reshape(b, t, heads * hd)))


class MLP(nn.Module):
    """SwiGLU; tensor parallel: column-parallel gate/up, row-parallel down (as attention)."""

    dims: Dims

    @nn.compact
    def __call__(self, x):
        d, tp = self.dims, self.dims.tensor
        x = tp.gather_sequence(x)
        hidden = tp.split(d.hidden, "model.mlp_hidden")
        h = jax.nn.silu(d.dense("gate", hidden)(x)) * d.dense("up", hidden)(x)
        return tp.scatter_sequence(d.dense("down", d.d_model)(h))


class Block(nn.Module):
    dims: Dims

    @nn.compact
    def __call__(self, x, _):
        d = self.dims
        h = RMSNorm(d.norm_eps, d.dtype, name="norm1")(x)
        x = x + Attention(d, name="attn")(h)
        h = RMSNorm(d.norm_eps, d.dtype, name="norm2")(x)
        x = x + MLP(d, name="mlp")(h)
        return x, None


class Llama(nn.Module):
    """Decoder-only transformer (the Llama architecture).

    ``compute``: ``"dequant"`` (weights dequantized by the caller, GEMMs in ``dtype``) or
    ``"nvfp4"`` (the recipe's quantized GEMMs; stored NVFP4 kernels come in as
    :class:`jax_nvfp4.fetch.Shard` boxes or through the ``"nvfp4"`` collection). It
    applies to the layers stored in NVFP4: the blocks kept in bf16 (``keep_first``/``keep_last``) and the head when
    ``keep_head`` run their GEMMs in ``dtype``, as the published recipe keeps its last layers
    and output projection in high precision.

    ``tensor``: inside a ``shard_map`` manual over the tensor axis, the model computes this
    rank's part (Megatron tensor parallelism with sequence parallelism, see
    :mod:`jax_nvfp4.tensor_parallel`): it reads this rank's shards of the split weights (the
    embedding's and head's vocabulary rows/columns, heads, MLP columns) and returns this
    rank's vocabulary columns of the logits, for :func:`cross_entropy` with the same
    ``tensor``. Off (the default, and at init) it is the whole model on one device.
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    hidden: int
    kv_heads: Optional[int] = None  # None: = heads
    rope_theta: float = 10000.0
    rope_scaling: Any = None  # None, or Llama 3.x rotary scaling (train.config.RopeScaling; rope_frequencies)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "auto"  # see train.attention.attention
    init_std: float = 0.02
    keep_first: int = 0
    keep_last: int = 0
    keep_head: bool = True
    compute: str = "dequant"
    recipe: Recipe = Recipe()  # with compute="nvfp4": the recipe's elements (jax_nvfp4.nn.Recipe)
    dtype: Any = jnp.bfloat16
    remat: Optional[str] = None
    tensor: TensorParallel = TensorParallel()

    @nn.compact
    def __call__(self, tokens):
        tp = self.tensor
        vocab = tp.split(self.vocab, "model.vocab")
        embed = self.param("embed", nn.initializers.normal(self.init_std), (vocab, self.d_model), jnp.float32)
        x = vocab_embed(embed.astype(self.dtype), tokens, tp)
        counts = (self.keep_first, self.layers - self.keep_first - self.keep_last, self.keep_last)
        for name, n in zip(SEGMENTS, counts):
            if n == 0:
                continue
            compute = "dequant" if name in KEPT_SEGMENTS else self.compute
            dims = Dims(self.d_model, self.heads, self.kv_heads or self.heads, self.hidden, self.rope_theta,
                        self.norm_eps, compute, self.init_std, self.dtype, self.attention, tp, self.recipe,
                        rope_scaling=self.rope_scaling)
            stack = nn.scan(
                _remat(Block, self.remat),
                variable_axes={"params": 0, NVFP4_COLLECTION: 0},
                split_rngs={"params": True, ROUNDING_RNG: True},
                length=n,
            )
            x, _ = stack(dims, name=name)(x, None)
        x = tp.gather_sequence(RMSNorm(self.norm_eps, self.dtype, name="norm_f")(x))
        if self.tie_embeddings:
            # Logits in the activation dtype, like the untied head (and HF's lm_head).
            return jnp.einsum("btd,vd->btv", x, embed.astype(self.dtype)).astype(jnp.float32)
        head = linear(vocab, "head", "dequant" if self.keep_head else self.compute, self.dtype, self.init_std,
                      self.recipe)
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


def from_config(model_cfg, nvfp4_cfg) -> Llama:
    same = ("vocab", "d_model", "layers", "heads", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings",
            "attention", "init_std")
    return Llama(
        **{k: getattr(model_cfg, k) for k in same},
        kv_heads=model_cfg.n_kv_heads,
        hidden=model_cfg.mlp_hidden,
        keep_first=nvfp4_cfg.keep_first_blocks,
        keep_last=nvfp4_cfg.keep_last_blocks,
        keep_head=Policy(keep=tuple(nvfp4_cfg.keep_bf16)).kept("head/kernel"),
        compute=nvfp4_cfg.compute if nvfp4_cfg.weights == "nvfp4" else "dequant",
        recipe=Recipe(stochastic_grads=nvfp4_cfg.grad_rounding == "stochastic",
                      hadamard_wgrad=nvfp4_cfg.wgrad_hadamard,
                      quantize_activations=nvfp4_cfg.activations == "nvfp4"),
    )


def cross_entropy(logits, targets, tensor: TensorParallel = TensorParallel()):
    """Mean next-token cross-entropy in nats (``tensor``: ``logits`` are this rank's
    vocabulary columns, :func:`jax_nvfp4.tensor_parallel.vocab_token_losses`)."""
    if tensor.on:
        return jnp.mean(vocab_token_losses(logits, targets, tensor))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
