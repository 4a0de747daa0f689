"""jax_nvfp4.calibrate on small Linen models of its own (the recorded amax and the W4A4 forward
against quantize/dequantize computed directly), then train.calibrate and ``--calibrate N``: each
NVFP4 layer's input amax over validation batches, the W4A4 emulated validation loss next to W4A16
and bf16, and the W4A4 exports they make."""

import json
import threading

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import calibrate as lib
from train import calibrate as cal
from train.model import RMSNorm, from_config
from train.plan import policy_for

from conftest import main_here, tiny, tiny_worker
from test_export_hf import read_header, read_safetensors


class ThreeLayers(nn.Module):
    """up [32, 48] and mid [48, 32] become NVFP4; out [32, 8] is too narrow and stays float."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nv.NVFP4Dense(48, name="up")(x))
        h = nn.relu(nv.NVFP4Dense(32, name="mid")(h))
        return nv.NVFP4Dense(8, name="out")(h)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nv.NVFP4Dense(32, name="dense")(x)), None


class Scanned(nn.Module):
    """Three layers under ``nn.scan``: one stacked ``blocks/dense/kernel [3, 32, 32]``."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(Block, variable_axes={"params": 0, "nvfp4": 0}, split_rngs={"params": True}, length=3)
        return stack(name="blocks")(x.astype(jnp.bfloat16), None)[0]  # the carry keeps its dtype


def _lib_setup(model, seed):
    """NVFP4 params of ``model`` (default policy), their bf16 weights, and two [4, 32] batches,
    the first with the larger values."""
    x0 = jax.random.normal(jax.random.key(seed), (4, 32), jnp.float32) * 3
    params = nv.quantize_params(model.init(jax.random.key(seed + 1), x0)["params"])
    batches = [np.asarray(x0), np.asarray(x0[::-1] * 0.5)]
    return params, nv.dequantize_params(params, jnp.bfloat16), batches


def _bf16_max(v) -> np.float32:
    """max |v| of a bf16 array, read exactly in float32 on the host."""
    return np.max(np.abs(np.asarray(v, np.float32)))


def _qdq(v, amax):
    """``v`` as a W4A4 kernel reads it: 1x16 NVFP4 groups, round to nearest, the global ``amax``."""
    return nv.dequantize(nv.quantize(jnp.asarray(v, jnp.float32), block=nv.BLOCK_1D, amax=amax), jnp.float32)


def test_input_amax_is_each_layers_input_max_over_the_batches():
    model = ThreeLayers()
    params, w, batches = _lib_setup(model, 0)
    amax = lib.input_amax(model.apply, params, batches)
    assert lib.nvfp4_kernels(params) == ["mid/kernel", "up/kernel"] and list(amax) == ["mid/kernel", "up/kernel"]
    want = {"up/kernel": np.float32(0), "mid/kernel": np.float32(0)}
    for b in batches:
        x = jnp.asarray(b).astype(jnp.bfloat16)
        h = nn.relu(jnp.dot(x, w["up"]["kernel"]))
        want = {"up/kernel": max(want["up/kernel"], _bf16_max(x)), "mid/kernel": max(want["mid/kernel"], _bf16_max(h))}
    for k, a in amax.items():
        assert a.dtype == np.float32 and a.shape == () and a == want[k] > 0, k
    # The max is over both batches, not the last one's.
    last = lib.input_amax(model.apply, params, batches[1:])
    assert all(last[k] < amax[k] for k in amax)
    # Stored (tile-major) params give the same amaxes.
    stored = lib.input_amax(model.apply, nv.shard_params(params), batches)
    assert {k: v.tobytes() for k, v in stored.items()} == {k: v.tobytes() for k, v in amax.items()}


def test_a_float32_layer_fed_a_bf16_activation_records_the_bf16_values():
    # The amax was taken on the float32 product before its rounding to bf16 (XLA drops the convert pair): a value
    # the layer never reads (11.8905 for a bf16 11.875).
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nv.NVFP4Dense(64, name="d1")(x)
            self.sow("intermediates", "h", h)
            return nv.NVFP4Dense(32, name="d2", dtype=jnp.float32)(h)

    model = Mixed()
    x = jnp.asarray(np.random.default_rng(6).standard_normal((64, 64)) * 3, jnp.float32)
    params = nv.quantize_params(model.init(jax.random.key(0), x)["params"])
    amax = lib.input_amax(model.apply, params, [x])
    _, sown = model.apply({"params": lib.float_weights(params)}, x, mutable=["intermediates"])
    assert sown["intermediates"]["h"][0].dtype == jnp.bfloat16
    assert amax["d2/kernel"] == _bf16_max(sown["intermediates"]["h"][0])


def test_quantized_inputs_is_the_layers_on_quantize_dequantize_of_their_inputs():
    model = ThreeLayers()
    params, w, batches = _lib_setup(model, 2)
    amax = lib.input_amax(model.apply, params, batches)
    x = jnp.asarray(batches[1])
    with lib.quantized_inputs():
        y = model.apply(lib.with_input_amax({"params": w}, amax), x)
    dense = lambda n, name, v: nv.NVFP4Dense(n).apply({"params": w[name]}, v)
    h = nn.relu(dense(48, "up", _qdq(x.astype(jnp.bfloat16), amax["up/kernel"])))
    h = nn.relu(dense(32, "mid", _qdq(h, amax["mid/kernel"])))
    want = dense(8, "out", h)  # no amax: the float layer reads its input as it is
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    # W4A4 is not W4A16, and outside the context the amaxes are not read.
    w4a16 = np.asarray(model.apply({"params": w}, x), np.float32)
    assert not np.array_equal(np.asarray(y, np.float32), w4a16)
    np.testing.assert_array_equal(np.asarray(model.apply(lib.with_input_amax({"params": w}, amax), x), np.float32),
                                  w4a16)


def test_a_scanned_stack_gets_an_amax_per_layer_and_each_layer_its_own():
    model = Scanned()
    params, w, batches = _lib_setup(model, 4)
    amax = lib.input_amax(model.apply, params, batches)
    a = amax["blocks/dense/kernel"]
    assert list(amax) == ["blocks/dense/kernel"] and a.dtype == np.float32 and a.shape == (3,)
    kernels = w["blocks"]["dense"]["kernel"]
    want = np.zeros(3, np.float32)
    for b in batches:
        h = jnp.asarray(b).astype(jnp.bfloat16)
        for i in range(3):
            want[i] = max(want[i], _bf16_max(h))
            h = nn.relu(jnp.dot(h, kernels[i]))
    np.testing.assert_array_equal(a, want)
    assert len(set(a.tolist())) == 3
    x = jnp.asarray(batches[0])
    with lib.quantized_inputs():
        y = model.apply(lib.with_input_amax({"params": w}, amax), x)
    h = x.astype(jnp.bfloat16)
    for i in range(3):
        h = nn.relu(nv.NVFP4Dense(32).apply({"params": {"kernel": kernels[i]}}, _qdq(h, a[i])))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(h, np.float32))


@pytest.mark.parametrize("scale", [0.25, 4.0])
def test_a_layer_called_twice_records_the_max_of_both_inputs(scale):
    """The larger input comes first (0.25) or last (4): neither call's alone is the amax."""

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nv.NVFP4Dense(32, name="d")
            return d(nn.relu(d(x)) * scale)

    model = Twice()
    params, w, batches = _lib_setup(model, 6)
    amax = lib.input_amax(model.apply, params, batches[:1])
    x = jnp.asarray(batches[0]).astype(jnp.bfloat16)
    first, second = _bf16_max(x), _bf16_max(nn.relu(jnp.dot(x, w["d"]["kernel"])) * scale)
    assert first != second and amax["d/kernel"] == max(first, second)


def test_input_amax_refuses_no_batches_and_an_nvfp4_kernel_no_dense_reads():
    class General(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nv.NVFP4Dense(32, name="a")(nn.DenseGeneral(32, name="b")(x))

    model = General()
    params, _, batches = _lib_setup(model, 8)
    with pytest.raises(ValueError, match="calibrate: no batches"):
        lib.input_amax(model.apply, params, [])
    with pytest.raises(ValueError, match=r"no input recorded for the NVFP4 kernels \['b/kernel'\]: only nn.Dense"):
        lib.input_amax(model.apply, params, batches)
    # A layer called with x= records its input.
    class Keyword(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nv.NVFP4Dense(32, name="b")(x=nv.NVFP4Dense(32, name="a")(x))

    amax = lib.input_amax(Keyword().apply, params, batches)
    assert set(amax) == {"a/kernel", "b/kernel"} and all(float(v) > 0 for v in amax.values())
    floats = nv.dequantize_params(nv.sharding.logical(params), jnp.float32)  # nothing NVFP4 to calibrate
    with pytest.raises(ValueError, match="calibrate: params hold no NVFP4 Linear kernel"):
        lib.input_amax(model.apply, floats, batches)
    # A scan that does not carry the "nvfp4" collection is named, not Flax's ModifyScopeVariableError; a float
    # layer under such a transform (a vmapped head kept in float) records nothing and needs nothing.
    class Unmapped(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(name="blocks")(
                x.astype(jnp.bfloat16), None)[0]

    params, _, batches = _lib_setup(Unmapped(), 8)
    with pytest.raises(ValueError, match=r"\['blocks/dense/kernel'\].* variable_axes=\{'params': 0, 'nvfp4': 0\}"):
        lib.input_amax(Unmapped().apply, params, batches)

    class FloatHeads(nn.Module):
        @nn.compact
        def __call__(self, x):
            heads = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                            axis_size=2)
            return heads(8, name="heads")(nv.NVFP4Dense(32, name="up")(x))

    params, _, batches = _lib_setup(FloatHeads(), 8)
    assert list(lib.input_amax(FloatHeads().apply, params, batches)) == ["up/kernel"]


class Scaled(nn.Dense):
    """A subclass that halves its input before nn.Dense's own call: the matmul reads x / 2 (the
    subclass's own call is not recorded: the max of both would be x's)."""

    def __call__(self, x):
        return super().__call__(0.5 * x)


class KeywordBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(32, use_bias=False, dtype=jnp.bfloat16, name="d")(inputs=x)), None


class StockLayers(nn.Module):
    """Stock Linen layers: a Dense of ``dtype`` None fed float32 (its promotion of the input with the
    bf16 weights reads float32), a subclass, and a bf16 Dense called by keyword, under a scan."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="up")(x))
        h = nn.relu(Scaled(32, use_bias=False, name="scaled")(h))
        return nn.scan(KeywordBlock, variable_axes={"params": 0, "nvfp4": 0}, split_rngs={"params": True}, length=2)(
            name="blocks")(h.astype(jnp.bfloat16), None)[0]


def _stock_forward(w, x, q=None):
    """The stock models' forward written out on their float weights ``w``: ``(output, {layer: [what
    its matmul read]})``; ``q(layer, v)`` replaces what each matmul reads."""
    q = q or (lambda path, v: v)
    inputs = {}
    dot = lambda path, v, k: jnp.dot(inputs.setdefault(path, []).append(v) or q(path, v), k)
    h = nn.relu(dot("up", x, w["up"]["kernel"]) + w["up"]["bias"])
    h = nn.relu(dot("scaled", 0.5 * h, w["scaled"]["kernel"]))
    h = h.astype(jnp.bfloat16)
    for i in range(2):
        h = nn.relu(dot(f"d{i}", h, w["blocks"]["d"]["kernel"][i]))
    return h, inputs


def _check_stock(amax, w, batches, quantized):
    """``amax`` is what each matmul of :func:`_stock_forward` read, at most, over ``batches``;
    ``quantized(x)``, the model run on quantize-dequantize of those inputs, is the forward so."""
    assert list(amax) == ["blocks/d/kernel", "scaled/kernel", "up/kernel"] and amax["blocks/d/kernel"].shape == (2,)
    want = {"up/kernel": np.float32(0), "scaled/kernel": np.float32(0), "blocks/d/kernel": np.zeros(2, np.float32)}
    for b in batches:
        _, inputs = _stock_forward(w, jnp.asarray(b))
        want["up/kernel"] = max(want["up/kernel"], _bf16_max(inputs["up"][0]))
        want["scaled/kernel"] = max(want["scaled/kernel"], _bf16_max(inputs["scaled"][0]))
        want["blocks/d/kernel"] = np.maximum(want["blocks/d/kernel"], [_bf16_max(inputs[f"d{i}"][0]) for i in range(2)])
    for k in want:
        np.testing.assert_array_equal(amax[k], want[k])
    x = jnp.asarray(batches[1])
    a = lambda path: amax["blocks/d/kernel"][int(path[1])] if path[0] == "d" else amax[f"{path}/kernel"]
    y, ref = quantized(x), _stock_forward(w, x, lambda path, v: _qdq(v, a(path)).astype(v.dtype))[0]
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(_stock_forward(w, x)[0], np.float32))


def test_stock_linen_dense_layers_record_and_quantize_what_their_matmul_reads():
    model = StockLayers()
    params, w, batches = _lib_setup(model, 10)
    amax = lib.input_amax(model.apply, params, batches)

    def quantized(x):
        with lib.quantized_inputs():
            return model.apply(lib.with_input_amax({"params": w}, amax), x)

    _check_stock(amax, w, batches, quantized)


class HalfLinear(nnx.Linear):
    def __call__(self, x):
        return super().__call__(0.5 * x)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.d = nnx.Linear(32, 32, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return nn.relu(self.d(inputs=x))


class NNXStock(nnx.Module):
    """:class:`StockLayers` in NNX: the stack made by ``nnx.vmap`` and run by ``nnx.scan``."""

    def __init__(self, rngs):
        self.up = nnx.Linear(32, 32, rngs=rngs)
        self.scaled = HalfLinear(32, 32, use_bias=False, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, h):
            return block(h)

        return body(self.blocks, nn.relu(self.scaled(nn.relu(self.up(x)))).astype(jnp.bfloat16))


def test_nnx_linear_layers_record_and_quantize_what_their_matmul_reads():
    graphdef, state = nnx.split(NNXStock(nnx.Rngs(10)))
    params = nv.quantize_params(nnx.to_pure_dict(state))
    w = nv.dequantize_params(params, jnp.bfloat16)
    x0 = jax.random.normal(jax.random.key(10), (4, 32), jnp.float32) * 3
    batches = [np.asarray(x0), np.asarray(x0[::-1] * 0.5)]
    amax = lib.input_amax_nnx(graphdef, params, batches)

    def quantized(x):
        with lib.quantized_inputs():
            return lib.with_input_amax_nnx(nnx.merge(graphdef, w), amax)(x)

    _check_stock(amax, w, batches, quantized)
    # Stored (tile-major) params, a call of its own, and a path that is no Linear kernel.
    stored = lib.input_amax_nnx(graphdef, nv.shard_params(params), [{"x": batches[1]}],
                                call=lambda m, b: m(b["x"]))
    assert all(np.all(stored[k] <= amax[k]) for k in amax) and any(np.any(stored[k] < amax[k]) for k in amax)
    with pytest.raises(KeyError, match="'blocks/kernel' is not the kernel of an nnx.Linear"):
        lib.with_input_amax_nnx(nnx.merge(graphdef, w), {"blocks/kernel": 1.0})


def test_nnx_layers_in_a_list_and_another_threads_context():
    """Layers of an nnx.List (int keys) record their inputs; quantized_inputs open in another thread
    leaves this thread's calls as they are."""

    class Listed(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(32, 32, use_bias=False, rngs=rngs) for _ in range(2)])

        def __call__(self, x):
            for layer in self.layers:
                x = nn.relu(layer(x))
            return x

    graphdef, state = nnx.split(Listed(nnx.Rngs(0)))
    params = nv.quantize_params(nnx.to_pure_dict(state))
    w = nv.dequantize_params(params, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32) * 3
    amax = lib.input_amax_nnx(graphdef, params, [np.asarray(x)])
    h = nn.relu(jnp.dot(x, w["layers"][0]["kernel"]))
    assert amax == {"layers/0/kernel": _bf16_max(x), "layers/1/kernel": _bf16_max(h)}

    model = lib.with_input_amax_nnx(nnx.merge(graphdef, w), amax)
    with lib.quantized_inputs():
        quantized = np.asarray(model(x))
    plain = np.asarray(nnx.merge(graphdef, w)(x))
    assert not np.array_equal(quantized, plain)
    opened, done = threading.Event(), threading.Event()

    def hold():
        with lib.quantized_inputs():
            opened.set()
            done.wait(30)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert opened.wait(30)
        np.testing.assert_array_equal(np.asarray(model(x)), plain)
    finally:
        done.set()
        other.join()



@pytest.fixture(scope="module")
def tiny_model():
    """tiny.yaml's model, its float32 init (the masters) and NVFP4 params, and 2 validation batches."""
    cfg = tiny()
    model = from_config(cfg.model, cfg.nvfp4)
    master = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = nv.quantize_params(master, policy_for(cfg))
    return cfg, model, master, params, cal.calibration_batches(cfg, 2)


def test_every_nvfp4_layer_gets_a_positive_finite_amax_per_layer(tiny_model):
    cfg, model, _, params, batches = tiny_model
    amax = cal.calibrate(model, params, batches)
    kernels = lib.nvfp4_kernels(params)
    assert sorted(amax) == sorted(kernels) and len(kernels) == 7  # q k v out gate up down; embed and head kept
    for path, a in amax.items():
        assert a.dtype == np.float32 and a.shape == (cfg.model.layers,), path
        assert np.all(np.isfinite(a)) and np.all(a > 0), path
    # Projections that read the same activation share its amax (fused engines' one input scale).
    for shared in (("attn/q", "attn/k", "attn/v"), ("mlp/gate", "mlp/up")):
        for p in shared[1:]:
            np.testing.assert_array_equal(amax[f"blocks/{p}/kernel"], amax[f"blocks/{shared[0]}/kernel"])
    # Over more batches the max can only grow.
    first = cal.calibrate(model, params, batches[:1])
    assert all(np.all(first[k] <= amax[k]) for k in amax)


def test_the_amax_is_the_layer_inputs_max_computed_directly(tiny_model):
    """Layer 0's q/k/v read RMSNorm(embedding) in bf16: its max |x| over both batches."""
    cfg, model, _, params, batches = tiny_model
    amax = cal.calibrate(model, params, batches)
    w = nv.dequantize_params(params, jnp.float32)
    norm = RMSNorm(cfg.model.norm_eps, jnp.bfloat16)
    scale = {"params": {"scale": w["blocks"]["norm1"]["scale"][0]}}
    direct = max(float(np.max(np.abs(np.asarray(norm.apply(scale, w["embed"].astype(jnp.bfloat16)[b[:, :-1]]),
                                                np.float32)))) for b in batches)
    assert amax["blocks/attn/q/kernel"][0] == np.float32(direct)


@pytest.mark.slow
def test_w4a4_loss_is_finite_and_not_the_w4a16_loss(tiny_model):
    _, model, master, params, batches = tiny_model
    amax = cal.calibrate(model, params, batches)
    losses = cal.validation_losses(model, params, amax, batches, master=master)
    assert sorted(losses) == ["bf16", "w4a16", "w4a4"] and all(np.isfinite(v) for v in losses.values())
    assert losses["w4a4"] != losses["w4a16"] and losses["w4a16"] != losses["bf16"]
    # W4A16 is the model with the dequantized NVFP4 weights, as the run evaluates it.
    rows = [np.asarray(jax.vmap(lambda l, t: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(l), t[:, None], -1)))(
        model.clone(remat=None).apply({"params": nv.dequantize_params(params, jnp.bfloat16)}, jnp.asarray(b[:, :-1])),
        jnp.asarray(b[:, 1:])), np.float64) for b in batches]
    assert losses["w4a16"] == pytest.approx(float(np.mean(np.concatenate(rows))), rel=1e-6)
    print(f"\ntiny init: bf16 {losses['bf16']:.5f}  W4A16 {losses['w4a16']:.5f}  W4A4 {losses['w4a4']:.5f}")


def test_calibrate_needs_an_export(capfd):
    for args, want in ((["--calibrate", "2"], "--calibrate N calibrates an --export-hf export"),
                       (["--calibrate", "0", "--export-hf", "x"], "expected a positive number of validation batches")):
        with pytest.raises(SystemExit) as e:
            from train.__main__ import parse_args

            parse_args(args)
        assert e.value.code == 2 and want in capfd.readouterr().err


def test_calibrate_needs_held_out_batches(tmp_path, capfd):
    """Text or token data without a held-out split is refused, exit 2, as train.eval_every is: the
    calibration would run on the training windows (and call their loss a validation loss)."""
    rc, _, err = main_here(["--out", str(tmp_path / "run"), "--export-hf", str(tmp_path / "hf"), "--calibrate", "2",
                            "--set", "data.source=file", "--set", f"data.path={__file__}"], capfd)
    assert rc == 2 and len(err) == 1 and "--calibrate 2 calibrates on held-out batches" in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()


def test_calibrate_past_the_held_out_tokens_is_refused(tmp_path, capfd):
    """``--calibrate N`` on token files: more batches than the held-out windows hold would calibrate on the same
    windows again (the split's order repeats); refused before training, naming the most it holds."""
    from train.config import load_config
    from train.data import make_source
    from train.prepare import prepare

    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i} of a small corpus, with words to tokenize\n" for i in range(400)))
    prepare([str(text)], str(tmp_path / "tok.bin"), vocab_size=300, progress=False)
    sets = ["data.source=tokens", f"data.path={tmp_path / 'tok.bin'}", "data.val_fraction=0.1", "model.vocab=512"]
    cfg = load_config(None, sets)
    n = make_source(cfg.data, cfg.model, split="val").num_windows(cfg.model.seq_len + 1)
    most = max(1, n // cfg.data.batch_size)
    assert n > 1
    args = ["--out", str(tmp_path / "run"), "--export-hf", str(tmp_path / "hf"), *sets]
    rc, _, err = main_here([*args, "--calibrate", str(most + 1)], capfd)
    assert rc == 2 and len(err) == 1, err
    assert f"--calibrate {most + 1}: the held-out tokens hold {n} window(s)" in err[0], err
    assert f"give --calibrate {most} or less" in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
@tiny_worker
def test_cli_calibrate_writes_w4a4_exports(tmp_path, capfd):
    """``--calibrate 2 --export-hf DIR``: DIR/nvfp4 carries each NVFP4 Linear's
    input_global_scale (448 * 6 / the calibrated amax, exact in the header) under the NVFP4
    preset; DIR/bf16 is unchanged; the three losses are printed."""
    x = tmp_path / "hf"
    rc, out, err = main_here(["--set", "train.steps=2", "--set", "optim.warmup_steps=0", "--export-hf", str(x),
                              "--calibrate", "2", "--out", str(tmp_path / "run")], capfd)
    assert rc == 0, err
    assert "validation loss on them: bf16 " in out and " / W4A16 " in out and " / W4A4 " in out
    assert "(compressed-tensors, W4A4)" in out
    q = json.loads((x / "nvfp4" / "config.json").read_text())["quantization_config"]
    assert q["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    header = read_header(x / "nvfp4" / "model.safetensors")
    exact = json.loads(header["__metadata__"][nv.export.AMAX_METADATA])
    st = read_safetensors(x / "nvfp4" / "model.safetensors")
    scales = [k for k in st if k.endswith(".input_global_scale")]
    assert len(scales) == 2 * 7 and all(k.replace("input_global_scale", "weight_packed") in st for k in scales)
    for k in scales:
        a = np.uint32(int(exact[k], 16)).view(np.float32)
        assert a > 0 and st[k].dtype == np.float32 and st[k][0] == np.float32(448 * 6) / a
    bf16 = read_safetensors(x / "bf16" / "model.safetensors")
    assert not any(k.endswith((".input_global_scale", ".input_scale")) for k in bf16)


def test_a_model_that_is_one_dense_on_an_unbatched_input_and_an_nnx_model_with_more_state():
    """A bare nn.Dense (its kernel's path is "kernel") fed one [K] vector records and quantizes it; an
    NNX model with a Dropout (RNG state besides the params) calibrates with that state as rest=."""
    x = jax.random.normal(jax.random.key(3), (32,), jnp.float32) * 3
    dense = nn.Dense(32, dtype=jnp.bfloat16)
    params = nv.quantize_params(dense.init(jax.random.key(0), x)["params"])
    amax = lib.input_amax(dense.apply, params, [np.asarray(x)])
    assert amax == {"kernel": _bf16_max(x.astype(jnp.bfloat16))}
    w = lib.float_weights(params)
    with lib.quantized_inputs():
        y = dense.apply(lib.with_input_amax({"params": w}, amax), x)
    want = dense.apply({"params": w}, _qdq(x.astype(jnp.bfloat16)[None], amax["kernel"])[0])
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(32, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.a(x), deterministic=True)

    graphdef, state, rest = nnx.split(Dropped(nnx.Rngs(0)), nnx.Param, ...)
    params = nv.quantize_params(nnx.to_pure_dict(state))
    with pytest.raises(ValueError, match=r"calibrate: nnx.merge\(graphdef, params\): .* needs that state as rest="):
        lib.input_amax_nnx(graphdef, params, [x[None]])
    assert lib.input_amax_nnx(graphdef, params, [x[None]], rest=rest) == {"a/kernel": _bf16_max(x)}
