"""A Llama decoder in Flax linen whose linear layers can run the NVFP4 recipe, with Hugging Face
``LlamaForCausalLM``'s formulas, rounding order and rotary layout (exports load unpermuted). Blocks run
under ``nn.scan`` (a kernel is ``[layers, in, out]``), those kept in bf16 as ``blocks_first``/``_last``."""

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
from train.config import ROPE_SCALING_KEYS

# Megatron tensor-parallel splits: q/k/v/gate/up along their outputs, out/down along their inputs,
# embedding and head along the vocabulary (the residual between blocks is split along the sequence).
TENSOR_RULES = ((r"attn/(q|k|v)/kernel", -1), (r"attn/out/kernel", -2), (r"mlp/(gate|up)/kernel", -1),
                (r"mlp/down/kernel", -2), (r"^embed$", -2), (r"^head/kernel$", -1))


def tensor_rules(kv_heads: int, tensor: int) -> tuple:
    """:data:`TENSOR_RULES` for a tensor axis of ``tensor``: with fewer key/value heads than ranks the k
    and v kernels are replicated, not split (each rank uses the head its query heads share)."""
    if kv_heads % tensor == 0:
        return TENSOR_RULES
    return ((r"attn/q/kernel", -1),) + tuple(r for r in TENSOR_RULES if not r[0].startswith("attn/(q|k|v)"))


SEGMENTS = ("blocks_first", "blocks", "blocks_last")
KEPT_SEGMENTS = ("blocks_first", "blocks_last")  # stored in bf16, with bf16 GEMMs under compute="nvfp4"

# The Hugging Face names of the params: the weights map one to one.
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
    """The bf16 ``config.json`` of a ``LlamaForCausalLM`` with these shapes."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": int(d_model), "intermediate_size": int(mlp_hidden),
        "num_hidden_layers": int(layers), "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads or heads), "head_dim": int(d_model) // int(heads),
        "hidden_act": "silu", "rms_norm_eps": float(norm_eps), "rope_theta": float(rope_theta),
        "rope_scaling": _rope_scaling_json(rope_scaling), "max_position_embeddings": int(max_position_embeddings),
        "tie_word_embeddings": bool(tie_embeddings), "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }


class RMSNorm(nn.Module):
    """HF ``LlamaRMSNorm``: normalize in float32, round to ``dtype``, then scale in ``dtype``."""

    eps: float = 1e-5
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale.astype(self.dtype)


def _rope_scaling_json(scaling) -> Optional[Dict[str, Any]]:
    """``scaling`` (None, a mapping or an object with :data:`ROPE_SCALING_KEYS`) as ``config.json`` has it."""
    if scaling is None:
        return None
    get = scaling.get if isinstance(scaling, dict) else lambda k: getattr(scaling, k)
    return {"rope_type": "llama3", **{k: int(get(k)) if k == "original_max_position_embeddings" else float(get(k))
                                      for k in ROPE_SCALING_KEYS}}


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim / 2] float32``, step by step as transformers computes them
    (with Llama 3.x's ``scaling``: a :class:`train.config.RopeScaling` or a mapping). The float32 power is
    correctly rounded, torch's not always: an entry may differ by an ulp or two (for Llama 3 / 3.1 none)."""
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    inv_freq = f32(1) / (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(f32)
    s = _rope_scaling_json(scaling)
    if s is None:
        return inv_freq
    factor, low = f32(s["factor"]), f32(s["low_freq_factor"])
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = f32(old / s["low_freq_factor"]), f32(old / s["high_freq_factor"])
    wavelen = np.reciprocal(inv_freq) * f32(2 * math.pi)  # torch: 2 * pi / t is t.reciprocal() * (2 * pi)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (np.reciprocal(wavelen) * f32(old) - low) / f32(s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rotary(x, theta: float, scaling=None):
    """HF Llama's rotary embedding (``rotate_half``) on ``x [batch, seq, heads, head_dim]``: angles and
    cos/sin in float32, rounded to ``x``'s dtype before the products."""
    _, seq, _, hd = x.shape
    inv_freq = jnp.asarray(rope_frequencies(hd, theta, scaling))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
    return x * cos + jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1) * sin


@dataclasses.dataclass(frozen=True)
class Dims:
    """The hyperparameters a block's layers read, :class:`Llama`'s of these names (frozen, hashable: a Flax
    attribute)."""

    d_model: int
    heads: int
    kv_heads: int
    hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    compute: str = "dequant"
    init_std: float = 0.02
    dtype: Any = jnp.bfloat16
    attention: str = "auto"  # train.attention.attention's implementation
    tensor: TensorParallel = TensorParallel()
    recipe: Recipe = Recipe()
    rope_scaling: Any = None

    def dense(self, name: str, features: int) -> NVFP4Dense:
        """A bias-free linear layer whose GEMM follows ``compute`` (dequant or the NVFP4 recipe)."""
        return NVFP4Dense(features, compute=self.compute, dtype=self.dtype, name=name,
                          kernel_init=nn.initializers.normal(self.init_std), recipe=self.recipe)


class Attention(nn.Module):
    """Causal grouped-query attention (``heads % kv_heads == 0``); tensor parallel, each rank runs its share
    of the heads, or with fewer key/value heads than ranks computes them all (replicated kernels,
    :func:`tensor_rules`) and keeps the one its query heads share."""

    dims: Dims

    @nn.compact
    def __call__(self, x):
        d, tp = self.dims, self.dims.tensor
        b, t, _ = x.shape
        hd = d.d_model // d.heads
        heads = tp.split(d.heads, "model.heads")
        replicated = d.kv_heads % tp.size != 0
        kv = d.kv_heads if replicated else tp.split(d.kv_heads, "model.kv_heads")
        q = d.dense("q", heads * hd)(x).reshape(b, t, heads, hd)
        k = d.dense("k", kv * hd)(x).reshape(b, t, kv, hd)
        v = d.dense("v", kv * hd)(x).reshape(b, t, kv, hd)
        if replicated:
            mine = tp.index() * d.kv_heads // tp.size
            k, v = (jax.lax.dynamic_slice_in_dim(a, mine, 1, axis=2) for a in (k, v))
        q, k = rotary(q, d.rope_theta, d.rope_scaling), rotary(k, d.rope_theta, d.rope_scaling)
        out = attention(q.astype(d.dtype), k.astype(d.dtype), v.astype(d.dtype), d.attention)
        return d.dense("out", d.d_model)(out.reshape(b, t, heads * hd))


class MLP(nn.Module):
    """SwiGLU; tensor parallel: column-parallel gate/up, row-parallel down."""

    dims: Dims

    @nn.compact
    def __call__(self, x):
        d = self.dims
        hidden = d.tensor.split(d.hidden, "model.mlp_hidden")
        h = jax.nn.silu(d.dense("gate", hidden)(x)) * d.dense("up", hidden)(x)
        return d.dense("down", d.d_model)(h)


class Block(nn.Module):
    """Pre-norm attention and MLP; tensor parallel, each sees the whole sequence (the residual is split along it)."""

    dims: Dims

    @nn.compact
    def __call__(self, x, _):
        d, tp = self.dims, self.dims.tensor
        h = tp.gather_sequence(RMSNorm(d.norm_eps, d.dtype, name="norm1")(x))
        x = x + tp.scatter_sequence(Attention(d, name="attn")(h))
        h = tp.gather_sequence(RMSNorm(d.norm_eps, d.dtype, name="norm2")(x))
        return x + tp.scatter_sequence(MLP(d, name="mlp")(h)), None


# Remat policies of the scanned blocks (None keeps every residual): "nothing" saves only the carries,
# "dots" also the weight matmuls' outputs (never the gathered weights, which are no dot outputs).
REMAT_POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Llama(nn.Module):
    """Decoder-only transformer. ``compute``: ``"dequant"`` (GEMMs in ``dtype``) or ``"nvfp4"`` (the recipe's)
    for the layers stored in NVFP4; kept blocks and, with ``keep_head``, the head run in ``dtype``. ``tensor``
    (in a ``shard_map`` manual over it): this rank's part, returning its vocabulary columns of the logits."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    hidden: int
    kv_heads: Optional[int] = None  # None: = heads
    rope_theta: float = 10000.0
    rope_scaling: Any = None  # None, or a Llama 3.x rotary scaling (rope_frequencies)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "auto"  # train.attention.attention's implementation
    init_std: float = 0.02
    keep_first: int = 0
    keep_last: int = 0
    keep_head: bool = True
    compute: str = "dequant"
    recipe: Recipe = Recipe()  # with compute="nvfp4": the recipe's elements
    dtype: Any = jnp.bfloat16
    remat: Optional[str] = None  # None, or a key of REMAT_POLICIES (train.remat)
    tensor: TensorParallel = TensorParallel()

    @nn.compact
    def __call__(self, tokens):
        tp = self.tensor
        vocab = tp.split(self.vocab, "model.vocab")
        embed = self.param("embed", nn.initializers.normal(self.init_std), (vocab, self.d_model), jnp.float32)
        x = vocab_embed(embed.astype(self.dtype), tokens, tp)
        dims = Dims(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Dims) if f.name != "kv_heads"},
                    kv_heads=self.kv_heads or self.heads)
        kept = dataclasses.replace(dims, compute="dequant")
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat policy must be one of {sorted(REMAT_POLICIES)}, got {self.remat!r}")
        block = Block if self.remat is None else nn.remat(Block, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        counts = (self.keep_first, self.layers - self.keep_first - self.keep_last, self.keep_last)
        for name, n in zip(SEGMENTS, counts):
            if n:
                stack = nn.scan(block, variable_axes={"params": 0, NVFP4_COLLECTION: 0},
                                split_rngs={"params": True, ROUNDING_RNG: True}, length=n)
                x, _ = stack(kept if name in KEPT_SEGMENTS else dims, name=name)(x, None)
        x = tp.gather_sequence(RMSNorm(self.norm_eps, self.dtype, name="norm_f")(x))
        if self.tie_embeddings:  # logits in the activation dtype, like the untied head (and HF's lm_head)
            return jnp.einsum("btd,vd->btv", x, embed.astype(self.dtype)).astype(jnp.float32)
        return (kept if self.keep_head else dims).dense("head", vocab)(x).astype(jnp.float32)


def from_config(model_cfg, nvfp4_cfg) -> Llama:
    same = ("vocab", "d_model", "layers", "heads", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings",
            "attention", "init_std")
    return Llama(
        **{k: getattr(model_cfg, k) for k in same}, kv_heads=model_cfg.n_kv_heads, hidden=model_cfg.mlp_hidden,
        keep_first=nvfp4_cfg.keep_first_blocks, keep_last=nvfp4_cfg.keep_last_blocks,
        keep_head=Policy(keep=tuple(nvfp4_cfg.keep_bf16)).kept("head/kernel"),
        compute=nvfp4_cfg.compute if nvfp4_cfg.weights == "nvfp4" else "dequant",
        recipe=Recipe(stochastic_grads=nvfp4_cfg.grad_rounding == "stochastic", hadamard_wgrad=nvfp4_cfg.wgrad_hadamard,
                      quantize_activations=nvfp4_cfg.activations == "nvfp4"))


def cross_entropy(logits, targets, tensor: TensorParallel = TensorParallel()):
    """Mean next-token cross-entropy in nats (``tensor``: ``logits`` are this rank's vocabulary columns)."""
    return jnp.mean(vocab_token_losses(logits, targets, tensor))
