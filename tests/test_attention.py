"""train.attention: the blockwise (O(sequence) memory) causal attention against XLA's
``jax.nn.dot_product_attention``, and its memory read from ahead-of-time compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.attention import blockwise_attention

XLA = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _qkv(s, heads, kv, hd=32, dtype=jnp.bfloat16, batch=2):
    rng = np.random.default_rng(s + heads)
    make = lambda h: jnp.asarray(rng.standard_normal((batch, s, h, hd)) * 1.5, dtype)
    return make(heads), make(kv), make(kv)


def _grads(fn, q, k, v, w):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


# 200 tokens in blocks of 64: three full blocks and a padded one; GQA 4 query heads on 2.
@pytest.mark.parametrize("s,heads,kv", [(200, 4, 2), (256, 2, 2)])
def test_blockwise_equals_xla_attention(s, heads, kv):
    block = lambda q, k, v: blockwise_attention(q, k, v, block=64)
    w = jnp.asarray(np.random.default_rng(7).standard_normal((2, s, heads, 32)), jnp.float32)
    # float32: the same function up to float32 rounding, forward and backward.
    q, k, v = _qkv(s, heads, kv, dtype=jnp.float32)
    (l_ref, g_ref), (l_got, g_got) = _grads(XLA, q, k, v, w), _grads(block, q, k, v, w)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5)
    for a, b in zip(g_got, g_ref):
        np.testing.assert_allclose(a, b, atol=2e-5 * float(jnp.max(jnp.abs(b))))
    # bfloat16: within the output's rounding (2^-8 relative), the gradients within a few of it.
    q, k, v = _qkv(s, heads, kv)
    ref, got = jax.jit(XLA)(q, k, v), jax.jit(block)(q, k, v)
    assert got.dtype == ref.dtype == jnp.bfloat16
    ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    assert np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1.0)) <= 2 ** -7
    (_, g_ref), (_, g_got) = _grads(XLA, q, k, v, w), _grads(block, q, k, v, w)
    for a, b in zip(g_got, g_ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 2 ** -6 * np.max(np.abs(b))


def test_one_block_is_xla_attention_itself():
    q, k, v = _qkv(64, 2, 1)
    got = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, block=64))(q, k, v)
    assert np.asarray(got).tobytes() == np.asarray(jax.jit(XLA)(q, k, v)).tobytes()


def test_blockwise_memory_grows_linearly_with_the_sequence():
    """Forward + backward temporaries from AOT compiles: XLA's attention keeps heads x S x S
    scores (4x the memory for 2x the tokens); the blockwise one O(S) (about 2x)."""

    def temp(fn, s):
        q, k, v = (jax.ShapeDtypeStruct((1, s, h, 64), jnp.bfloat16) for h in (8, 8, 8))
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    block = lambda q, k, v: blockwise_attention(q, k, v, block=256)
    xla = {s: temp(XLA, s) for s in (1024, 2048)}
    blk = {s: temp(block, s) for s in (1024, 2048)}
    assert xla[2048] >= 3.5 * xla[1024]  # quadratic
    assert blk[2048] <= 2.5 * blk[1024]  # linear
    assert blk[2048] * 4 < xla[2048]
    # Less than a third of one layer's 8 x 2048 x 2048 float32 scores (128 MiB).
    assert blk[2048] < 8 * 2048 * 2048 * 4 / 3


def test_cudnn_where_it_cannot_run_is_a_config_error_before_anything_compiles():
    from train import programs
    from train.attention import cudnn_available
    from train.config import ConfigError

    from conftest import mesh_of, tiny

    if cudnn_available():
        pytest.skip("cuDNN's attention runs here")
    cfg = tiny("model.attention=cudnn")
    with pytest.raises(ConfigError, match=r"^model.attention=cudnn: cuDNN's attention is not available here"):
        programs.build(cfg, mesh_of(cfg, 8), init=False)
