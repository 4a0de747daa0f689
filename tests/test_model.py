"""train.model: Llama 3 shapes, grouped-query attention, HF Llama's rotary/RMSNorm, tied head."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.scale import PRESETS
from train.config import ConfigError, from_dict, load_config, validate_for_devices
from train.model import Llama, RMSNorm, from_config, rope_frequencies, rotary


def param_count(preset):
    cfg = from_dict({"model": dict(preset, seq_len=16)})
    model = from_config(cfg.model, cfg.nvfp4)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))["params"]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)), shapes


@pytest.mark.parametrize("name, billions", [("llama3_8b", 8.03), ("llama3_70b", 70.6)])
def test_llama3_presets_have_llama3_parameter_counts(name, billions):
    n, shapes = param_count(PRESETS[name])
    assert abs(n / (billions * 1e9) - 1) < 0.005, n
    # Exactly Llama 3's (HF's num_parameters() of Meta-Llama-3-8B / 70B).
    assert n == {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496}[name]
    d, layers = PRESETS[name]["d_model"], PRESETS[name]["layers"]
    assert shapes["blocks"]["attn"]["k"]["kernel"].shape == (layers, d, 8 * 128)
    assert PRESETS["8b"] is PRESETS["llama3_8b"] and PRESETS["70b"] is PRESETS["llama3_70b"]


def test_gqa_matches_repeated_kv_reference():
    """jax.nn.dot_product_attention with 2 kv heads for 4 query heads equals causal softmax
    attention with each kv head repeated for its query group (float32). Each side is one
    jitted program (op by op, each of their few dozen operations compiles a program of its own)."""
    model = Llama(vocab=64, d_model=64, layers=1, heads=4, kv_heads=2, hidden=64, dtype=jnp.float32, init_std=0.2)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 12))
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    attn = params["blocks"]["attn"]
    assert attn["k"]["kernel"].shape == (1, 64, 32) and attn["q"]["kernel"].shape == (1, 64, 64)

    x = jax.random.normal(jax.random.key(1), (2, 12, 64))
    from train.model import Attention, Dims

    layer = Attention(Dims(64, 4, 2, hidden=0, init_std=0.2, dtype=jnp.float32, attention="xla"))
    p = jax.jit(layer.init)(jax.random.key(2), x)
    got = jax.jit(layer.apply)(p, x)

    @jax.jit
    def reference(x, w):
        q = rotary((x @ w["q"]).reshape(2, 12, 4, 16), 10000.0)
        k = rotary((x @ w["k"]).reshape(2, 12, 2, 16), 10000.0)
        v = (x @ w["v"]).reshape(2, 12, 2, 16)
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)  # query head h uses kv head h // 2
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        logits = jnp.where(jnp.tril(jnp.ones((12, 12), bool)), logits, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(2, 12, 64) @ w["out"]

    want = reference(x, {k: p["params"][k]["kernel"] for k in ("q", "k", "v", "out")})
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert jax.eval_shape(model.apply, {"params": params}, tokens).shape == (2, 12, 64)


def test_rotary_is_hf_rotate_half():
    """HF Llama: q * cos + rotate_half(q) * sin with rotate_half(x) = cat(-x2, x1) and
    inv_freq = theta ** -(arange(0, hd, 2) / hd); written here in NumPy float64."""
    x = np.random.default_rng(0).standard_normal((1, 7, 3, 8)).astype(np.float32)
    theta, hd = 500000.0, 8
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(7)[:, None] * inv[None]
    emb = np.concatenate([ang, ang], -1)[None, :, None, :]
    rot = np.concatenate([-x[..., 4:], x[..., :4]], -1)
    want = x * np.cos(emb) + rot * np.sin(emb)
    np.testing.assert_allclose(np.asarray(rotary(jnp.asarray(x), theta)), want, rtol=1e-5, atol=1e-5)


LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


def test_llama31_presets_have_transformers_rotary_frequencies():
    """The Llama 3.1 presets carry Meta's published rope scaling (Llama 3's have none), and
    their inverse frequencies are transformers' (its rope init function on the same
    LlamaConfig, CPU torch), bit for bit; the llama3 scaling also follows Meta's reference
    formula (written here in float64, per frequency)."""
    for name in ("llama31_8b", "llama31_70b", "llama31_405b"):
        assert PRESETS[name]["rope_scaling"] == LLAMA31_SCALING and PRESETS[name]["rope_theta"] == 500000.0, name
    assert "rope_scaling" not in PRESETS["llama3_8b"] and "rope_scaling" not in PRESETS["llama3_70b"]
    assert {k: v for k, v in PRESETS["llama31_8b"].items() if k != "rope_scaling"} == PRESETS["llama3_8b"]

    def meta(freqs, factor, low, high, old):
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                s = (old / wavelen - low) / (high - low)
                out.append((1 - s) * f / factor + s * f)
        return np.array(out)

    plain = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, from_dict({"model": PRESETS["llama31_8b"]}).model.rope_scaling)
    np.testing.assert_allclose(scaled, meta(plain.astype(np.float64), 8.0, 1.0, 4.0, 8192), rtol=1e-6)
    # Wavelengths up to 8192 / 4 positions keep their frequency, the longer ones slow down.
    np.testing.assert_array_equal(scaled < plain, 2 * np.pi / plain > 8192 / 4)
    assert np.all(scaled <= plain)

    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("llama3_8b", "llama3_70b", "llama31_8b", "llama31_70b", "llama31_405b"):
        preset = PRESETS[name]
        m = from_dict({"model": dict(preset, seq_len=16)}).model
        hf = transformers.LlamaConfig(hidden_size=m.d_model, num_attention_heads=m.heads,
                                      num_key_value_heads=m.kv_heads, rope_theta=m.rope_theta,
                                      rope_scaling=preset.get("rope_scaling"), max_position_embeddings=131072)
        theirs, scale = ROPE_INIT_FUNCTIONS["llama3" if m.rope_scaling else "default"](hf, "cpu")
        assert scale == 1.0
        np.testing.assert_array_equal(rope_frequencies(m.head_dim, m.rope_theta, m.rope_scaling), theirs.numpy(),
                                      err_msg=name)


def test_rope_scaling_config():
    cfg = load_config(None, ["model.rope_scaling={factor: 8, original_max_position_embeddings: 8192}"])
    assert cfg.model.rope_scaling.high_freq_factor == 4.0 and from_config(cfg.model, cfg.nvfp4).rope_scaling is not None
    assert load_config(None, []).model.rope_scaling is None
    for override, message in (("model.rope_scaling={rope_type: yarn}", "model.rope_scaling.rope_type='yarn': must be"),
                              ("model.rope_scaling={factr: 8}", "unknown key model.rope_scaling.factr (did you mean"),
                              ("model.rope_scaling={high_freq_factor: 1}", "must be > model.rope_scaling.low_freq"),
                              ("model.rope_scaling=8", "model.rope_scaling: expected a mapping")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [override])


def test_rmsnorm_rounds_like_hf():
    """HF: weight * (x_f32 * rsqrt(mean(x^2) + eps)).to(bf16), the product in bf16."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 32)), jnp.bfloat16)
    scale = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, 32), jnp.float32)
    got = RMSNorm(1e-5).apply({"params": {"scale": scale}}, x)
    xf = np.asarray(x, np.float32)
    y = (xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + np.float32(1e-5))).astype(jnp.bfloat16)
    want = (y.astype(np.float32) * np.asarray(scale.astype(jnp.bfloat16), np.float32)).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0.008)


def test_attention_implementation_choice():
    from train.attention import IMPLEMENTATIONS, attention, blockwise_attention

    # This suite runs on CPU: auto is the blockwise attention there (cuDNN cannot even be
    # traced without a GPU); the config takes each implementation by name.
    assert jax.default_backend() == "cpu"
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 2, 16)), jnp.bfloat16)
    auto = jax.jit(lambda q: attention(q, q, q, "auto", block=16)).lower(q).as_text()
    blockwise = jax.jit(lambda q: blockwise_attention(q, q, q, block=16)).lower(q).as_text()
    assert auto == blockwise
    for name in IMPLEMENTATIONS:
        assert load_config(None, [f"model.attention={name}"]).model.attention == name
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=flash"])


def test_tied_head_has_no_head_kernel():
    kw = dict(vocab=48, d_model=32, layers=1, heads=2, hidden=32)
    model = Llama(**kw, tie_embeddings=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 8)), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    assert "head" not in params and params["embed"].shape == (48, 32)
    tied = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    # The logits are the untied model's with the head kernel set to the embedding transposed.
    untied = {**params, "head": {"kernel": params["embed"].T}}
    want = np.asarray(jax.jit(Llama(**kw).apply)({"params": untied}, tokens))
    assert tied.shape == (2, 8, 48)
    np.testing.assert_allclose(tied, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    other = {**params, "head": {"kernel": params["embed"].T[:, ::-1]}}
    assert not np.allclose(np.asarray(jax.jit(Llama(**kw).apply)({"params": other}, tokens)), tied, atol=1e-3)


def test_an_unknown_remat_policy_is_named():
    with pytest.raises(ValueError, match=r"remat policy must be one of \['dots', 'nothing'\], got 'full'"):
        Llama(vocab=48, d_model=32, layers=1, heads=2, hidden=32, remat="full").init(
            jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def test_kv_heads_config_checks():
    assert load_config(None, ["model.heads=4", "model.kv_heads=2"]).model.n_kv_heads == 2
    assert load_config(None, ["model.heads=4"]).model.n_kv_heads == 4  # 0 = as many as the query heads
    with pytest.raises(ConfigError, match="model.kv_heads=3: must divide model.heads=4"):
        load_config(None, ["model.heads=4", "model.kv_heads=3"])
    # Fewer key/value heads than tensor ranks: replicated when they divide the axis.
    cfg = load_config(None, ["model.heads=4", "model.kv_heads=1", "model.d_model=256", "model.mlp_hidden=512", "mesh.tensor=2",
                             "mesh.data=4"])
    assert validate_for_devices(cfg, 8) == {"data": 4, "tensor": 2}
    cfg = load_config(None, ["model.heads=6", "model.kv_heads=3", "model.d_model=384", "model.mlp_hidden=512", "mesh.tensor=2",
                             "mesh.data=4"])
    with pytest.raises(ConfigError, match="model.kv_heads=3: must be divisible by the mesh tensor axis"):
        validate_for_devices(cfg, 8)


@pytest.mark.slow
def test_layers_kept_in_bf16_run_bf16_gemms_under_the_recipe():
    """compute="nvfp4" quantizes only the NVFP4 layers' GEMMs: with every block kept (and the
    head) the logits are the bf16 model's, bit for bit; the recipe's quantization shows as soon
    as one block or the head is not kept."""
    kw = dict(vocab=256, d_model=64, layers=2, heads=2, hidden=64)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)

    def logits(keep_last, **k):
        # Init and each forward pass as one program (op by op, each op compiles its own).
        params = jax.jit(Llama(**kw, keep_last=keep_last).init)(jax.random.key(0), tokens)["params"]
        return [np.asarray(jax.jit(Llama(**kw, keep_last=keep_last, compute=c, **k).apply)({"params": params}, tokens))
                for c in ("dequant", "nvfp4")]

    bf16, recipe = logits(2)
    np.testing.assert_array_equal(recipe, bf16)
    bf16, recipe = logits(2, keep_head=False)
    assert not np.array_equal(recipe, bf16)
    bf16, recipe = logits(1)
    assert not np.array_equal(recipe, bf16)
    # from_config keeps the head when nvfp4.keep_bf16 matches it (the default does).
    cfg = load_config(None, [])
    assert from_config(cfg.model, cfg.nvfp4).keep_head
    assert not from_config(cfg.model, load_config(None, ["nvfp4.keep_bf16=[embed]"]).nvfp4).keep_head


def test_recipe_switches_reach_every_nvfp4_layer(monkeypatch):
    """nvfp4.grad_rounding / wgrad_hadamard / activations become the model's Recipe, every
    recipe GEMM of the model receives it (traced, not compiled), and a layer with nearest
    rounding computes gradients that do not depend on the rounding key."""
    from jax_nvfp4 import gemm
    from jax_nvfp4.nn import NVFP4Dense, Recipe

    cfg = load_config(None, ["nvfp4.compute=nvfp4", "nvfp4.grad_rounding=nearest", "nvfp4.wgrad_hadamard=false",
                             "nvfp4.activations=bf16"])
    assert from_config(cfg.model, cfg.nvfp4).recipe == Recipe(False, False, False)
    assert from_config(cfg.model, load_config(None, []).nvfp4).recipe == Recipe()

    calls, dot = [], gemm.dot
    monkeypatch.setattr(gemm, "dot", lambda *a, **k: calls.append((k["key"] is None, k["rht_wgrad"], k["quantize_x"]))
                        or dot(*a, **k))
    kw = dict(vocab=256, d_model=64, layers=2, heads=2, hidden=64, compute="nvfp4", keep_head=False)
    tokens = jnp.zeros((1, 16), jnp.int32)
    params = jax.eval_shape(Llama(**kw).init, jax.random.key(0), tokens)["params"]
    for recipe in (Recipe(), Recipe(False, False, False), Recipe(quantize_activations=False)):
        calls.clear()
        jax.eval_shape(lambda p: Llama(**kw, recipe=recipe).apply({"params": p}, tokens, rngs={"rounding": jax.random.key(1)}),
                       params)
        # q, k, v, out, gate, up, down of the scanned block (traced more than once) and the head.
        assert len(calls) >= 8
        assert set(calls) == {(not recipe.stochastic_grads, recipe.hadamard_wgrad, recipe.quantize_activations)}

    layer = lambda r: NVFP4Dense(32, compute="nvfp4", recipe=r)
    x = jax.random.normal(jax.random.key(2), (16, 32))
    p = layer(Recipe()).init(jax.random.key(3), x)

    @functools.partial(jax.jit, static_argnums=0)
    def grads(r, key):
        return jax.grad(lambda p: jnp.sum(layer(r).apply(p, x, rngs={"rounding": key}) ** 2))(p)["params"]["kernel"]

    k1, k2 = jax.random.key(4), jax.random.key(5)
    assert not np.array_equal(grads(Recipe(), k1), grads(Recipe(), k2))
    np.testing.assert_array_equal(grads(Recipe(stochastic_grads=False), k1), grads(Recipe(stochastic_grads=False), k2))
