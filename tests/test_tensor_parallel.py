"""jax_nvfp4.tensor_parallel and the ordered collectives under it, on a 4-device tensor axis
against the same computation on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4.collectives import UNROLL, fold_sum
from jax_nvfp4.tensor_parallel import TensorParallel, vocab_embed, vocab_token_losses

T = 4
TP = TensorParallel("tensor", T)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((T,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))


def _run(mesh, fn, in_specs, out_specs, *args):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))(*args)


@pytest.mark.parametrize("n", [3, UNROLL + 12])
def test_fold_sum_is_the_sequential_float32_fold(n):
    x = np.random.default_rng(n).standard_normal((n, 257)).astype(np.float32) * np.logspace(-6, 6, n, dtype=np.float32)[:, None]
    want = x[0].copy()
    for i in range(1, n):
        want = want + x[i]
    assert np.asarray(jax.jit(fold_sum)(x)).tobytes() == want.tobytes()
    # Past UNROLL parts the fold is a loop: the program does not grow with the device count.
    text = jax.jit(fold_sum).lower(x).as_text()
    assert ("while" in text) == (n > UNROLL)


def test_vocab_parallel_loss_and_gradient_equal_the_whole_vocabulary(mesh):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((2, 8, 64)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    whole = lambda l: jnp.mean(vocab_token_losses(l, targets, TensorParallel()))
    split = lambda l, t: jnp.mean(vocab_token_losses(l, t, TP))
    want, want_grad = jax.value_and_grad(whole)(logits)
    got = _run(mesh, split, (P(None, None, "tensor"), P()), P(), logits, targets)
    got_grad = _run(mesh, jax.grad(split), (P(None, None, "tensor"), P()), P(None, None, "tensor"), logits, targets)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-7)


def test_vocab_embedding_is_the_lookup_split_along_the_sequence(mesh):
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((64, 16)), jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    got = _run(mesh, lambda t, i: vocab_embed(t, i, TP), (P("tensor"), P()), P(None, "tensor"), table, tokens)
    assert np.asarray(got).tobytes() == np.asarray(table[tokens]).tobytes()


def test_sequence_gather_and_scatter_are_each_others_transpose(mesh):
    """gather_sequence's backward is the ordered reduce-scatter and scatter_sequence's the
    all-gather: the gradients equal those of JAX's own all_gather / psum_scatter."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.float32)  # [B, S, D], split along S
    w = jnp.asarray(rng.standard_normal((T, 2, 8, 4)), jnp.float32)  # each rank's own weights
    spec = (P(None, "tensor"), P("tensor"))

    # Each rank's loss term (the sum over ranks is the loss).
    def ours(x, w):
        return jnp.sum(TP.gather_sequence(x) * w[0]) + jnp.sum(TP.scatter_sequence(TP.gather_sequence(x) * w[0]) * x)

    def jaxs(x, w):
        full = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
        part = jax.lax.psum_scatter(full * w[0], "tensor", scatter_dimension=1, tiled=True)
        return jnp.sum(full * w[0]) + jnp.sum(part * x)

    terms = lambda f: (lambda x, w: f(x, w)[None])

    for f in (ours, jaxs):
        assert _run(mesh, jax.grad(f), spec, P(None, "tensor"), x, w).shape == x.shape
    np.testing.assert_allclose(_run(mesh, terms(ours), spec, P("tensor"), x, w),
                               _run(mesh, terms(jaxs), spec, P("tensor"), x, w), rtol=1e-6)
    np.testing.assert_allclose(_run(mesh, jax.grad(ours), spec, P(None, "tensor"), x, w),
                               _run(mesh, jax.grad(jaxs), spec, P(None, "tensor"), x, w), rtol=1e-5, atol=1e-6)
    # The ordered sum moves bits: no float all-reduce or reduce-scatter in the program.
    text = jax.jit(jax.shard_map(jax.grad(ours), mesh=mesh, in_specs=spec, out_specs=P(None, "tensor"),
                                 check_vma=False)).lower(x, w).compile().as_text()
    rows = nv.comm.parse(text).collectives
    assert rows and not any(r.op in ("all-reduce", "reduce-scatter") for r in rows)
    assert {r.dtype for r in rows} == {"u32"}
