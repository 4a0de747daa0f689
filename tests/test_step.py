"""The sharded step's and evaluation's batches: an array of rows, or a tree of arrays that
share their rows (``(inputs, labels)``, a dict), split over the data axis alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_nvfp4 as nv


def _setup():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    fp32 = {"w1": jax.random.normal(k1, (32, 64)) * 0.2, "w2": jax.random.normal(k2, (64, 8)) * 0.2}
    x = jax.random.normal(k3, (16, 32))
    y = jnp.arange(16) % 8
    return mesh, fp32, x, y


def _loss(p, x, y):
    logits = jax.nn.relu(x @ p["w1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def test_a_tree_batch_trains_and_evaluates_as_its_rows_packed_in_one_array():
    """``(inputs, labels)`` and ``{"x", "y"}`` batches give the losses, params and evaluation
    of one array holding the same rows, with and without gradient accumulation; leaves that
    do not share their rows, rows that do not split over the data axis and an evaluation that
    does not return per-row results are one-line errors."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    import flax.linen as nn

    mesh, fp32, x, y = _setup()
    packed = jnp.concatenate([x, y[:, None].astype(jnp.float32)], axis=1)
    losses = {
        "array": lambda p, r, k: _loss(nn.meta.unbox(p), r[:, :-1], r[:, -1].astype(jnp.int32)),
        "tuple": lambda p, r, k: _loss(nn.meta.unbox(p), r[0], r[1]),
        "dict": lambda p, r, k: _loss(nn.meta.unbox(p), r["x"], r["y"]),
    }
    batches = {"array": packed, "tuple": (x, y), "dict": {"x": x, "y": y}}
    out = {}
    with jax.set_mesh(mesh):
        tx = nv.master_weights(optax.adam(1e-2))
        for accum in (1, 2):
            for kind in batches:
                params, state = nv.sharded_state(fp32, tx, mesh, nv.Rules(), nv.Policy())
                step = jax.jit(nv.make_step(losses[kind], tx, mesh, grad_accum=accum))
                history = []
                for _ in range(3):
                    params, state, metrics = step(params, state, batches[kind])
                    history.append(float(metrics["loss"]))
                out[kind, accum] = history, [np.asarray(a).tobytes() for a in jax.tree.leaves((params, state))]
            assert out["tuple", accum] == out["array", accum] == out["dict", accum]
            assert out["array", accum][0][-1] < out["array", accum][0][0]
        rows = lambda p, r: jnp.sum(jax.nn.relu(r["x"] @ nn.meta.unbox(p)["w1"]), axis=-1)
        evaluate = jax.jit(nv.make_eval(rows, mesh))
        whole = np.asarray(jnp.sum(jax.nn.relu(x @ nv.dequantize_params(nv.gather(params))["w1"]), axis=-1))
        np.testing.assert_allclose(np.asarray(evaluate(params, {"x": x})), whole, rtol=1e-2)
        both = jax.jit(nv.make_eval(lambda p, r: {"sum": rows(p, r), "x": r["x"]}, mesh))(params, {"x": x})
        assert np.asarray(both["x"]).tobytes() == np.asarray(x).tobytes()  # a tree of per-row results
        with pytest.raises(ValueError, match=r"^make_eval: fn\(params, rows\) returns per-row results"):
            jax.jit(nv.make_eval(lambda p, r: jnp.sum(r["x"]), mesh))(params, {"x": x})
        step = jax.jit(nv.make_step(losses["tuple"], tx, mesh))
        with pytest.raises(ValueError, match=r"^a batch is an array of rows, or a tree of arrays sharing"):
            step(params, state, (x, y[:8]))
        with pytest.raises(ValueError, match=r"^the batch's 6 rows do not split evenly"):
            step(params, state, (x[:6], y[:6]))


def test_leaves_that_are_not_float_weights():
    """The model reads an integer leaf as it is (not rounded through the weights' bf16); the
    master-weight optimizer refuses one (and an RNG key, as an unfiltered NNX state holds),
    naming the leaf; so is a Linen nn.Partitioned box (its unbox would constrain the value
    inside the step's per-device program); a state without master weights is refused by the
    step, naming the fix."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    import flax.linen as nn

    mesh, fp32, x, y = _setup()
    ids = jnp.array([257, 3, 1025, 7], jnp.int32)  # 257 and 1025 are not bf16 numbers
    with jax.set_mesh(mesh):
        params = nv.shard_params(dict(fp32, ids=ids), mesh, nv.Rules(), nv.Policy())
        params = jax.device_put(params, nv.shardings(params, mesh))
        read = jax.jit(nv.make_eval(lambda p, r: jnp.broadcast_to(nn.meta.unbox(p)["ids"], (r.shape[0], 4)), mesh))
        assert np.asarray(read(params, x)).tolist() == [ids.tolist()] * 16
        tx = nv.master_weights(optax.adam(1e-2))
        for name, extra in (("ids", {"ids": ids}), ("rngs/key", {"rngs": {"key": jax.random.key(0)}})):
            with pytest.raises(TypeError, match=rf"^master_weights: param '{name}' is .*only float params are trained"):
                nv.sharded_state({**fp32, **extra}, tx, mesh, nv.Rules(), nv.Policy())
        boxed = dict(fp32, w1=nn.Partitioned(fp32["w1"], (None, "data")))  # nn.with_partitioning's box
        with pytest.raises(ValueError, match=r"^'w1' is a flax nn.Partitioned box .*nn.unbox\(params\)"):
            nv.sharded_state(boxed, tx, mesh, nv.Rules(), nv.Policy())
        plain = nv.sharded_state(fp32, optax.adam(1e-2), mesh, nv.Rules(), nv.Policy(keep=(".*",)))
        step = jax.jit(nv.make_step(lambda p, r, k: _loss(nn.meta.unbox(p), r[0], r[1]), optax.adam(1e-2), mesh))
        with pytest.raises(TypeError, match=r"^make_step: opt_state holds no nv.master_weights state"):
            step(*plain, (x, y))


def test_a_state_stepped_with_another_mesh_or_optimizer_is_refused_naming_the_fix():
    """A state stored for 4 data shards, stepped or evaluated on a mesh of 2, is refused before
    its tiles are misread; so is the bare optax transform in place of the master-weight
    optimizer the state was built with. The same state trains on its own mesh."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    import flax.linen as nn

    mesh, fp32, x, y = _setup()
    two = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    loss = lambda p, r, k: _loss(nn.meta.unbox(p), r[0], r[1])
    tx = nv.master_weights(optax.adam(1e-2))
    with jax.set_mesh(mesh):
        params, state = nv.sharded_state(fp32, tx, mesh, nv.Rules(), nv.Policy())
        with pytest.raises(TypeError, match=r"^make_step: opt_state is a nv.master_weights state but tx is not"):
            jax.jit(nv.make_step(loss, optax.adam(1e-2), mesh))(params, state, (x, y))
        with pytest.raises(ValueError, match=r"^master_weights: the optimizer state was built by another inner "
                                             r"optimizer than this one's"):
            jax.jit(nv.make_step(loss, nv.master_weights(optax.sgd(1e-2)), mesh))(params, state, (x, y))
        assert np.isfinite(float(jax.jit(nv.make_step(loss, tx, mesh))(params, state, (x, y))[2]["loss"]))
        # A transform after or around the wrapper: its float updates saturated the stored bytes (NaN from step 2).
        # An integer scale keeps them bytes (each doubled: finite, and as far from the masters as the weights are);
        # a trace after it fails in optax's own tree mapping. Each is refused by where the wrapper sits.
        for outer in (optax.chain(tx, optax.scale(1.0)), optax.apply_if_finite(tx, 3), optax.chain(tx, optax.scale(2)),
                      optax.chain(tx, optax.trace(0.9)), optax.masked(tx, lambda p: jax.tree.map(lambda _: True, p))):
            p, s = nv.sharded_state(fp32, outer, mesh, nv.Rules(), nv.Policy())
            with pytest.raises(TypeError, match=r"^make_step: .*nv.master_weights must be the outermost transform"):
                jax.jit(nv.make_step(loss, outer, mesh))(p, s, (x, y))
        # Transforms before it in a chain act on the gradients, and MultiSteps passes its updates through.
        for outer in (optax.chain(optax.zero_nans(), tx), optax.named_chain(("nans", optax.zero_nans()), ("mw", tx)),
                      optax.MultiSteps(tx, 2),
                      optax.inject_hyperparams(lambda learning_rate: nv.master_weights(optax.adam(learning_rate)))(
                          learning_rate=1e-2)):
            p, s = nv.sharded_state(fp32, outer, mesh, nv.Rules(), nv.Policy())
            assert np.isfinite(float(jax.jit(nv.make_step(loss, outer, mesh))(p, s, (x, y))[2]["loss"]))
    with jax.set_mesh(two):
        with pytest.raises(ValueError, match=r"^make_step: 'w1' is stored as 4 shards over 'data', which this mesh "
                                             r"\{'data': 2\} makes 2: build the state on the mesh the step runs on"):
            jax.jit(nv.make_step(loss, tx, two))(params, state, (x, y))
        with pytest.raises(ValueError, match=r"^make_eval: 'w1' is stored as 4 shards over 'data'"):
            jax.jit(nv.make_eval(lambda p, r: r[:, 0], two))(params, x)


def test_a_shape_based_weight_decay_mask_sees_the_logical_params():
    """``optax.adamw(mask=nv.optim.logical_mask(lambda p: p.ndim == 2))`` inside
    ``master_weights`` decays the matrices and not the vectors, as the same mask does for a
    plain optax reference on float params (the masters' tiled leaves are 4-D arrays); so do
    ``optax.masked`` and ``optax.multi_transform`` labels through it."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    mesh, _, x, y = _setup()
    fp32 = {"kernel": jnp.ones((64, 96)), "bias": jnp.ones((96,))}
    matrices = nv.optim.logical_mask(lambda p: p.ndim == 2)
    labels = nv.optim.logical_mask(lambda p: "matrix" if p.ndim == 2 else "vector")
    decayed = optax.chain(optax.add_decayed_weights(1.0), optax.sgd(0.5))
    for make in (lambda: optax.adamw(0.5, weight_decay=1.0, mask=matrices),
                 lambda: optax.chain(optax.masked(optax.add_decayed_weights(1.0), matrices), optax.sgd(0.5)),
                 lambda: optax.multi_transform({"matrix": decayed, "vector": optax.sgd(0.5)}, labels)):
        ref = make()
        zeros = jax.tree.map(jnp.zeros_like, fp32)
        want = optax.apply_updates(fp32, ref.update(zeros, ref.init(fp32), fp32)[0])
        with jax.set_mesh(mesh):
            tx = nv.master_weights(make())
            params, state = nv.sharded_state(fp32, tx, mesh, nv.Rules(), nv.Policy(keep=("bias",)))
            step = jax.jit(nv.make_step(lambda p, r, k: 0.0 * jnp.sum(r), tx, mesh))
            params, state, _ = step(params, state, x)
            got = nv.sharding.logical(nv.find_state(state).master)
        assert isinstance(nv.find_state(state).master["kernel"], nv.Tiled)  # its leaf is 4-D
        for k in fp32:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
        assert float(want["kernel"][0, 0]) == 0.5 and float(want["bias"][0]) == 1.0


def test_a_kept_float_kernel_split_over_the_tensor_axis_trains_like_data_parallel():
    """A kernel the policy keeps in float (a head) but a tensor rule splits is gathered as its
    tensor shard, as an NVFP4 one is: data 4 x tensor 2 trains and evaluates like data 8 (within
    bf16 rounding: the tensor sums run in another order)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest asks for 8 simulated CPU devices)")
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, use_bias=False, name="head")(jax.nn.gelu(nn.Dense(256, use_bias=False, name="up")(x)))

    model, x = M(), jax.random.normal(jax.random.key(1), (16, 64))
    fp32 = model.init(jax.random.key(0), x)["params"]
    loss = lambda p, rows, key: jnp.mean((model.apply({"params": p}, rows) - rows) ** 2)
    rules = nv.Rules(tensor=(("up/kernel$", -1), ("head/kernel$", -2)))
    policy, out = nv.Policy(keep=("head",)), {}
    for shape in ((8, 1), (4, 2)):
        mesh = jax.make_mesh(shape, ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        tx = nv.master_weights(optax.adam(1e-2), rules=rules, policy=policy)
        with jax.set_mesh(mesh):
            params, state = nv.sharded_state(fp32, tx, mesh, rules, policy)
            if shape == (4, 2):
                assert not nv.array.is_nvfp4(params["head"]["kernel"]) and params["head"]["kernel"].layout.n_tensor == 2
            # The same stored bits on either mesh: their evaluation first, then three steps.
            rows = jax.jit(nv.make_eval(lambda p, r: jnp.mean((model.apply({"params": p}, r) - r) ** 2, -1), mesh,
                                        rules))(params, x)
            step = jax.jit(nv.make_step(loss, tx, mesh, rules))
            losses = []
            for _ in range(3):
                params, state, metrics = step(params, state, x)
                losses.append(float(metrics["loss"]))
        out[shape] = losses, np.asarray(rows)
    np.testing.assert_allclose(out[(4, 2)][0], out[(8, 1)][0], rtol=3e-3)
    np.testing.assert_allclose(out[(4, 2)][1], out[(8, 1)][1], rtol=3e-3)
    assert out[(8, 1)][0][-1] < out[(8, 1)][0][0]


@pytest.mark.filterwarnings("ignore:'.value' access is now deprecated")  # Flax's, for the read it still allows
def test_an_nnx_module_may_read_its_params_any_way_nnx_allows():
    """``variable[...]``, ``variable.value``, ``variable.get_value()``, the variable's own
    operators (``x @ variable``) and array methods (``.T``, ``.astype(variable.dtype)``) all read
    the gathered weight: the same step, loss and gradients."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest asks for 8 simulated CPU devices)")
    from flax import nnx

    reads = {"getitem": lambda v: v[...], "value": lambda v: v.value, "get_value": lambda v: v.get_value(),
             "operator": lambda v: v, "T": lambda v: v.value.T.T,
             "astype": lambda v: v.value.astype(v.dtype).reshape(v.shape[0], -1)[:, :v.ndim * 32]}

    class M(nnx.Module):
        def __init__(self, read, rngs):
            self.read = read
            self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 64)) * 0.1)

        def __call__(self, x):
            return x @ reads[self.read](self.w) * 1.5

    x = jax.random.normal(jax.random.key(1), (16, 64))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    out = {}
    for read in reads:
        graph, state = nnx.split(M(read, nnx.Rngs(0)))
        loss = lambda p, r, k: jnp.mean((nnx.merge(graph, p)(r) - r) ** 2)
        tx = nv.master_weights(optax.adam(1e-2))
        with jax.set_mesh(mesh):
            params, opt = nv.sharded_state(nnx.to_pure_dict(state), tx, mesh, nv.Rules(), nv.Policy())
            params, opt, metrics = jax.jit(nv.make_step(loss, tx, mesh))(params, opt, x)
        out[read] = float(metrics["loss"]), [np.asarray(a).tobytes() for a in jax.tree.leaves(params)]
    assert out["value"] == out["get_value"] == out["operator"] == out["getitem"] == out["T"] == out["astype"]


def test_tensor_manual_refuses_a_model_that_never_combines_its_ranks():
    """Under ``tensor="manual"`` a split weight reaches the model as this rank's sub-matrix: a
    model that never communicates over the tensor axis (stock layers) is refused at trace time,
    in the step and the evaluation, instead of training on each rank's partial result; the same
    model summing its ranks' partial outputs (``nv.step.tensor_parallel(mesh).sum``) trains like
    data parallelism."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest asks for 8 simulated CPU devices)")
    _, fp32, x, y = _setup()
    rules = nv.Rules(tensor=(("^w1$", -1), ("^w2$", -2)))

    def logits(p, x, combine):
        return combine(jax.nn.relu(x @ p["w1"][...]) @ p["w2"][...])

    out = {}
    for shape, tensor in (((8, 1), "gspmd"), ((4, 2), "manual")):
        mesh = jax.make_mesh(shape, ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        tp = nv.step.tensor_parallel(mesh, rules)
        loss = lambda combine: lambda p, r, k: optax.softmax_cross_entropy_with_integer_labels(
            logits(p, r[0], combine).astype(jnp.float32), r[1]).mean()
        tx = nv.master_weights(optax.adam(1e-2), rules=rules)
        with jax.set_mesh(mesh):
            params, state = nv.sharded_state(fp32, tx, mesh, rules, nv.Policy())
            if tensor == "manual":
                with pytest.raises(ValueError, match=r"^tensor='manual': 2 weights split over the tensor axis 'tensor'"):
                    jax.jit(nv.make_step(loss(lambda z: z), tx, mesh, rules, tensor=tensor))(params, state, (x, y))
                with pytest.raises(ValueError, match=r"^tensor='manual': .* sends nothing over that axis"):
                    jax.jit(nv.make_eval(lambda p, r: logits(p, r, lambda z: z), mesh, rules, tensor=tensor))(params, x)
                # A stock layer checks its kernel against its features: it fails on the shard, named as such.
                import flax.linen as nn

                dense = nn.Dense(fp32["w1"].shape[1], use_bias=False)
                stock = lambda p, r: dense.apply({"params": {"kernel": p["w1"]}}, r)
                with pytest.raises(ValueError, match=r"^tensor='manual': the model failed on this rank's sub-matrices "
                                                     r".*ScopeParamShapeError.*run with tensor='gspmd'"):
                    jax.jit(nv.make_eval(stock, mesh, rules, tensor=tensor))(params, x)
                # The recipe GEMM on a kernel split over the tensor axis is not implemented under gspmd: named.
                def recipe(p, r):
                    with nv.intercept_dense():
                        return stock(p, r)
                with pytest.raises(NotImplementedError, match=r"recipe GEMM .* tensor='gspmd' is not implemented: run "
                                                              r"the recipe on a data-only mesh"):
                    jax.jit(nv.make_eval(recipe, mesh, rules, tensor="gspmd"))(params, x)
            step = jax.jit(nv.make_step(loss(tp.sum), tx, mesh, rules, tensor=tensor))
            losses = []
            for _ in range(3):
                params, state, metrics = step(params, state, (x, y))
                losses.append(float(metrics["loss"]))
        out[tensor] = losses
    np.testing.assert_allclose(out["manual"], out["gspmd"], rtol=3e-3)
    assert out["gspmd"][-1] < out["gspmd"][0]


def test_state_a_model_writes_and_arrays_it_closes_over_are_named():
    """A param leaf the model writes in its call (nnx.BatchNorm's running statistics in the
    params) is refused in one TypeError naming the fix, not Flax's item-assignment error; an
    array sharded over Explicit axes that the loss closes over is refused with the step's own
    way in (its extra arguments), which trains."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    from flax import nnx

    _, fp32, x, y = _setup()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])
    tx = nv.master_weights(optax.sgd(0.1))
    bn = nnx.BatchNorm(32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(bn)
    with jax.set_mesh(mesh):
        params, opt_state = nv.sharded_state({**fp32, "bn": nnx.to_pure_dict(state)}, tx, mesh)

        def writes(p, r, k):
            model = nnx.merge(graphdef, nnx.State(p["bn"]))
            return _loss(p, model(r[0]), r[1])
        with pytest.raises(TypeError, match=r"^a leaf of the trained params is written inside the model .*BatchNorm"):
            jax.jit(nv.make_step(writes, tx, mesh))(params, opt_state, (x, y))
        # A Linen model's variables passed whole: its batch statistics would be trained as weights.
        with pytest.raises(TypeError, match=r"^master_weights: the params hold Flax's 'batch_stats' collection"):
            nv.sharded_state({"params": fp32, "batch_stats": {"mean": jnp.zeros(32)}}, tx, mesh)
        params, opt_state = nv.sharded_state(fp32, tx, mesh)
        shift = jax.device_put(jnp.full((32,), 0.5), jax.sharding.NamedSharding(mesh, jax.P("data")))
        with pytest.raises(NotImplementedError, match=r"closes over an array sharded over Explicit mesh axes.*extra "
                                                      r"arguments"):
            jax.jit(nv.make_step(lambda p, r, k: _loss(p, r[0] + shift, r[1]), tx, mesh))(params, opt_state, (x, y))
        step = jax.jit(nv.make_step(lambda p, r, k, s: _loss(p, r[0] + s, r[1]), tx, mesh))
        assert np.isfinite(float(step(params, opt_state, (x, y), None, shift)[2]["loss"]))  # replicated for it
