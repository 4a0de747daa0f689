"""A Flax model this project did not write, adopted without editing its source: transformers'
Linen Llama (``FlaxLlamaForCausalLMModule``: stock ``nn.Dense`` / ``nn.Embed`` layers, a Python
loop over decoder layers). Its params are sharded as NVFP4 and trained with ``nv.make_step``:

- on data 8, each layer's packed bytes are all-gathered where the layer runs (u8 gathers of
  one matrix each, no float collective at all), and the losses equal the README's whole-model
  gather (``nv.dequantize_params(nv.gather(params))``) on the same weights;
- on data 4 x tensor 2 (the kernels named in ``nv.Rules(tensor=...)``, GSPMD runs the layers),
  each rank gathers its own half of a split kernel over the data axis only, every float
  collective is an activation collective over the tensor axis, and the losses match data 8
  within bf16 rounding.
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_nvfp4 as nv

pytestmark = pytest.mark.xdist_group("adopt")

STEPS = 3
# Megatron's splits, by the transformers module names: q/k/v and gate/up along their outputs,
# o and down along their inputs.
TENSOR_RULES = (("(q|k|v)_proj/kernel$", -1), ("(gate|up)_proj/kernel$", -1), ("(o|down)_proj/kernel$", -2))


@pytest.fixture(scope="module")
def setup():
    # Imported here, not at the top: transformers' Flax Llama takes seconds to import, and
    # only the tests that train it need it (a skip when transformers is not installed).
    flax_llama = pytest.importorskip("transformers.models.llama.modeling_flax_llama")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = flax_llama.FlaxLlamaForCausalLMModule(cfg, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 256)

    def logits(params, x):
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        return model.apply({"params": params}, x, jnp.ones_like(x), positions)[0]

    def loss_fn(params, rows, key=None):
        out = logits(params, rows[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(out, rows[:, 1:]).mean()

    x = tokens[:, :-1]
    fp32 = jax.jit(model.init)(jax.random.key(0), x, jnp.ones_like(x), jnp.broadcast_to(jnp.arange(32), x.shape))
    return fp32["params"], loss_fn, tokens


def train(setup, shape, names, tensor_rules=()):
    """STEPS steps of adamw; the step's losses, the whole-model-gather losses on the same
    params before each step, the stored params and the compiled step's collectives."""
    fp32, loss_fn, tokens = setup
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:math.prod(shape)])
    with jax.set_mesh(mesh):
        rules = nv.Rules(tensor=tensor_rules)
        tx = nv.master_weights(optax.adamw(3e-3), rules=rules)
        params, opt_state = nv.sharded_state(fp32, tx, mesh, rules, nv.Policy())
        step = jax.jit(nv.make_step(loss_fn, tx, mesh, rules))
        whole = jax.jit(lambda p, t: loss_fn(nv.dequantize_params(nv.gather(p)), t))
        program = nv.comm.parse(step.lower(params, opt_state, tokens).compile().as_text(), mesh)
        stored = params
        losses, wholes = [], []
        for _ in range(STEPS):
            wholes.append(float(whole(params, tokens)))
            params, opt_state, metrics = step(params, opt_state, tokens)
            losses.append(float(metrics["loss"]))
    return np.array(losses), np.array(wholes), stored, program


@pytest.fixture(scope="module")
def data8(setup):
    return train(setup, (8,), ("data",))


def matrices(stored):
    return [q for q in jax.tree.leaves(stored, is_leaf=nv.layout.is_tiled) if isinstance(q, nv.TiledNVFP4)]


def matrix_bytes(q, tensor=1):
    return (q.data.size + q.scale_bits.size) // tensor


def array_bytes(kernels, tensor=1):
    """The sizes of each matrix's two gathered arrays: its packed codes and its scale bytes."""
    return {n // tensor for q in kernels for n in (q.data.size, q.scale_bits.size)}


def test_a_stock_linen_llama_trains_with_per_layer_packed_gathers(data8):
    losses, wholes, stored, program = data8
    kernels = matrices(stored)
    assert len(kernels) == 2 * 7 + 2  # q k v o gate up down per layer, the embedding and the head
    moved = program.by("op", "dtype")
    assert all(dtype[0] in "up" for _, dtype in moved), moved  # bits and flags only: no float collective
    gathers = program.select(op="all-gather", dtype="u8", purpose="weight gather")
    # One matrix's codes or scale bytes per gather (never a layer's, let alone the model's),
    # every matrix gathered at its point of use (forward, and again in the backward).
    assert {c.bytes for c in gathers} == array_bytes(kernels)
    assert sum(c.per_call for c in gathers) >= sum(matrix_bytes(q) for q in kernels)
    assert losses[-1] < losses[0] - 0.2, losses  # it learns: 5.56 -> 5.17 in 3 steps when written
    # The same weights through the README's whole-model gather: equal within float32 sums in
    # another order (the step averages the devices' row means).
    np.testing.assert_allclose(losses, wholes, rtol=1e-5)
    assert losses[0] == pytest.approx(float(np.log(256)), rel=0.01)


@pytest.mark.slow
def test_tensor_parallel_on_the_stock_llama_matches_data_parallel(setup, data8):
    losses, wholes, stored, program = train(setup, (4, 2), ("data", "tensor"), TENSOR_RULES)
    kernels = matrices(stored)
    split = [q for q in kernels if q.layout.n_tensor == 2]
    assert len(split) == 2 * 7
    # Weights and gradients cross the data axis as bits only; the float collectives are the
    # activations GSPMD places over the tensor axis.
    for c in program.collectives:
        if c.dtype[0] not in "up":
            assert c.axes == ("tensor",) and c.purpose != "weight gather", c
    gathers = program.select(op="all-gather", dtype="u8", purpose="weight gather")
    assert all(c.axes == ("data",) for c in gathers), {c.axes for c in gathers}
    # A split kernel's gather moves this rank's half of its bytes.
    assert array_bytes(split, 2) <= {c.bytes for c in gathers}
    # The same weights through the whole-model gather: a split GEMM's partial sums are rounded to
    # the model's bf16 before the tensor-axis all-reduce, where the unsplit GEMM rounds once, so
    # the losses agree to ~1e-5 (1.01e-5 at the third step on a Xeon host), not to float32 order.
    np.testing.assert_allclose(losses, wholes, rtol=1e-4)
    np.testing.assert_allclose(losses, data8[0], rtol=2.0 ** -8)  # within bf16 rounding of data 8


@pytest.mark.slow
def test_the_recipe_on_stock_dense_layers_equals_nvfp4dense():
    """``nv.intercept_dense()`` runs the recipe GEMMs (stochastic rounding, Hadamard wgrad) in
    a model's stock ``nn.Dense`` layers: a step of it equals, bit for bit, the same model
    written with ``nv.NVFP4Dense(compute="nvfp4")`` (loss and every updated param)."""
    import flax.linen as nn

    def make(dense):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                h = jax.nn.gelu(dense(128, "up")(nn.RMSNorm()(x)))
                return x + dense(64, "down")(h), None

        class Model(nn.Module):
            @nn.compact
            def __call__(self, tokens):
                x = nn.Embed(256, 64)(tokens)
                blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                                 split_rngs={"params": True, "rounding": True}, length=2)
                return dense(256, "head")(blocks(name="blocks")(x, None)[0])

        return Model()

    stock = make(lambda f, name: nn.Dense(f, use_bias=False, dtype=jnp.bfloat16, name=name))
    layer = make(lambda f, name: nv.NVFP4Dense(f, compute="nvfp4", name=name))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 256)
    fp32 = jax.jit(stock.init)(jax.random.key(0), tokens[:, :-1])["params"]
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def one_step(model, intercept):
        def loss_fn(params, rows, key):
            ctx = nv.intercept_dense() if intercept else contextlib.nullcontext()
            with ctx:
                logits = model.apply({"params": params}, rows[:, :-1], rngs={"rounding": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), rows[:, 1:]).mean()

        with jax.set_mesh(mesh):
            rules = nv.Rules(stacked=("^blocks/",))
            tx = nv.master_weights(optax.sgd(0.1), rules=rules)
            params, opt_state = nv.sharded_state(fp32, tx, mesh, rules, nv.Policy())
            params, _, metrics = jax.jit(nv.make_step(loss_fn, tx, mesh, rules))(params, opt_state, tokens,
                                                                                jax.random.key(7))
        return float(metrics["loss"]), jax.tree.leaves(jax.device_get(nv.sharding.logical(params)))

    # Without the interceptor the stock model's GEMMs are plain bf16 ones, which differ from
    # NVFP4Dense's recipe: equality shows the recipe ran in the stock layers.
    loss, params = one_step(stock, True)
    want_loss, want = one_step(layer, False)
    assert loss == want_loss
    assert len(params) == len(want)
    for a, b in zip(params, want):
        np.testing.assert_array_equal(np.asarray(a.data if nv.array.is_nvfp4(a) else a),
                                      np.asarray(b.data if nv.array.is_nvfp4(b) else b))


def test_an_nnx_model_split_by_its_logical_axis_names_trains_like_data_parallel():
    """An NNX model whose kernels carry logical axis names (``nnx.with_partitioning``), its
    blocks in a Python loop: ``nv.tensor_rules_from_logical`` reads the splits from the names,
    and data 4 x tensor 2 trains like data 8 within bf16 rounding, every weight gather over
    the data axis only."""
    from flax import nnx

    init = nnx.initializers.lecun_normal()

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.norm = nnx.RMSNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                                 rngs=rngs)
            self.down = nnx.Linear(4 * d, d, use_bias=False,
                                   kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    class Model(nnx.Module):
        def __init__(self, layers, vocab=256, d=64, *, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
            self.head = nnx.Linear(d, vocab, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")), rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    with nnx.use_eager_sharding(False):  # the names say how to split; no mesh at creation
        graphdef, state = nnx.split(Model(2, rngs=nnx.Rngs(0)))
    tensor_rules = nv.tensor_rules_from_logical(state)
    assert tensor_rules == (("^blocks/0/down/kernel$", -2), ("^blocks/0/up/kernel$", -1),
                            ("^blocks/1/down/kernel$", -2), ("^blocks/1/up/kernel$", -1), ("^head/kernel$", -1))
    fp32 = nnx.to_pure_dict(state)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 256)

    def loss_fn(params, rows, key=None):
        logits = nnx.merge(graphdef, params)(rows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), rows[:, 1:]).mean()

    data8 = train((fp32, loss_fn, tokens), (8,), ("data",))
    losses, wholes, stored, program = train((fp32, loss_fn, tokens), (4, 2), ("data", "tensor"), tensor_rules)
    assert sum(q.layout.n_tensor == 2 for q in matrices(stored)) == 5
    assert {c.axes for c in program.select(purpose="weight gather")} == {("data",)}
    for c in program.collectives:
        if c.dtype[0] not in "up":
            assert c.axes == ("tensor",), c  # activations only, GSPMD's
    np.testing.assert_allclose(losses, data8[0], rtol=2.0 ** -8)
    np.testing.assert_allclose(losses, wholes, rtol=1e-5)
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.slow
def test_the_state_is_built_where_it_lives():
    """``nv.sharded_state``: the stored params and the optimizer state of a stock Linen model
    are, bit for bit and sharding for sharding, what ``shard_params``, ``tx.init`` of the float
    params (the masters: those values) and a ``device_put`` give op by op. Given the model's
    init instead of its params, the same state (the init's float rounding aside), and the
    program's temporaries are under a quarter of the float32 model per device (0.15 of it when
    written; 1.0 or more if the init ran replicated), on Auto and Explicit mesh axes alike: the
    8 devices initialise their own shards, none holds the whole float model or state."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(256, use_bias=False)(jax.nn.gelu(nn.Dense(1024, use_bias=False)(nn.RMSNorm()(x)))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(1024, 256)(tokens)
            x = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(x, None)[0]
            return nn.Dense(1024, use_bias=False)(x)

    model, x = Model(), jnp.zeros((8, 32), jnp.int32)
    init = lambda: model.init(jax.random.key(0), x)["params"]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rules, policy = nv.Rules(stacked=("^ScanBlock_0/",)), nv.Policy()
    tx = nv.master_weights(optax.adamw(1e-3), rules=rules)
    fp32 = jax.jit(init)()
    with jax.set_mesh(mesh):  # the training stack's composition: masters from the float params
        params, opt_state = nv.shard_params(fp32, mesh, rules, policy), tx.init(fp32)
        want = jax.device_put((params, opt_state), nv.shardings((params, opt_state), mesh))
    got = nv.sharded_state(fp32, tx, mesh, rules, policy)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(isinstance(q, nv.TiledNVFP4) for q in jax.tree.leaves(got[0], is_leaf=nv.layout.is_tiled))
    # The masters are the float params themselves, not their 4-bit values.
    masters = jax.device_get(nv.sharding.logical(nv.find_state(got[1]).master))
    for a, b in zip(jax.tree.leaves(masters), jax.tree.leaves(fp32), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # From the init: the same state, up to the init's float rounding in another program (a few
    # float32 ulps of the weights' scale, 0.06).
    from_init = nv.sharded_state(init, tx, mesh, rules, policy)
    assert jax.tree.structure(from_init) == jax.tree.structure(want)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(from_init), jax.tree.leaves(want)))
    masters = [nv.find_state(s).master for s in (from_init[1], want[1])]
    for a, b in zip(*map(jax.tree.leaves, masters)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-8)
    whole = sum(a.nbytes for a in jax.tree.leaves(fp32))
    state = sum(a.nbytes for a in jax.tree.leaves(got))
    # A plain optax transform would update the 4-bit codes themselves: refused, naming the fix.
    with pytest.raises(TypeError, match=r"no nv.master_weights state.*nv.master_weights\(optax"):
        nv.sharded_state(fp32, optax.adamw(1e-3), mesh, rules, policy)
    # The same on Explicit axes (jax.make_mesh's default) set as the context mesh, as the README
    # does, where the init's types say replicated.
    explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    for m in (mesh, explicit):
        with jax.set_mesh(m):
            memory = jax.jit(lambda: nv.sharded_state(init, tx, m, rules, policy)).lower().compile().memory_analysis()
        assert memory.argument_size_in_bytes == 0
        assert memory.output_size_in_bytes < state / 6  # each device its eighth, small leaves replicated
        assert memory.temp_size_in_bytes < whole / 4, (m.axis_types, memory.temp_size_in_bytes, whole)


def test_a_mesh_without_the_data_axis_is_refused():
    """The README's recipe on a mesh whose axis is not named "data" (or the rules' data axis):
    the state and the step refuse to build with one error naming the mesh and the fix, instead
    of running fully replicated."""
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    tx = nv.master_weights(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"none of the rules' batch axes .*nv.Rules\(data_axis=") as e:
        nv.make_step(lambda p, r, k: 0.0, tx, mesh, nv.Rules())
    assert "'batch': 4" in str(e.value)
    with pytest.raises(ValueError, match=r"none of the rules' batch axes"):  # nor is a whole state built replicated
        nv.sharded_state({"w": jnp.ones((64, 64))}, tx, mesh, nv.Rules(), nv.Policy())
    with pytest.raises(ValueError, match=r"none of the rules' batch axes \('dta',\)"):  # nor laid out whole
        nv.shard_params({"w": jnp.ones((64, 64))}, mesh, nv.Rules(data_axis="dta"), nv.Policy())
    nv.make_step(lambda p, r, k: 0.0, tx, mesh, nv.Rules(data_axis="batch"))  # named: accepted
    # The batch's axes, in mesh order (a rack-major process layout keeps each process's rows together).
    racked = jax.make_mesh((2, 2, 2), ("rack", "data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    assert nv.step.batch_axes(racked, nv.Rules(data_axis=("data", "rack"))) == ("rack", "data")
    assert nv.step.batch_axes(mesh, nv.Rules(data_axis="batch")) == ("batch",)


def test_the_interceptor_replaces_dense_s_own_product_only():
    """Under ``nv.intercept_dense()`` a subclass of ``nn.Dense`` keeps its own code around its
    ``super().__call__`` (which runs the recipe), ``inputs=`` by keyword runs it too, a
    ``DenseGeneral`` reading an NVFP4 kernel runs as written with a warning, and a batch of
    no tokens is an empty result."""
    import warnings

    import flax.linen as nn

    class Scaled(nn.Dense):
        def __call__(self, x):
            return 100 * super().__call__(x) + 7

    x = jax.random.normal(jax.random.key(1), (8, 32))
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def rows(model, call=lambda m, p, r: m.apply({"params": p}, r), intercept=True):
        fp32 = model.init(jax.random.key(0), x)["params"]
        with jax.set_mesh(mesh):
            params = nv.shard_params(fp32, mesh, nv.Rules(), nv.Policy())
            ctx = nv.intercept_dense() if intercept else contextlib.nullcontext()

            def fn(p, r):
                with ctx:
                    return call(model, p, r)
            return np.asarray(jax.jit(nv.make_eval(fn, mesh))(params, x))

    dense = rows(nn.Dense(16, use_bias=False))
    assert not np.array_equal(dense, rows(nn.Dense(16, use_bias=False), intercept=False))  # the recipe ran
    np.testing.assert_array_equal(rows(Scaled(16, use_bias=False)), 100 * dense + 7)
    np.testing.assert_array_equal(rows(nn.Dense(16, use_bias=False), lambda m, p, r: m.apply({"params": p}, inputs=r)),
                                  dense)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        general = rows(nn.DenseGeneral(16, use_bias=False))
    assert any("DenseGeneral" in str(w.message) and "runs as written" in str(w.message) for w in caught)
    np.testing.assert_array_equal(general, rows(nn.DenseGeneral(16, use_bias=False), intercept=False))
    # No tokens: an empty product, zero gradients (quantize refuses an empty matrix).
    w = np.asarray(x[:, :16].T @ x[:, :16], np.float32)
    y, grads = jax.value_and_grad(lambda a, b: nv.gemm.dot(a, nv.quantize(w), b).sum(), argnums=(0, 1))(
        jnp.zeros((0, 16)), jnp.asarray(w))
    assert float(y) == 0 and grads[0].shape == (0, 16) and not np.any(np.asarray(grads[1]))
