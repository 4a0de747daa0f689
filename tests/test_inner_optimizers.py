"""What ``nv.master_weights`` promises about the optax transform inside it and the policy it
re-quantizes with: element-wise optimizers and per-matrix statistics update the masters as the
same transform updates plain float32 params; transforms that need a matrix's rows and columns
(the masters are 16x16 tiles) are refused by name; the state is built with the policy the
optimizer re-quantizes with, on any mix of Explicit and Auto mesh axes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_nvfp4 as nv


def _setup(n=4):
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(jax.nn.gelu(nn.Dense(96, use_bias=False)(x)))

    model = M()
    x, y = jax.random.normal(jax.random.key(1), (8, 48)), jax.random.normal(jax.random.key(2), (8, 16))
    fp = model.init(jax.random.key(0), x)["params"]
    loss = lambda p, rows, key: jnp.mean((model.apply({"params": p}, rows[0]) - rows[1]) ** 2)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    return fp, loss, (x, y), mesh


@pytest.mark.parametrize("name", ["lamb", pytest.param("novograd", marks=pytest.mark.slow)])
def test_per_matrix_statistics_update_the_masters_as_optax_updates_the_matrix(name):
    """LAMB's trust ratio and NovoGrad's per-matrix second moment (a scalar state inside each
    tiled master) are those of the matrix: the masters move as plain optax moves the float32
    params, from the same gradients (the dequantized weights')."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    fp, loss, batch, mesh = _setup()
    make = {"lamb": lambda: optax.lamb(1e-2), "novograd": lambda: optax.novograd(1e-2)}[name]
    tx, rules = nv.master_weights(make()), nv.Rules()
    with jax.set_mesh(mesh):
        params, state = nv.sharded_state(fp, tx, mesh, rules, nv.Policy())
        step = jax.jit(nv.make_step(loss, tx, mesh, rules, dtype=jnp.float32))
        state = step(params, state, batch)[1]
    ref = make()

    @jax.jit  # the reference and the masters' logical form in one program (eagerly: a program an op)
    def reference(params, master):
        grads = jax.grad(loss)(nv.dequantize_params(nv.sharding.logical(params), jnp.float32), batch, None)
        return optax.apply_updates(fp, ref.update(grads, ref.init(fp), fp)[0]), nv.sharding.logical(master)

    want, got = reference(jax.device_get(params), jax.device_get(nv.find_state(state).master))
    leaves = zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), jax.tree.leaves(fp))
    for (path, g), w, f in leaves:
        moved = float(jnp.max(jnp.abs(w - f)))
        # Within 0.2% of the move: float32 rounding of the gradient sums, which Adam's first
        # step (g / (|g| + eps)) magnifies where |g| is near eps. A statistic taken per tile or per
        # device shard instead of per matrix would be off by its ratio to the matrix's, O(1).
        assert moved > 0 and float(jnp.max(jnp.abs(g - w))) <= 2e-3 * moved, jax.tree_util.keystr(path)


@pytest.mark.parametrize("name", ["adafactor", "sm3", "muon"])
def test_transforms_that_need_a_matrix_rows_and_columns_are_refused(name):
    # Adafactor factors, SM3 covers by rows and columns, Muon orthogonalises: on 16x16 tiles
    # each would silently compute something else (Muon: its Adam branch for every matrix).
    fp, _, _, mesh = _setup()
    inner = {"adafactor": optax.adafactor(1e-2), "sm3": optax.sm3(1e-2), "muon": optax.contrib.muon(1e-2)}[name]
    with pytest.raises(TypeError, match=r"^master_weights: the inner (optimizer|transform) .*element-wise"):
        nv.sharded_state(fp, nv.master_weights(inner), mesh, nv.Rules(), nv.Policy())


@pytest.mark.parametrize("name", ["clip_by_block_rms", "scale_by_param_block_rms", "adaptive_grad_clip", "centralize",
                                  "lookahead"])
def test_stateless_transforms_of_a_leafs_axes_or_mean_are_refused_wherever_they_sit(name):
    # Their state says nothing, so they are found by name, inside chains, masks, MultiSteps and
    # inject_hyperparams. Measured before the refusal, clip_by_block_rms(0.01) on a 17x33 matrix
    # (padded to 32x48) let through an update of rms 0.0165.
    fp, _, _, mesh = _setup()
    inner = {"clip_by_block_rms": optax.chain(optax.adam(1e-2), optax.clip_by_block_rms(0.01)),
             "scale_by_param_block_rms": optax.MultiSteps(optax.scale_by_param_block_rms(), 2).gradient_transformation(),
             "adaptive_grad_clip": optax.masked(optax.adaptive_grad_clip(0.1), lambda p: jax.tree.map(lambda _: True, p)),
             "centralize": optax.inject_hyperparams(  # named inside a factory of the user's
                 lambda learning_rate: optax.chain(optax.adam(learning_rate), optax.centralize()))(learning_rate=1e-2),
             "lookahead": optax.lookahead(optax.adam(1e-2), 2, 0.5)}[name]
    with pytest.raises(TypeError, match=rf"^master_weights: the inner transform contains optax.{name}, which "):
        nv.sharded_state(fp, nv.master_weights(inner), mesh, nv.Rules(), nv.Policy())
    # A function of the user's that shares a name with one (a schedule here) is not it.
    ns = {"__name__": "user_code"}
    exec(f"def {name}(step):\n    return 1e-2", ns)
    assert ns[name].__qualname__ == name
    nv.sharded_state(fp, nv.master_weights(optax.adam(ns[name])), mesh, nv.Rules(), nv.Policy())


def test_the_state_is_quantized_with_the_policy_the_optimizer_requantizes_with():
    """four_over_six reaches the first quantization too (the bits of quantize_params with the
    policy, which an lr=0 step leaves as they are); a policy whose re-quantization differs from
    the optimizer's (shared amax groups, four_over_six) is refused instead of being dropped after
    the first step."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    fp, loss, batch, mesh = _setup()
    policy = nv.Policy(four_over_six=True, block=(1, 16))
    tx, rules = nv.master_weights(optax.sgd(0.0), policy=policy), nv.Rules()
    with jax.set_mesh(mesh):
        params, state = nv.sharded_state(fp, tx, mesh, rules, policy)
        stepped = jax.jit(nv.make_step(loss, tx, mesh, rules))(params, state, batch)[0]
        with pytest.raises(ValueError, match=r"^sharded_state: the policy quantizes with .*'four_over_six': True.*"
                                             r"re-quantizes after every step with .*'four_over_six': False"):
            nv.sharded_state(fp, nv.master_weights(optax.sgd(0.0)), mesh, rules, policy)
        # So is one that keeps a param in float where the other makes it NVFP4 (the step failed on it,
        # telling the user to pass the stored params they had passed).
        with pytest.raises(ValueError, match=r"^sharded_state: the policy stores 'Dense_0/kernel' as float, the "
                                             r"nv.master_weights optimizer's policy as NVFP4"):
            nv.sharded_state(fp, tx, mesh, rules, nv.Policy(keep=["Dense_0"], four_over_six=True, block=(1, 16)))
        # The other way round the optimizer follows the stored NVFP4 layout: as before, it trains.
        keeps = nv.master_weights(optax.sgd(0.0), policy=nv.Policy(keep=["Dense_0"], four_over_six=True, block=(1, 16)))
        assert isinstance(nv.sharded_state(fp, keeps, mesh, rules, policy)[0]["Dense_0"]["kernel"], nv.TiledNVFP4)
    want = nv.quantize_params(fp, policy)
    bits = lambda t: [np.asarray(a).tobytes() for a in jax.tree.leaves(t)]
    assert bits(nv.sharding.logical(params)) == bits(want) == bits(nv.sharding.logical(stepped))
    plain = nv.quantize_params(fp, nv.Policy(block=(1, 16)))
    assert bits(plain) != bits(want)  # four_over_six moved some scales


def test_without_a_policy_the_state_takes_the_optimizers():
    """``sharded_state`` without ``policy=`` quantizes what the ``master_weights`` inside ``tx``
    re-quantizes (its default policy, or the one it was given), not nothing: float params are
    never silently trained in float32."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    fp, _, _, mesh = _setup()
    bits = lambda t: [np.asarray(a).tobytes() for a in jax.tree.leaves(t)]
    kept = nv.Policy(keep=("Dense_1",), four_over_six=True)
    for tx, policy in ((nv.master_weights(optax.adam(1e-3)), nv.Policy()),
                       (optax.chain(optax.clip(1.0), nv.master_weights(optax.adam(1e-3), policy=kept)), kept)):
        with jax.set_mesh(mesh):
            params, _ = nv.sharded_state(fp, tx, mesh, nv.Rules())
        assert isinstance(params["Dense_0"]["kernel"], nv.TiledNVFP4)
        assert bits(nv.sharding.logical(params)) == bits(nv.quantize_params(fp, policy))
    with jax.set_mesh(mesh):
        params, _ = nv.sharded_state(fp, optax.adam(1e-3), mesh, nv.Rules())  # no master weights: float training
    assert not any(isinstance(x, nv.TiledNVFP4) for x in jax.tree.leaves(params, is_leaf=nv.layout.is_tiled))


def test_an_explicit_data_axis_with_an_auto_tensor_axis_trains_like_auto_axes():
    """make_step asks for an Auto tensor axis; the data axis may stay Explicit (jax.make_mesh's
    default): the state is built and the step gives the losses of an all-Auto mesh."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest asks for 8 simulated CPU devices)")
    fp, loss, batch, _ = _setup()
    rules = nv.Rules(tensor=(("Dense_1/kernel$", -1),))  # the [48, 96] one
    A, E = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
    losses = {}
    for types in ((A, A), (E, A)):
        mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=types)
        tx = nv.master_weights(optax.adam(1e-2), rules=rules)
        with jax.set_mesh(mesh):
            params, state = nv.sharded_state(fp, tx, mesh, rules, nv.Policy())
            step = jax.jit(nv.make_step(loss, tx, mesh, rules))
            out = []
            for _ in range(2):
                params, state, metrics = step(params, state, batch)
                out.append(float(metrics["loss"]))
        losses[types] = out
    assert losses[(E, A)] == losses[(A, A)]
