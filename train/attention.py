"""Causal grouped-query attention: cuDNN's fused kernel on a CUDA GPU, elsewhere a blockwise one of
O(sequence) memory (FlashAttention-2 with ``lax`` loops: online softmax forward, recomputing backward).

Blockwise numerics: scores and softmax in float32, probabilities rounded to the value dtype for
``P @ V``, the output rounded once; a sequence of one block is XLA's attention itself.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

BLOCK = 512
IMPLEMENTATIONS = ("auto", "blockwise", "xla", "cudnn")


@functools.lru_cache(maxsize=None)
def cudnn_available() -> bool:
    """Whether cuDNN's attention can be traced here: JAX checks for cuDNN when it traces it, so a tiny
    abstract call (nothing compiled or run) answers."""
    x = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)  # a shape cuDNN takes
    try:
        jax.eval_shape(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn"), x)
    except Exception:  # noqa: BLE001 - no CUDA plugin or no cuDNN
        return False
    return True


def check_cudnn(head_dim: int) -> None:
    """ConfigError unless cuDNN's attention can run heads of ``head_dim`` here (``model.attention=cudnn``)."""
    from train.config_errors import ConfigError

    if not cudnn_available():
        raise ConfigError("model.attention=cudnn: cuDNN's attention is not available here (it needs the CUDA build "
                          "of JAX on a GPU with cuDNN); use auto (cuDNN where available, else blockwise) or blockwise")
    if head_dim % 8 or head_dim > 128:
        raise ConfigError(f"model.attention=cudnn: cuDNN's attention takes head sizes that are multiples of 8 up "
                          f"to 128, this model's is {head_dim}; use auto or blockwise")


def attention(q, k, v, implementation: str = "auto", block: int = BLOCK):
    """Causal attention ``[B, S, H, D] x [B, S, K, D]^2 -> [B, S, H, D]``, query head ``h`` on key/value
    head ``h // (H / K)``. ``implementation``: ``auto`` (cuDNN in the CUDA branch where it takes the
    shapes and can be traced, else blockwise), ``blockwise``, ``xla`` (O(S^2) scores) or ``cudnn``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation).astype(v.dtype)
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, block=block)
    # cuDNN takes bf16/fp16 with a head size that is a multiple of 8 up to 128.
    fits = q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
    if implementation == "blockwise" or not (fits and cudnn_available()):
        return blockwise(q, k, v)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=blockwise)


def blockwise_attention(q, k, v, block: int = BLOCK):
    """Causal grouped-query attention in blocks of ``block`` queries and keys, O(S) memory."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads cannot share {kv} key/value heads")
    if s <= block:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    n = -(-s // block)

    def blocks(x, heads):  # [B, S, heads, D] -> [n, B, heads, block, D]
        x = jnp.pad(x, ((0, 0), (0, n * block - s), (0, 0), (0, 0)))
        return jnp.moveaxis(x.reshape(b, n, block, heads, d), (1, 3), (0, 2))

    qb = blocks(q, h).reshape(n, b, kv, h // kv, block, d)
    out = _flash(qb, blocks(k, kv), blocks(v, kv), 1.0 / math.sqrt(d))
    out = jnp.moveaxis(out.reshape(n, b, h, block, d), (0, 2), (1, 3)).reshape(b, n * block, h, d)
    return out[:, :s].astype(v.dtype)


def _scores(qi, kj, i, j, scale):
    """Scaled scores of query block ``i`` on key block ``j``, ``[B, K, G, bq, bk]`` float32, ``-inf``
    above the diagonal."""
    s = jnp.einsum("bkgqd,bkcd->bkgqc", qi, kj, preferred_element_type=jnp.float32) * scale
    bq, bk = qi.shape[-2], kj.shape[-2]
    rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    return jnp.where(rows >= cols, s, -jnp.inf)


def _forward(qb, kb, vb, scale):
    """``(out [n, B, K, G, bq, D] float32, lse [n, B, K, G, bq])``; blocks above the diagonal skipped."""
    n = qb.shape[0]

    def query_block(i):
        qi = qb[i]
        shape = qi.shape[:-1]

        def key_block(j, carry):
            def update(carry):
                acc, top, total = carry
                s = _scores(qi, kb[j], i, j, scale)
                new_top = jnp.maximum(top, jnp.max(s, axis=-1))
                p = jnp.exp(s - new_top[..., None])
                keep = jnp.exp(top - new_top)
                pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32)
                return acc * keep[..., None] + pv, new_top, total * keep + jnp.sum(p, axis=-1)

            return jax.lax.cond(j <= i, update, lambda c: c, carry)

        init = (jnp.zeros((*shape, qb.shape[-1]), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32),
                jnp.zeros(shape, jnp.float32))
        acc, top, total = jax.lax.fori_loop(0, n, key_block, init)
        return acc / total[..., None], top + jnp.log(total)

    return jax.lax.map(query_block, jnp.arange(n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(qb, kb, vb, scale):
    return _forward(qb, kb, vb, scale)[0].astype(vb.dtype)


def _flash_fwd(qb, kb, vb, scale):
    out, lse = _forward(qb, kb, vb, scale)
    out = out.astype(vb.dtype)
    return out, (qb, kb, vb, out, lse)


def _flash_bwd(scale, res, d_out):
    qb, kb, vb, out, lse = res
    n = qb.shape[0]
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # [n, B, K, G, bq]

    def key_block(dq, j):
        kj, vj = kb[j], vb[j]

        def query_block(i, carry):
            def update(carry):
                dq, dk, dv = carry
                qi = qb[i]
                p = jnp.exp(_scores(qi, kj, i, j, scale) - lse[i][..., None])
                dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", p, d_out[i])
                dp = jnp.einsum("bkgqd,bkcd->bkgqc", d_out[i], vj, preferred_element_type=jnp.float32)
                ds = p * (dp - delta[i][..., None]) * scale
                dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd", ds, qi, preferred_element_type=jnp.float32)
                dq = dq.at[i].add(jnp.einsum("bkgqc,bkcd->bkgqd", ds, kj, preferred_element_type=jnp.float32))
                return dq, dk, dv

            return jax.lax.cond(i >= j, update, lambda c: c, carry)

        zero = jnp.zeros(kj.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, n, query_block, (dq, zero, zero))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32), jnp.arange(n))
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)
