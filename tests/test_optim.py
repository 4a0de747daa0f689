"""The master-weight wrapper across data-axis sizes: bit-identity, HLO traffic, memory."""

import math
import dataclasses
import functools
import re

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4.array import as_array

SHAPES = {"a": (48, 80), "b": (50, 72), "c": (16, 16), "stacked": (4, 256, 96)}


def make_mesh(n):
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def f32(x):
    """A NumPy array as a float32 JAX array (transferred, not staged: ``as_array``)."""
    return as_array(np.asarray(x, np.float32))


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    tree = {k: f32(rng.standard_normal(s) * 0.05) for k, s in SHAPES.items()}
    tree["bias"] = f32(rng.standard_normal(80) * 0.01)
    return tree


def grads_at(step, like):
    rng = np.random.default_rng(1000 + step)
    return {k: f32(rng.standard_normal(like[k].shape) * 0.1) for k in sorted(like)}


def loss_of(weights):
    return sum(jnp.sum(w.astype(jnp.float32) ** 2) for w in jax.tree.leaves(weights))


def tree_bytes(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


# Relayouts of bytes (no arithmetic), each compiled as one program: op by op, they dispatch
# (and compile) a few hundred small programs per mesh.
shard_params = jax.jit(nv.shard_params)
logical = jax.jit(nv.sharding.logical)
# Likewise the update of a tree of params (an operation or two per leaf).
apply_updates = jax.jit(optax.apply_updates)


def run_sharded(n, steps, inner, **kw):
    mesh = make_mesh(n)
    fp32 = init_params()
    with jax.set_mesh(mesh):
        params = shard_params(nv.quantize_params(fp32))
        tx = nv.master_weights(inner, **kw)
        state = jax.jit(tx.init)(fp32)
        params = jax.device_put(params, nv.shardings(params, mesh))
        state = jax.device_put(state, nv.shardings(state, mesh))

        @jax.jit
        def step(params, state, grads):
            w = nv.dequantize_params(nv.gather(params), jnp.float32)
            loss = loss_of(w)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        losses = []
        for i in range(steps):
            params, state, loss = step(params, state, grads_at(i, fp32))
            losses.append(float(loss))
    return logical(params), state, losses


def run_reference(steps, inner):
    """Replicated float32 master, whole-tensor quantization every step."""
    master = init_params()
    inner_state = inner.init(master)
    params = nv.quantize_params(master)

    @jax.jit
    def step(master, inner_state, params, grads):
        loss = loss_of(nv.dequantize_params(params, jnp.float32))
        updates, inner_state = inner.update(grads, inner_state, master)
        master = optax.apply_updates(master, updates)
        # float32 leaves equal their master bit for bit.
        new = nv.quantize_params(master)
        return master, inner_state, new, loss

    losses = []
    for i in range(steps):
        master, inner_state, params, loss = step(master, inner_state, params, grads_at(i, master))
        losses.append(float(loss))
    return params, master, losses


@pytest.fixture(scope="module")
def reference():
    return run_reference(4, optax.adamw(3e-2, weight_decay=0.1))


@pytest.fixture(scope="module")
def one_device():
    return run_sharded(1, 4, optax.adamw(3e-2, weight_decay=0.1))


@jax.jit
def masters_and_requantized(master):
    """The logical float32 masters and the whole-tensor quantization of the NVFP4 ones."""
    logical_ = nv.sharding.logical(master)
    return logical_, {k: nv.quantize(logical_[k]) for k in SHAPES}


@pytest.mark.xdist_group("optim_reference")  # one pytest-xdist worker computes the module fixtures
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(6, marks=pytest.mark.slow),
                               8])
def test_bit_identical_to_unsharded_reference(n, reference, one_device):
    ref_params, ref_master, ref_losses = reference
    params, state, losses = run_sharded(n, 4, optax.adamw(3e-2, weight_decay=0.1)) if n > 1 else one_device
    assert losses == ref_losses
    # Masters (and Adam's second moment) agree to an ulp, not bit for bit: XLA:CPU allows
    # multiply-add contraction (FMA) and decides it per fused loop, and the compiled programs
    # for different data-axis sizes fuse AdamW's `b2 * nu + (1 - b2) * g * g` differently.
    master, requantized = masters_and_requantized(state.master)
    for k in (*SHAPES, "bias"):
        got = np.asarray(master[k])
        if n > 1:  # against the wrapper on one device (n == 1 is that run)
            np.testing.assert_allclose(got, np.asarray(logical(one_device[1].master[k])), rtol=2.4e-7, atol=3e-8)
        np.testing.assert_allclose(got, np.asarray(ref_master[k]), rtol=2.4e-7, atol=3e-8)
    # The NVFP4 params are their own master re-quantized, bit for bit, whatever the sharding:
    # codes, scales and amax from the sharded update equal the whole-tensor quantization of
    # the master (so they equal the reference's params wherever the masters agree).
    for k in SHAPES:
        for a, b in zip(tree_bytes(params[k]), tree_bytes(requantized[k])):
            np.testing.assert_array_equal(a, b)
    # The float32 bias: param + u and master + u, where XLA may compute u twice, once per
    # addition, and round the two differently (one ulp; seen in 1 of 80 values after 4 AdamW
    # steps with XLA:CPU's previous fusion emitters, none with its default ones).
    np.testing.assert_allclose(np.asarray(params["bias"]), np.asarray(master["bias"]), rtol=1.2e-7, atol=0)
    # The reference's params are its master re-quantized too.
    for k in SHAPES:
        q = nv.quantize(ref_master[k])
        np.testing.assert_array_equal(np.asarray(ref_params[k].data), np.asarray(q.data))


def test_stochastic_rounding_sharded_equals_unsharded():
    p8, s8, _ = run_sharded(8, 2, optax.sgd(0.1), stochastic_rounding=True, key=jax.random.key(7))
    p1, s1, _ = run_sharded(1, 2, optax.sgd(0.1), stochastic_rounding=True, key=jax.random.key(7))
    for a, b in zip(tree_bytes(p8), tree_bytes(p1)):
        np.testing.assert_array_equal(a, b)
    # And it differs from nearest rounding of the same master.
    pn, _, _ = run_sharded(1, 2, optax.sgd(0.1))
    assert not np.array_equal(np.asarray(p1["stacked"].data), np.asarray(pn["stacked"].data))


@pytest.mark.slow
def test_cast_master_bf16_option():
    params, state, _ = run_sharded(2, 1, optax.sgd(0.1), cast_master_bf16=True)
    m = nv.sharding.logical(state.master["a"])
    q = nv.quantize(m.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(params["a"].data), np.asarray(q.data))
    # sharded_state stores what the optimizer re-quantizes, the masters rounded to bf16 first: a step with zero
    # gradients changes no bit (it stored quantize(float32) and the first step rewrote 98 of 4096 codes).
    fp32 = {"w": f32(np.random.default_rng(3).standard_normal((64, 64)))}
    tx = nv.master_weights(optax.sgd(0.1), cast_master_bf16=True)
    with jax.set_mesh(make_mesh(2)):
        params, state = nv.sharded_state(fp32, tx)
        updates, _ = jax.jit(tx.update)({"w": jnp.zeros((64, 64))}, state, params)
        stepped = optax.apply_updates(params, updates)
    for a, b in zip(tree_bytes(logical(params)), tree_bytes(logical(stepped))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(logical(params)["w"].data),
                                  np.asarray(nv.quantize(fp32["w"].astype(jnp.bfloat16)).data))
    with pytest.raises(ValueError, match="differ in cast_master_bf16"):
        mixed = optax.chain(nv.master_weights(optax.sgd(0.1)), tx)
        nv.sharded_state(fp32, mixed, make_mesh(2))


# ------------------------------------------------------------------------------------ HLO
def _model_step(n, aligned=True, donate=False):
    mesh = make_mesh(n)
    rng = np.random.default_rng(0)
    d = 32 * n  # rows of every weight a multiple of 16 x n: each device owns whole tiles
    shapes = {"w1": (d, d), "w2": (d, 64), "stack": (2, d, d)} if aligned else {"w1": (50, 72), "w2": (72, 40)}
    fp32 = {k: jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for k, s in shapes.items()}
    fp32["b"] = jnp.zeros((shapes["w1"][1],), jnp.float32)
    d_in = shapes["w1"][0]

    def loss_fn(w, x):
        h = jax.nn.relu(x.astype(jnp.bfloat16) @ w["w1"] + w["b"])
        if "stack" in w:
            for i in range(w["stack"].shape[0]):
                h = jax.nn.relu(h @ w["stack"][i])
        return jnp.mean((h @ w["w2"]).astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        params = shard_params(nv.quantize_params(fp32))
        tx = nv.master_weights(optax.adamw(1e-3))
        state = jax.jit(tx.init)(fp32)
        params = jax.device_put(params, nv.shardings(params, mesh))
        state = jax.device_put(state, nv.shardings(state, mesh))
        x = jax.device_put(jnp.ones((8 * n, d_in), jnp.float32), NamedSharding(mesh, P("data")))

        @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
        def step(params, state, batch):
            weights = nv.dequantize_params(nv.gather(params), jnp.bfloat16)
            loss, grads = jax.value_and_grad(loss_fn)(weights, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        hlo = step.lower(params, state, x).compile().as_text()
    return hlo, fp32, params, state


@pytest.mark.parametrize("n", [8, 6])
def test_hlo_gathers_only_packed_bytes(n):
    hlo, fp32, params, _ = _model_step(n)
    counts = nv.comm.collective_bytes(hlo)
    gathers = {dt: b for (op, dt), b in counts.items() if op == "all-gather"}
    assert set(gathers) == {"u8"}, counts
    weights = [v for k, v in fp32.items() if v.ndim >= 2]
    bf16_gather = sum(w.size * 2 for w in weights)
    ratio = gathers["u8"] / bf16_gather
    # Physical limit for 16x16 tiles: (0.5 + 1/256) / 2 = 0.2520 of bf16.
    assert ratio <= 0.2525, ratio
    assert ratio >= 0.25
    for line in hlo.splitlines():
        if "all-gather(" in line and "=" in line:
            assert " u8[" in line, line


def test_hlo_unaligned_shapes_still_gather_no_floats():
    hlo, *_ = _model_step(3, aligned=False)
    counts = nv.comm.collective_bytes(hlo)
    # Every all-gather moves bytes, and the re-quantized shard is the stored shard: nothing
    # moves between layouts after the update.
    assert {dt for (op, dt) in counts if op == "all-gather"} == {"u8"}, counts
    assert not any(op == "collective-permute" for op, _ in counts), counts


def test_update_copies_no_float_state_buffer():
    # The step runs in place on the donated state. A skip's select of the new state against the
    # old must come after the master's update, which reads the old moments: selected before it,
    # XLA copies every master and Adam moment first (two float32 copies of every master shard at
    # once, 1.6 GB per device of the 70B step at 40 layers).
    hlo, *_ = _model_step(2, donate=True)
    entry = hlo[hlo.index("\nENTRY"):]
    state = dict(re.findall(r"%(\S+) = (f32\[[^\]]*\])\S* parameter\(.*op_name=\"state\.(?:inner_state|master)", entry))
    assert len(state) > 10, "the step's arguments hold no float32 masters and moments"
    copied = [(p, state[p]) for p in re.findall(r"= f32\[[^\]]*\]\S* copy\(%([^)\s]+)\)", entry) if p in state]
    # (A float32 plain param's master, here a bias of 64, is copied: the param's update reads
    # it. Small: biases and norms.)
    assert all(shape == "f32[64]" for _, shape in copied), copied


def test_memory_is_sharded():
    n = 8
    _, fp32, params, state = _model_step(n)

    def per_device(tree):
        total = 0
        for leaf in jax.tree.leaves(tree):
            shard = leaf.addressable_shards[0].data
            total += shard.size * shard.dtype.itemsize
        return total

    got = per_device(params) + per_device(state)
    n_el = sum(v.size for v in fp32.values())
    packed = sum(p.nbytes for p in jax.tree.leaves(params, is_leaf=nv.layout.is_tiled) if isinstance(p, nv.TiledNVFP4))
    expect = (packed + 4 * n_el * 3) / n  # packed+scales, f32 master, adam mu and nu
    assert abs(got - expect) / expect < 0.05, (got, expect)


# ---------------------------------------------------------------------- optax composition
def _single_step_setup(inner, n=2, **kw):
    """A mesh of ``n``, the float32 params, their stored form, the wrapper and its state."""
    mesh = make_mesh(n)
    fp32 = init_params()
    params = jax.jit(functools.partial(nv.shard_params, mesh=mesh))(nv.quantize_params(fp32))
    tx = nv.master_weights(inner, mesh=mesh, **kw)
    state = jax.jit(tx.init)(fp32)
    return mesh, fp32, params, tx, state


def test_apply_updates_is_exact_for_every_leaf():
    mesh, fp32, params, tx, state = _single_step_setup(optax.adam(0.5))
    with jax.set_mesh(mesh):
        updates, state = jax.jit(tx.update)(grads_at(0, fp32), state, params)
    new = apply_updates(params, updates)
    for k in SHAPES:
        q = nv.quantize(logical(state.master[k]))
        for a, b in zip(tree_bytes(logical(new[k])), tree_bytes(q)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(new["bias"]), np.asarray(logical(state.master["bias"])))
    again = nv.optim.apply_updates(params, updates)
    for a, b in zip(tree_bytes(new), tree_bytes(again)):
        np.testing.assert_array_equal(a, b)
    # flax TrainState.apply_gradients works unchanged.
    from flax.training import train_state

    ts = train_state.TrainState(step=0, apply_fn=None, params=params, tx=tx, opt_state=jax.jit(tx.init)(fp32))
    with jax.set_mesh(mesh):
        ts = jax.jit(lambda t, g: t.apply_gradients(grads=g))(ts, grads_at(0, fp32))
    for a, b in zip(tree_bytes(ts.params), tree_bytes(new)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_chain_multisteps_inject_hyperparams():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    mesh, fp32, params, tx, state = _single_step_setup(inner)
    updates, state = jax.jit(tx.update)(grads_at(0, fp32), state, params)
    assert int(state.skipped) == 0

    sched = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 0.0, 10))
    mesh, fp32, params, tx, state = _single_step_setup(sched)
    upd = jax.jit(tx.update)
    for i in range(3):
        updates, state = upd(grads_at(i, fp32), state, params)
        params = apply_updates(params, updates)
    # The schedule is read back from the state: the value used by the third step (count 2).
    assert np.isclose(float(state.inner_state.hyperparams["learning_rate"]), 1e-2 * (1 - 2 / 10))

    # Gradient accumulation outside the wrapper: k-1 mini-steps leave params untouched.
    acc = optax.MultiSteps(nv.master_weights(optax.sgd(0.1)), every_k_schedule=2)
    fp32 = init_params()
    params = nv.quantize_params(fp32)
    st = acc.init(fp32)
    g0, g1 = grads_at(0, fp32), grads_at(1, fp32)
    upd = jax.jit(acc.update)
    u, st = upd(g0, st, params)
    p1 = apply_updates(params, u)
    for a, b in zip(tree_bytes(p1), tree_bytes(params)):
        np.testing.assert_array_equal(a, b)
    u, st = upd(g1, st, p1)
    p2 = apply_updates(p1, u)
    expect = nv.quantize(fp32["a"] - 0.1 * (g0["a"] + g1["a"]) / 2)
    np.testing.assert_array_equal(np.asarray(p2["a"].data), np.asarray(expect.data))
    # ... and inside the wrapper.
    tx = nv.master_weights(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    st = tx.init(fp32)
    upd = jax.jit(tx.update)
    u, st = upd(g0, st, params)
    p1 = apply_updates(params, u)
    np.testing.assert_array_equal(np.asarray(p1["a"].data), np.asarray(params["a"].data))
    u, st = upd(g1, st, p1)
    p2b = apply_updates(p1, u)
    np.testing.assert_array_equal(np.asarray(p2b["a"].data), np.asarray(expect.data))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_step_is_skipped_bit_identically(bad):
    mesh, fp32, params, tx, state = _single_step_setup(optax.adamw(1e-2), n=4)
    with jax.set_mesh(mesh):
        state = jax.device_put(state, nv.shardings(state, mesh))
        upd = jax.jit(tx.update)
        u, state = upd(grads_at(0, fp32), state, params)
        params = apply_updates(params, u)
        g = grads_at(1, fp32)
        g["b"] = g["b"].at[3, 5].set(bad)
        u, state2 = upd(g, state, params)
    params2 = apply_updates(params, u)
    for a, b in zip(tree_bytes(params2), tree_bytes(params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(tree_bytes((state2.master, state2.inner_state)), tree_bytes((state.master, state.inner_state))):
        np.testing.assert_array_equal(a, b)
    assert int(state2.skipped) == 1 and int(state.skipped) == 0


def test_an_update_that_overflows_a_master_is_skipped():
    # Finite gradients whose update takes a float32 master past its range: the step changes
    # nothing and counts itself skipped (it used to write an Inf amax: a NaN weight).
    w = {"w": np.full((32, 32), 3e38, np.float32)}
    tx = nv.master_weights(optax.sgd(-1.0))
    params = nv.quantize_params(w)
    state = tx.init(params)
    u, after = jax.jit(tx.update)({"w": np.full((32, 32), 1e38, np.float32)}, state, params)
    assert int(after.skipped) == 1 and bool(apply_updates(params, u)["w"].isfinite())
    for a, b in zip(tree_bytes((after.master, after.inner_state)), tree_bytes((state.master, state.inner_state))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FloatingPointError, match="non-finite gradients or updated masters"):
        nv.optim.raise_if_skipped(after)


def test_padding_stays_zero_whatever_the_inner_transform_adds():
    # A 20x37 kernel's tiles are mostly padding; noisy SGD adds noise there too. The masters'
    # padding stays zero, so the re-quantized param is quantize(master) bit for bit (the noise
    # used to enter its amax and the edge tiles' scales).
    w = {"w": (np.random.default_rng(1).standard_normal((20, 37)) * 0.02).astype(np.float32)}
    tx = nv.master_weights(optax.noisy_sgd(1e-2, eta=100.0, key=0))
    params = nv.quantize_params(w)
    u, state = jax.jit(tx.update)({"w": np.ones((20, 37), np.float32)}, tx.init(params), params)
    m = state.master["w"]
    assert float(jnp.max(jnp.abs(m.value))) == float(jnp.max(jnp.abs(m.logical()))) > 0.2
    got, want = apply_updates(params, u)["w"], nv.quantize(m.logical())
    for a, b in zip(tree_bytes(got), tree_bytes(want)):
        np.testing.assert_array_equal(a, b)
    assert int(jnp.count_nonzero(m.value)) == 20 * 37


def test_non_finite_error_mode():
    mesh, fp32, params, tx, state = _single_step_setup(optax.sgd(0.1))
    upd = jax.jit(tx.update)
    u, state = upd(grads_at(0, fp32), state, params)
    nv.optim.raise_if_skipped(state)  # finite: no error
    g = grads_at(1, fp32)
    g["a"] = g["a"].at[0, 0].set(np.nan)
    u2, state2 = upd(g, state, params)
    with pytest.raises(FloatingPointError, match="non-finite gradients"):
        nv.optim.raise_if_skipped(state2)
    # Nothing was applied, so the caller can stop with a clean state.
    for a, b in zip(tree_bytes(state2.master), tree_bytes(state.master)):
        np.testing.assert_array_equal(a, b)
    # Found inside wrappers too.
    with pytest.raises(FloatingPointError):
        nv.optim.raise_if_skipped((optax.EmptyState(), state2))


def test_clear_errors():
    mesh, fp32, params, tx, state = _single_step_setup(optax.sgd(0.1))
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update(grads_at(0, fp32), state)
    bad = dict(grads_at(0, fp32))
    bad["a"] = jnp.zeros((3, 3))
    with pytest.raises(ValueError, match="shape"):
        tx.update(bad, state, params)
    with pytest.raises(ValueError, match="same policy"):
        tx2 = nv.master_weights(optax.sgd(0.1), policy=nv.Policy(keep=("a",)))
        tx2.update(grads_at(0, fp32), tx2.init(fp32), params)
    # An NVFP4Array as a gradient (e.g. taken against the NVFP4 params) names the leaf.
    quantized = dict(grads_at(0, fp32))
    name = next(k for k, v in params.items() if isinstance(v, nv.TiledNVFP4))
    quantized[name] = nv.quantize(jnp.asarray(quantized[name], jnp.float32))
    with pytest.raises(TypeError, match=f"gradient of '{name}' is an NVFP4Array"):
        tx.update(quantized, state, params)
    # Params in their logical form (quantize_params without shard_params) where the masters are
    # sharded: one line naming the missing call, on Auto and Explicit meshes alike (not JAX's
    # "ShardingTypeError: This reshape is not supported" from inside the update).
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        m = jax.make_mesh((2,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:2])
        with jax.set_mesh(m):
            tx3 = nv.master_weights(optax.sgd(0.1))
            with pytest.raises(ValueError, match=r"parameter \S+ is in its logical form \(NVFP4Array\).*nv\.shard_params"):
                jax.jit(tx3.update)(grads_at(0, fp32), tx3.init(fp32), nv.quantize_params(fp32))


def placed_weight(x, lay, mesh):
    """``x`` as a stored NVFP4 param and its float32 master in ``lay``, sharded on ``mesh``;
    and the master's PartitionSpec."""
    stored = nv.TiledNVFP4.from_array(nv.quantize(x), lay)
    spec = lay.spec(0)
    stored = jax.device_put(stored, jax.tree.map(lambda s: NamedSharding(mesh, s), stored.specs(),
                                                 is_leaf=lambda s: isinstance(s, P)))
    master = nv.Tiled(jax.device_put(nv.Tiled.from_logical(x, lay).value, NamedSharding(mesh, spec)), lay)
    return stored, master, spec


@pytest.mark.parametrize("n", [3, 4])
def test_gather_weight_forward_and_its_ordered_reduce_scatter(n):
    """Inside shard_map: the forward gathers packed bytes and dequantizes (the weight every
    device sees); the VJP sums the devices' weight gradients in shard order, in float32,
    straight into each device's master tiles."""
    mesh = make_mesh(n)
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((40, 72)) * 0.1, jnp.float32)
    lay = nv.Layout((40, 72), n)
    stored, master, spec = placed_weight(x, lay, mesh)
    # Device i's gradient is cot[i]: bf16 values whose sum depends on the order.
    cot = jnp.asarray(rng.standard_normal((n, 40, 72)) * 10.0 ** rng.integers(-3, 3, (n, 40, 72)), jnp.bfloat16)
    cfg = nv.fetch.GatherConfig("data", jnp.bfloat16)

    def local(stored, master, c):
        w, vjp = jax.vjp(lambda m: nv.fetch.gather_weight(stored, m, cfg), master)
        return w[None], vjp(c[0])[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(stored.specs(), nv.Tiled(spec, lay), P("data")),
                              out_specs=(P("data"), nv.Tiled(spec, lay)), check_vma=False))
    w, g = f(stored, master, cot)
    want_w = np.asarray(nv.dequantize(nv.quantize(x), jnp.bfloat16), np.float32)
    for i in range(n):  # equal values (XLA may turn a -0.0 product into +0.0)
        np.testing.assert_array_equal(np.asarray(w[i], np.float32), want_w)
    acc = np.asarray(cot[0], np.float32)
    for i in range(1, n):
        acc = acc + np.asarray(cot[i], np.float32)
    want_g = acc * (np.float32(1) / np.float32(n))  # XLA turns x / n into x * (1 / n)
    assert np.asarray(g.logical()).tobytes() == want_g.tobytes()
    hlo = f.lower(stored, master, cot).compile().as_text()
    counts = nv.comm.collective_bytes(hlo)
    assert {(op, dt) for op, dt in counts} == {("all-gather", "u8"), ("all-to-all", "u16")}, counts


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_two_level_gather_and_reduction_over_racks(mode):
    """A (rack 2, data 3) mesh. fsdp: the state is sharded over ("data", "rack"), racks minor;
    the forward gathers across racks first (1/I of the bytes), then inside the rack; the VJP
    sums inside each rack first, then the racks' bf16 partial sums of this device's tiles.
    hsdp: sharded over data only, replicated over racks; the racks' partials are all-gathered.
    Both give sum_rack(bf16(sum_in_rack(g))) / 6, bit for bit."""
    import ml_dtypes

    mesh = jax.make_mesh((2, 3), ("rack", "data"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:6])
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((40, 72)) * 0.1, jnp.float32)
    axis, replica = (("data", "rack"), None) if mode == "fsdp" else ("data", "rack")
    lay = nv.Layout((40, 72), 6 if mode == "fsdp" else 3, data_axis=axis)
    stored, master, spec = placed_weight(x, lay, mesh)
    cot = jnp.asarray(rng.standard_normal((2, 3, 40, 72)) * 10.0 ** rng.integers(-3, 3, (2, 3, 40, 72)),
                      jnp.bfloat16)
    cfg = nv.fetch.GatherConfig(axis, jnp.bfloat16, replica_axis=replica)

    def local(stored, master, c):
        w, vjp = jax.vjp(lambda m: nv.fetch.gather_weight(stored, m, cfg), master)
        return w[None, None], vjp(c[0, 0])[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(stored.specs(), nv.Tiled(spec, lay), P("rack", "data")),
                              out_specs=(P("rack", "data"), nv.Tiled(spec, lay)), check_vma=False))
    w, g = f(stored, master, cot)
    want_w = np.asarray(nv.dequantize(nv.quantize(x), jnp.bfloat16), np.float32)
    for r in range(2):
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(w[r, i], np.float32), want_w)
    c = np.asarray(cot, np.float32)
    partial = [((c[r, 0] + c[r, 1]) + c[r, 2]).astype(ml_dtypes.bfloat16).astype(np.float32) for r in range(2)]
    want_g = (partial[0] + partial[1]) * (np.float32(1) / np.float32(6))
    assert np.asarray(g.logical()).tobytes() == want_g.tobytes()

    rows = nv.comm.parse(f.lower(stored, master, cot).compile().as_text(), mesh).collectives
    got = {(r.op, r.dtype, r.axes) for r in rows}
    if mode == "fsdp":
        assert got == {("all-gather", "u8", ("rack",)), ("all-gather", "u8", ("data",)),
                       ("all-to-all", "u16", ("data",)), ("all-to-all", "u16", ("rack",))}, got
        across = [r for r in rows if r.op == "all-gather" and r.axes == ("rack",)]
        assert {g for r in across for g in r.groups} == {(0, 3), (1, 4), (2, 5)}
        # The cross-rack gather moves R/N = 1/I of the tiles: 2 of the 6 shards.
        assert max(r.shape[-3] for r in across if len(r.shape) == 4) == lay.padded_tiles // 3
    else:
        assert got == {("all-gather", "u8", ("data",)), ("all-to-all", "u16", ("data",)),
                       ("all-gather", "u16", ("rack",))}, got


def test_big_plain_leaf_with_no_divisible_axis_is_stored_sharded():
    n = 6
    mesh = make_mesh(n)
    rng = np.random.default_rng(3)
    fp32 = {"emb": jnp.asarray(rng.standard_normal((257, 131)), jnp.float32)}  # 257, 131 prime
    policy = nv.Policy(keep=("emb",), keep_dtype=jnp.bfloat16)
    rules = nv.Rules(min_shard_size=1024)
    with jax.set_mesh(mesh):
        params = nv.shard_params(nv.quantize_params(fp32, policy), rules=rules)
        tx = nv.master_weights(optax.sgd(0.1), policy=policy, rules=rules)
        state = tx.init(fp32)
        state = jax.device_put(state, nv.shardings(state, mesh))
        params = jax.device_put(params, nv.shardings(params, mesh))
        m = state.master["emb"]
        # 17 x 9 = 153 tiles, padded to 156: 26 per device, for the bf16 param too.
        assert m.value.shape == (1, 156, 16, 16) and m.shape == (257, 131)
        assert m.value.addressable_shards[0].data.shape == (1, 26, 16, 16)
        assert params["emb"].value.dtype == jnp.bfloat16
        assert params["emb"].value.addressable_shards[0].data.shape == (1, 26, 16, 16)
        g = {"emb": jnp.ones((257, 131), jnp.float32)}
        u, state = jax.jit(tx.update)(g, state, params)
    new = nv.sharding.logical(apply_updates(params, u))
    expect = (fp32["emb"] - 0.1).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(new["emb"]), np.asarray(expect))
    np.testing.assert_array_equal(np.asarray(nv.sharding.logical(state.master["emb"])), np.asarray(fp32["emb"] - 0.1))


def test_collective_bytes_counts_loop_iterations():
    """A gather inside a scanned layer loop runs once per layer."""
    n = 4
    mesh = make_mesh(n)
    w = nv.shard_params({"w": nv.quantize(jnp.ones((3, 64, 64), jnp.float32))}, mesh)["w"]
    w = jax.device_put(w, nv.shardings(w, mesh))

    def body(x, layer):
        g = nv.gather({"w": layer}, mesh)["w"]
        return x @ nv.dequantize(g, jnp.float32), None

    @jax.jit
    def f(x, w):
        return jax.lax.scan(body, x, w)[0]

    hlo = f.lower(jnp.ones((8, 64), jnp.float32), w).compile().as_text()
    counts = nv.comm.collective_bytes(hlo)
    per_layer = 64 * 32 + 4 * 4  # packed bytes + scale bytes of one [64, 64] layer
    assert counts[("all-gather", "u8")] == 3 * per_layer, counts


@pytest.mark.parametrize("shape", [(4, 1), (2, 2)])
def test_shared_amax_requantizes_bit_exact_against_the_reference(shape):
    """``Policy(shared_amax=...)``: the q/k/v of each stacked layer (and gate/up) share one amax,
    the maximum of theirs, at quantization and at every re-quantization after an update, on
    data 4 and on data 2 x tensor 2 (q/k/v and gate/up split over the tensor axis): each
    member's codes and scales equal the NumPy reference quantizing its whole master with the
    group's amax, and the group's members carry the same amax bits; other leaves keep their own."""
    import reference as ref

    rng = np.random.default_rng(3)
    shapes = {"q": (2, 64, 64), "k": (2, 64, 32), "v": (2, 64, 32), "gate": (2, 64, 96), "up": (2, 64, 96),
              "down": (2, 96, 64)}
    scale = {"q": 0.5, "k": 2.0, "v": 1.0, "gate": 1.0, "up": 3.0, "down": 1.0}
    fp32 = {"blocks": {"attn": {n: {"kernel": rng.standard_normal(shapes[n]).astype(np.float32) * scale[n]}
                                for n in ("q", "k", "v")},
                       "mlp": {n: {"kernel": rng.standard_normal(shapes[n]).astype(np.float32) * scale[n]}
                               for n in ("gate", "up", "down")}}}
    policy = nv.Policy(shared_amax=(r"attn/(q|k|v)/kernel$", r"mlp/(gate|up)/kernel$"))
    mesh = jax.make_mesh(shape, ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:math.prod(shape)])
    rules = nv.Rules(stacked=(r"^blocks",), tensor=((r"attn/(q|k|v)/kernel$", -1), (r"mlp/(gate|up)/kernel$", -1),
                                                    (r"mlp/down/kernel$", -2)))
    groups = (("q", "k", "v"), ("gate", "up"), ("down",))
    path = lambda n: ("attn" if n in "qkv" else "mlp", n)

    def check(params, logical_f32):
        stored = jax.device_get(logical(params))
        for group in groups:
            want = np.max([np.abs(logical_f32[path(n)]).max(axis=(-2, -1)) for n in group], axis=0)
            for n in group:
                q = stored["blocks"][path(n)[0]][n]["kernel"]
                np.testing.assert_array_equal(np.asarray(q.amax), want)
                for layer in range(2):
                    d, s, a = ref.quantize_matrix(logical_f32[path(n)][layer], amax=np.float32(want[layer]))
                    np.testing.assert_array_equal(np.asarray(q.data[layer]), d)
                    np.testing.assert_array_equal(np.asarray(q.scale_bits[layer]), s)

    with jax.set_mesh(mesh):
        params = jax.jit(lambda t: nv.shard_params(t, mesh, rules, policy))(fp32)
        check(params, {path(n): fp32["blocks"][path(n)[0]][n]["kernel"] for group in groups for n in group})
        tx = nv.master_weights(optax.sgd(1.0), policy=policy, rules=rules)
        state = jax.jit(tx.init)(params)
        # A step that shrinks k (the group's largest) by 0.9 and the others by 0.1: the
        # shared amax moves to another member.
        shrink = {n: 0.9 if n in ("k", "up") else 0.1 for n in shapes}
        grads = {"blocks": {sec: {n: {"kernel": dataclasses.replace(m := state.master["blocks"][sec][n]["kernel"],
                                                                    value=m.value * shrink[n])}
                                  for n in state.master["blocks"][sec]} for sec in ("attn", "mlp")}}
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = apply_updates(params, updates)
        masters = jax.device_get(logical(state.master))
        check(params, {path(n): np.asarray(masters["blocks"][path(n)[0]][n]["kernel"]) for group in groups
                       for n in group})


def test_shard_params_with_a_policy_stores_kept_leaves_in_its_keep_dtype():
    """``shard_params(fp32, mesh, rules, policy)`` stores what ``shard_params(quantize_params(fp32,
    policy))`` does: NVFP4 where the policy quantizes, ``keep_dtype`` where it keeps, bit for bit."""
    mesh = make_mesh(4)
    rng = np.random.default_rng(5)
    fp32 = {"emb": jnp.asarray(rng.standard_normal((256, 64)), jnp.float32),
            "w": jnp.asarray(rng.standard_normal((64, 128)), jnp.float32), "b": jnp.zeros(128, jnp.float32)}
    policy = nv.Policy(keep=("emb",), keep_dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        direct = nv.shard_params(fp32, mesh, nv.Rules(), policy)
        via = nv.shard_params(nv.quantize_params(fp32, policy), mesh, nv.Rules())
    assert direct["emb"].value.dtype == jnp.bfloat16 and isinstance(direct["w"], nv.TiledNVFP4)
    assert direct["b"].dtype == jnp.float32  # not kept: its own dtype
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(via), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
