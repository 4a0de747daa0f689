"""The library on meshes with Explicit axes (``jax.make_mesh``'s default) gives the same bits
as on Auto ones: gathers (packed, dequantized, plain bf16 leaves), the master-weight optimizer
with clipping and stochastic rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_nvfp4 as nv

AxisType = jax.sharding.AxisType


def _train(axis_type):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:4])
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    fp32 = {"up": jax.random.normal(k1, (64, 64)) * 0.1, "down": jax.random.normal(k2, (64, 64)) * 0.1,
            "embed": jax.random.normal(k3, (256, 64)) * 0.1}  # kept in bf16 below: a plain sharded leaf
    x = jax.random.normal(k1, (32, 64))

    def loss_fn(w, x):
        # The model itself computes in float32: the bits compared are the library's. With bf16
        # activations XLA may keep excess precision (skip the rounding of a bf16 matmul's
        # output) in one program and not in another: measured, the Auto-mesh step and a plain
        # jit of this loss skip it, the Explicit-mesh step and op-by-op execution keep it.
        w = jax.tree.map(lambda a: a.astype(jnp.float32), w)
        y = jax.nn.relu((x + w["embed"][:32]) @ w["up"]) @ w["down"]
        return jnp.mean((y - x) ** 2)

    with jax.set_mesh(mesh):
        policy = nv.Policy(keep=("embed",), keep_dtype=jnp.bfloat16)
        params = nv.shard_params(nv.quantize_params(fp32, policy))
        assert isinstance(params["embed"], nv.Tiled) and isinstance(params["up"], nv.TiledNVFP4)
        tx = nv.master_weights(optax.chain(nv.optim.clip_by_global_norm(1.0, mesh), optax.adamw(1e-3)), mesh=mesh, policy=policy,
                               stochastic_rounding=True, key=jax.random.key(1))
        state = tx.init(fp32)
        params = jax.device_put(params, nv.shardings(params, mesh))
        state = jax.device_put(state, nv.shardings(state, mesh))

        @jax.jit
        def step(params, state):
            packed = nv.dequantize_params(nv.gather(params), jnp.bfloat16)
            weights = nv.sharding.gather_dequantized(params, jnp.bfloat16)
            loss, grads = jax.value_and_grad(loss_fn)(weights, x)
            updates, state = tx.update(grads, state, params)
            same = jnp.all(jnp.stack([jnp.all(a == b) for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(weights))]))
            return optax.apply_updates(params, updates), state, loss, same

        params, state, loss, same = step(params, state)
    assert bool(same)  # gather + dequantize == dequantize + gather
    return float(loss), [np.asarray(a) for a in jax.tree.leaves(jax.device_get(params))]


def test_explicit_and_auto_meshes_train_the_same_bits():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    loss_e, params_e = _train(AxisType.Explicit)
    loss_a, params_a = _train(AxisType.Auto)
    assert loss_e == loss_a
    assert [p.tobytes() for p in params_e] == [p.tobytes() for p in params_a]


def test_the_logical_view_of_a_state_sharded_over_explicit_axes():
    """``nv.sharding.logical`` of params and masters whose tiles are sharded over an Explicit
    data axis, called eagerly and under jit, gives what it gives for their host copy (its
    relayouts move entries between shards: the result is replicated); ``sharded_state`` of
    float params sharded over that axis builds the state it builds from unsharded ones (its tx
    told the mesh, so the masters are constrained inside its program too), and
    ``quantize`` of a stack sharded along its batch axis the bits of the host copy's."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    fp32 = {"w": jax.random.normal(jax.random.key(0), (96, 256)) * 0.1, "b": jnp.ones((256,))}
    params, state = nv.sharded_state(fp32, nv.master_weights(optax.adam(1e-3)), mesh, nv.Rules(), nv.Policy())
    tree = {"params": params, "master": nv.find_state(state).master}
    assert "data" in tuple(jax.typeof(params["w"].data).sharding.spec)
    host = nv.sharding.logical(jax.device_get(tree))
    for view in (nv.sharding.logical(tree), jax.jit(nv.sharding.logical)(tree)):
        leaves = jax.tree.leaves(view)
        assert [np.asarray(a).tobytes() for a in leaves] == [np.asarray(a).tobytes() for a in jax.tree.leaves(host)]
        assert all(a.sharding.is_fully_replicated for a in leaves)
    np.testing.assert_array_equal(host["master"]["w"], fp32["w"])  # the master is the float param
    # Float params sharded over the axis (as an NNX model's partitioned init makes them).
    split = dict(fp32, w=jax.device_put(fp32["w"], jax.sharding.NamedSharding(mesh, jax.P("data"))))
    again = nv.sharded_state(split, nv.master_weights(optax.adam(1e-3), mesh=mesh), mesh, nv.Rules(), nv.Policy())
    assert [np.asarray(a).tobytes() for a in jax.tree.leaves(again)] == [
        np.asarray(a).tobytes() for a in jax.tree.leaves((params, state))]
    # A stack of matrices sharded along its batch axis, eagerly and inside shard_map's manual data axis.
    stack = jax.device_put(jax.random.normal(jax.random.key(1), (4, 32, 48)),
                           jax.sharding.NamedSharding(mesh, jax.P("data")))
    want = nv.quantize(np.asarray(stack))
    assert np.asarray(nv.quantize(stack).data).tobytes() == np.asarray(want.data).tobytes()
    per_shard = jax.jit(jax.shard_map(lambda x: nv.quantize(x[0]).data[None], mesh=mesh, in_specs=jax.P("data"),
                                      out_specs=jax.P("data")))
    assert np.asarray(per_shard(stack)).tobytes() == np.asarray(want.data).tobytes()


def test_the_optimizer_finds_the_mesh_in_its_state_without_a_context_mesh():
    """Without ``jax.set_mesh`` and a ``master_weights`` not told the mesh, the step on an
    Explicit mesh re-quantizes each device's shard over the mesh its masters' types name: the
    bits of the optimizer told the mesh."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    import flax.linen as nn

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    fp32 = {"w": jax.random.normal(jax.random.key(0), (64, 96)) * 0.1}
    x = jax.random.normal(jax.random.key(1), (8, 64))
    loss = lambda p, rows, key: jnp.mean((rows @ nn.meta.unbox(p)["w"].astype(jnp.float32)) ** 2)
    out = []
    for told in (mesh, None):
        tx = nv.master_weights(optax.adam(1e-2), mesh=told)
        params, state = nv.sharded_state(fp32, tx, mesh, nv.Rules(), nv.Policy())
        step = jax.jit(nv.make_step(loss, tx, mesh))
        for _ in range(2):
            params, state, _ = step(params, state, x)
        out.append([np.asarray(a).tobytes() for a in jax.tree.leaves((params, state))])
    assert out[0] == out[1]


@pytest.mark.parametrize("block", [(16, 16), (1, 16)])
@pytest.mark.parametrize("rows", [128, 96])
def test_quantize_and_dequantize_keep_an_explicit_split(rows, block):
    """A weight split over an Explicit axis stays split through quantize and dequantize, eagerly
    and under jit, with the bits of the unsharded quantization. With whole tiles on each device
    (128 rows over 8) nothing but the amax (one float per matrix) crosses devices; an output
    dimension that does not divide evenly (96 rows: 6 tile rows of scales over 8) is whole."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest asks for 8 simulated CPU devices)")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    w = np.random.default_rng(0).standard_normal((2, rows, 40)).astype(np.float32)
    x = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.P(None, "data")))
    ref = nv.quantize(w, block=block)
    scale_split = "data" if (rows // block[0]) % 8 == 0 else None
    with jax.set_mesh(mesh):
        for q in (nv.quantize(x, block=block), jax.jit(lambda a: nv.quantize(a, block=block))(x)):
            assert q.data.sharding.spec == jax.P(None, "data", None)
            assert q.scale_bits.sharding.spec == jax.P(None, scale_split, None)
            for got, want in zip(jax.tree.leaves(q), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            d = nv.dequantize(q, jnp.float32)
            assert d.sharding.spec == jax.P(None, "data", None)
            np.testing.assert_array_equal(np.asarray(d), np.asarray(nv.dequantize(ref, jnp.float32)))
        hlo = jax.jit(lambda a: nv.dequantize(nv.quantize(a, block=block))).lower(x).compile().as_text()
    if rows == 128:
        assert "all-gather" not in hlo and "all-to-all" not in hlo and "all-reduce" in hlo
