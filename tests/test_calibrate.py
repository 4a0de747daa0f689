"""train.calibrate and ``--calibrate N``: each NVFP4 layer's input amax over validation batches,
the W4A4 emulated validation loss next to W4A16 and bf16, and the W4A4 exports they make."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from train import calibrate as cal
from train.model import RMSNorm, from_config
from train.plan import policy_for

from conftest import main_here, tiny, tiny_worker
from test_export_hf import read_header, read_safetensors


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
    kernels = cal.nvfp4_kernels(params)
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
