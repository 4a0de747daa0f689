"""jax_nvfp4.export.export_hf: Hugging Face Llama checkpoints, bf16, compressed-tensors NVFP4 and
ModelOpt NVFP4.

The CI tests read the safetensors files with their own header parser and decode the
compressed-tensors and ModelOpt NVFP4 layouts themselves; the ``hf`` extra's tests (torch,
transformers, compressed-tensors) and the ModelOpt one (nvidia-modelopt) load the exports with
those libraries and skip cleanly without them.
"""

import importlib.util
import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4.export import AMAX_METADATA, export_hf, nvfp4_to_compressed_tensors, read_modelopt
from train.model import HF_NAMES, SEGMENTS, Llama, llama_config

from conftest import main_here

# One pytest-xdist worker runs this module: the exports (module fixture) are written once, and
# torch is imported once where the hf extra is installed.
pytestmark = pytest.mark.xdist_group("export_hf")

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
ST_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "U8": np.uint8}
SHAPES = dict(vocab=96, d_model=64, layers=3, heads=4, kv_heads=2, hidden=96, rope_theta=500000.0)


def read_header(path):
    """The safetensors header of ``path``: ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...}``."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read_safetensors(path):
    """``{name: array}`` from the file's own header: 8-byte length, JSON, raw little-endian data."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], ST_DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def decode_compressed_tensors(packed, scale, global_scale):
    """The compressed-tensors NVFP4 layout read from its definition, in float32:
    ``e2m1(nibble) * scale * (1 / global_scale)``, element ``2k`` in the low nibble."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = E2M1[codes]
    s = np.repeat(scale.astype(np.float32), 16, axis=1)[:, :vals.shape[1]]
    return (vals * s) * (np.float32(1) / global_scale.astype(np.float32)[0])


def tiny_model(tie=False, keep_first=1):
    return Llama(vocab=SHAPES["vocab"], d_model=SHAPES["d_model"], layers=SHAPES["layers"], heads=SHAPES["heads"],
               kv_heads=SHAPES["kv_heads"], hidden=SHAPES["hidden"], rope_theta=SHAPES["rope_theta"],
               tie_embeddings=tie, init_std=0.08, keep_first=keep_first)


def tiny_params(tie=False, keep_first=1, shared_amax=(), block=nv.array.BLOCK_COLUMN):
    """NVFP4 params of the tiny GQA model, in the training stack's default block (a scale per
    16 inputs: compressed-tensors' own groups); norm scales randomized so they matter."""
    model = tiny_model(tie, keep_first)
    policy = nv.Policy(keep=("embed", "head", "norm", "^blocks_first/"), keep_dtype=jnp.bfloat16,
                       block=block, shared_amax=shared_amax)

    @jax.jit  # one compile, not one per eager op
    def make(key):
        fp32 = model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
        keys = iter(jax.random.split(jax.random.key(1), 64))
        fp32 = jax.tree_util.tree_map_with_path(
            lambda p, x: x * (1 + 0.3 * jax.random.normal(next(keys), x.shape)) if "norm" in nv.params.path_str(p) else x, fp32)
        return nv.quantize_params(fp32, policy)

    return model, make(jax.random.key(0))


def hf_config(tie=False):
    return llama_config(vocab=SHAPES["vocab"], d_model=SHAPES["d_model"], layers=SHAPES["layers"],
                        heads=SHAPES["heads"], kv_heads=SHAPES["kv_heads"], mlp_hidden=SHAPES["hidden"],
                        rope_theta=SHAPES["rope_theta"], tie_embeddings=tie, max_position_embeddings=64)


def layer_leaves(params):
    """``{(layer, path-in-block): leaf of that layer}`` over the scanned segments, in layer order."""
    out, base = {}, 0
    for seg in SEGMENTS:
        if seg not in params:
            continue
        # On the host: sliced on the device, each layer's leaf would compile slicing programs.
        flat = jax.tree_util.tree_flatten_with_path(jax.device_get(params[seg]), is_leaf=nv.array.is_nvfp4)[0]
        n = flat[0][1].shape[0]
        for path, leaf in flat:
            for i in range(n):
                out[(base + i, nv.params.path_str(path))] = jax.tree.map(lambda a: a[i], leaf)
        base += n
    return out


HF_NAME = {"attn/q/kernel": "self_attn.q_proj", "attn/k/kernel": "self_attn.k_proj", "attn/v/kernel": "self_attn.v_proj",
           "attn/out/kernel": "self_attn.o_proj", "mlp/gate/kernel": "mlp.gate_proj", "mlp/up/kernel": "mlp.up_proj",
           "mlp/down/kernel": "mlp.down_proj", "norm1/scale": "input_layernorm",
           "norm2/scale": "post_attention_layernorm"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, params = tiny_params()
    root = tmp_path_factory.mktemp("hf")
    for fmt in ("bf16", "nvfp4"):
        export_hf(params, hf_config(), str(root / fmt), fmt=fmt, names=HF_NAMES)
    export_hf(params, hf_config(), str(root / "modelopt"), fmt="nvfp4", layout="modelopt", names=HF_NAMES)
    return model, params, root


def test_nvfp4_export_decodes_to_dequantize_bit_for_bit(exported):
    _, params, root = exported
    st = read_safetensors(root / "nvfp4" / "model.safetensors")
    cfg = json.loads((root / "nvfp4" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "nvfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 16
    n_nvfp4 = 0
    for (layer, path), leaf in layer_leaves(params).items():
        module = f"model.layers.{layer}.{HF_NAME[path]}"
        if not nv.array.is_nvfp4(leaf):
            # Kept bf16 (norms; layer 0 is blocks_first): plain weights, Linear ones ignored.
            w = st[f"{module}.weight"]
            want = np.asarray(leaf.astype(jnp.bfloat16))
            np.testing.assert_array_equal(w.view(np.uint16), (want.T if path.endswith("kernel") else want).view(np.uint16))
            assert (module in q["ignore"]) == path.endswith("kernel")
            continue
        n_nvfp4 += 1
        n_in, n_out = leaf.shape
        packed, scale, gs = (st[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert packed.dtype == np.uint8 and packed.shape == (n_out, n_in // 2)
        assert scale.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (n_out, n_in // 16)
        assert gs.dtype == np.float32 and gs.shape == (1,)
        assert gs[0] == np.float32(448 * 6) / np.asarray(leaf.amax)
        want = np.asarray(nv.dequantize(leaf, jnp.float32)).T
        got = decode_compressed_tensors(packed, scale, gs)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert f"{module}.weight" not in st
    assert n_nvfp4 == 2 * 7  # layers 1 and 2, seven kernels each
    assert "lm_head" in q["ignore"] and cfg["num_key_value_heads"] == 2 and not cfg["tie_word_embeddings"]


def test_the_same_export_is_the_same_bytes(exported, tmp_path):
    # The safetensors writer orders the header's metadata (format, the amax bits) by a hash map's
    # order, which changes from call to call: the export sorts it, so one model is one file.
    _, params, root = exported
    for k in range(3):
        export_hf(params, hf_config(), str(tmp_path / str(k)), fmt="nvfp4", names=HF_NAMES)
        assert (tmp_path / str(k) / "model.safetensors").read_bytes() == (root / "nvfp4" / "model.safetensors").read_bytes()
    raw = (root / "nvfp4" / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"]) == ["format", AMAX_METADATA]
    # Readable by a server running as another user, like the config beside it (the writer made it 0600).
    modes = {os.stat(root / "nvfp4" / n).st_mode & 0o777 for n in ("model.safetensors", "config.json")}
    assert len(modes) == 1, modes


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def vllm_fused_decode(st, layer):
    """What vLLM (and SGLang) serve from a compressed-tensors NVFP4 checkpoint: q/k/v loaded into
    one qkv_proj and gate/up into one gate_up_proj, each fused module decoded with ONE global
    scale, the maximum of its parts' ``weight_global_scale`` (their codes and block scales as
    written). ``{part: [out, in] float32}``."""
    out = {}
    for parts in FUSED.values():
        names = [f"model.layers.{layer}.{p}" for p in parts]
        gs = np.max([st[f"{m}.weight_global_scale"] for m in names], axis=0)
        for p, m in zip(parts, names):
            out[p] = decode_compressed_tensors(st[f"{m}.weight_packed"], st[f"{m}.weight_scale"], gs)
    return out


@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_engine_decodes_the_export_as_trained_only_with_shared_amax(tmp_path, fused):
    """With the stack's fused amax (``nvfp4.fused_amax``, q/k/v and gate/up sharing one global
    amax per layer) the fused decode equals the trained weights at 0 differing elements in
    every layer; with per-matrix amax (each part its own global scale) it decodes them scaled
    by the ratio of its own global scale to the maximum: most elements wrong."""
    from train.plan import FUSED_AMAX

    _, params = tiny_params(shared_amax=FUSED_AMAX if fused else ())
    export_hf(params, hf_config(), str(tmp_path / "x"), fmt="nvfp4", names=HF_NAMES)
    st = read_safetensors(tmp_path / "x" / "model.safetensors")
    leaves = layer_leaves(params)
    differing = total = 0
    for layer in (1, 2):  # layer 0 is kept in bf16 (blocks_first)
        got = vllm_fused_decode(st, layer)
        for path, name in HF_NAME.items():
            if name in got:
                want = np.asarray(nv.dequantize(leaves[(layer, path)], jnp.float32)).T
                differing += int(np.sum(got[name].view(np.uint32) != want.view(np.uint32)))
                total += want.size
    assert total == 2 * (64 * 64 + 2 * 64 * 32 + 2 * 64 * 96)
    if fused:
        assert differing == 0
    else:  # every part but the one holding the group's largest amax decodes scaled wrong
        assert differing > 0.3 * total, (differing, total)


@pytest.mark.parametrize("block", [nv.BLOCK_2D, nv.array.BLOCK_COLUMN])
def test_either_weight_block_converts_without_requantizing(block):
    # 16x16 tiles: each tile's scale repeated on its 16 output rows; (16, 1) blocks: the
    # groups of 16 inputs themselves. Both decode to the dequantized kernel, transposed.
    x = np.random.default_rng(3).standard_normal((2, 48, 80)).astype(np.float32) * np.linspace(0.1, 4, 80)
    q = nv.quantize(jnp.asarray(x), block=block)
    out = nvfp4_to_compressed_tensors(q)
    assert out["weight_packed"].shape == (2, 80, 24) and out["weight_scale"].shape == (2, 80, 3)
    for i in range(2):
        got = decode_compressed_tensors(out["weight_packed"][i], out["weight_scale"][i], out["weight_global_scale"][i])
        want = np.asarray(nv.dequantize(q, jnp.float32))[i].T
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="groups of 16"):
        nvfp4_to_compressed_tensors(nv.quantize(jnp.asarray(x), block=nv.BLOCK_1D))
    # A matrix marked non-finite (an Inf in its source) converts to a NaN global scale, as its
    # ModelOpt decode scale is: never a plausible weight (it used to be 1.0).
    x[1, 3, 4] = np.inf
    scales = np.asarray(nvfp4_to_compressed_tensors(nv.quantize(jnp.asarray(x), block=block))["weight_global_scale"])
    assert np.isfinite(scales[0]).all() and np.isnan(scales[1]).all()


def test_bf16_export_equals_dequantized_weights(exported):
    _, params, root = exported
    st = read_safetensors(root / "bf16" / "model.safetensors")
    deq = nv.dequantize_params(params, jnp.bfloat16)
    names = {f"model.layers.{layer}.{HF_NAME[path]}.weight": (np.asarray(leaf).T if path.endswith("kernel") else np.asarray(leaf))
             for (layer, path), leaf in layer_leaves(deq).items()}
    names["model.embed_tokens.weight"] = np.asarray(deq["embed"])
    names["model.norm.weight"] = np.asarray(deq["norm_f"]["scale"])
    names["lm_head.weight"] = np.asarray(deq["head"]["kernel"]).T
    assert sorted(st) == sorted(names)
    for k, want in names.items():
        assert st[k].dtype == ml_dtypes.bfloat16, k
        np.testing.assert_array_equal(st[k].view(np.uint16), want.astype(ml_dtypes.bfloat16).view(np.uint16), err_msg=k)
    cfg = json.loads((root / "bf16" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]


def test_tied_head_and_refusals(tmp_path):
    _, params = tiny_params(tie=True, keep_first=0)
    assert "head" not in params
    out = tmp_path / "tied"
    export_hf(params, hf_config(tie=True), str(out), fmt="nvfp4", names=HF_NAMES)
    st = read_safetensors(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert "lm_head.weight" not in st and config["tie_word_embeddings"]
    # The tied head has no weights of its own: quantization formats must not target it (transformers made it an
    # NVFP4 Linear and failed to load, "'Linear' object has no attribute 'weight'").
    assert "lm_head" in config["quantization_config"]["ignore"]
    export_hf(params, hf_config(tie=True), str(tmp_path / "modelopt"), fmt="nvfp4", names=HF_NAMES, layout="modelopt")
    assert "lm_head" in json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())[
        "quantization"]["exclude_modules"]
    if importlib.util.find_spec("compressed_tensors") and importlib.util.find_spec("transformers"):
        import torch
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(params, hf_config(tie=True), str(out), fmt="bf16", names=HF_NAMES)
    with pytest.raises(nv.export.ExportError, match="'blocks/odd/kernel' has no Hugging Face name"):
        export_hf({"blocks": {"odd": {"kernel": jnp.ones((1, 16, 16))}}}, hf_config(), str(tmp_path / "x"),
                  names=HF_NAMES)
    assert not (tmp_path / "x").exists()


def test_cli_refuses_a_non_empty_export_folder(tmp_path, capfd):
    (tmp_path / "keep.txt").write_text("x")
    rc, _, err = main_here(["--export-hf", str(tmp_path), "--out", str(tmp_path / "run")], capfd)
    assert rc == 2
    assert len(err) == 1 and "not empty" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


# ----------------------------------------------------------------------------- ModelOpt NVFP4
ST_NAMES = {"U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16}


def decode_modelopt(weight, scale, scale_2):
    """ModelOpt's NVFP4 Linear read from its definition, in float32: ``e2m1(nibble) *
    weight_scale * weight_scale_2``, element ``2k`` in the low nibble, the first product
    (exact) formed first."""
    codes = np.stack([weight & 0xF, weight >> 4], axis=-1).reshape(weight.shape[0], -1)
    s = np.repeat(scale.astype(np.float32), 16, axis=1)[:, :codes.shape[1]]
    return (E2M1[codes] * s) * np.float32(scale_2)


def ulps(a, b):
    """Distance in float32 ulps, ``-0 == 0``."""
    a, b = (np.asarray(x, np.float32) + np.float32(0) for x in (a, b))
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_modelopt_export_is_the_trained_bits_in_modelopts_layout(exported):
    """Header dtypes and shapes as ModelOpt writes them (weight U8 [out, in/2], weight_scale
    F8_E4M3 [out, in/16], weight_scale_2 F32 scalar), its quantization config files, the global
    decode scale 1 / compressed-tensors' weight_global_scale, and a decode equal to the trained
    weights' dequantization bit for bit."""
    _, params, root = exported
    header = read_header(root / "modelopt" / "model.safetensors")
    meta = json.loads(header.pop("__metadata__")[AMAX_METADATA])
    st = read_safetensors(root / "modelopt" / "model.safetensors")
    ct = read_safetensors(root / "nvfp4" / "model.safetensors")
    hf_quant = json.loads((root / "modelopt" / "hf_quant_config.json").read_text())
    cfg = json.loads((root / "modelopt" / "config.json").read_text())
    ignore = json.loads((root / "nvfp4" / "config.json").read_text())["quantization_config"]["ignore"]
    assert hf_quant == {"producer": {"name": "modelopt", "version": "0.45.0"},
                        "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                         "exclude_modules": ignore}}
    assert cfg["quantization_config"] == {
        "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                      "targets": ["Linear"]}},
        "ignore": ignore, "quant_algo": "W4A16_NVFP4", "producer": hf_quant["producer"], "quant_method": "modelopt"}
    n_nvfp4 = same = 0
    for (layer, path), leaf in layer_leaves(params).items():
        module = f"model.layers.{layer}.{HF_NAME[path]}"
        if not nv.array.is_nvfp4(leaf):
            assert header[f"{module}.weight"]["dtype"] == "BF16" and f"{module}.weight_scale" not in header
            np.testing.assert_array_equal(st[f"{module}.weight"].view(np.uint16),
                                          ct[f"{module}.weight"].view(np.uint16))
            continue
        n_nvfp4 += 1
        n_in, n_out = leaf.shape
        want = {"weight": ("U8", [n_out, n_in // 2]), "weight_scale": ("F8_E4M3", [n_out, n_in // 16]),
                "weight_scale_2": ("F32", [])}
        assert {k: (header[f"{module}.{k}"]["dtype"], header[f"{module}.{k}"]["shape"]) for k in want} == want
        assert f"{module}.weight_packed" not in header and f"{module}.input_scale" not in header
        w, scale, s2 = (st[f"{module}.{k}"] for k in want)
        np.testing.assert_array_equal(w, ct[f"{module}.weight_packed"])
        np.testing.assert_array_equal(scale.view(np.uint8), ct[f"{module}.weight_scale"].view(np.uint8))
        # The decode scale of the trained weights: 1 / weight_global_scale, in float32. ModelOpt's
        # quantizer writes amax / 2688, the same float or one ulp away (for a quarter of amaxes).
        amax = np.asarray(leaf.amax, np.float32)
        assert s2.dtype == np.float32 and s2 == np.float32(1) / ct[f"{module}.weight_global_scale"][0]
        assert ulps(s2, amax / np.float32(2688)) <= 1
        same += int(s2 == amax / np.float32(2688))
        assert meta[f"{module}.weight_scale_2"] == f"{int(leaf.amax_bits):08x}"
        got = decode_modelopt(w, scale, s2)
        deq = np.asarray(nv.dequantize(leaf, jnp.float32)).T
        np.testing.assert_array_equal(got.view(np.uint32), deq.view(np.uint32))
    assert n_nvfp4 == 14 and 0 < same <= 14


@pytest.mark.parametrize("block", [nv.array.BLOCK_COLUMN, nv.BLOCK_2D])
def test_read_modelopt_gives_the_trained_params_back_bit_for_bit(exported, tmp_path, block):
    """read_modelopt: every leaf (NVFP4 codes, scales and amax; bf16 leaves) as exported, in
    the params' structure; 16x16 tiles come back as tiles."""
    if block == nv.array.BLOCK_COLUMN:
        _, params, root = exported
        where = root / "modelopt"
    else:
        _, params = tiny_params(block=block)
        where = tmp_path / "2d"  # in shards: the header's amaxes are per shard
        export_hf(params, hf_config(), str(where), fmt="nvfp4", layout="modelopt", names=HF_NAMES,
                  max_shard_bytes=1 << 14)
        assert (where / "model.safetensors.index.json").exists()
    back, input_amax = read_modelopt(str(where), jax.eval_shape(lambda p: p, params), names=HF_NAMES)
    assert input_amax == {}
    assert jax.tree.structure(back) == jax.tree.structure(params)
    leaves = lambda tree: jax.tree.leaves(tree, is_leaf=nv.array.is_nvfp4)
    for a, b in zip(leaves(params), leaves(back)):
        if nv.array.is_nvfp4(a):
            assert (b.block, b.shape) == (a.block, a.shape)
            for x, y in ((a.data, b.data), (a.scale_bits, b.scale_bits), (a.amax_bits, b.amax_bits)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert b.dtype == a.dtype and b.shape == a.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_calibrated_exports_carry_the_activation_global_scales(tmp_path):
    """With input_amax (W4A4): compressed-tensors' input_global_scale [1] = 448 * 6 / amax under
    the NVFP4 preset's input_activations; ModelOpt's input_scale [] = its reciprocal under
    quant_algo NVFP4; both amaxes exact in the header and read back. A missing one writes nothing."""
    from jax_nvfp4 import numerics as nx
    from jax_nvfp4.export import NVFP4_QUANTIZATION_CONFIG, ExportError

    _, params = tiny_params()
    kernels = {path: leaf for path, leaf in layer_leaves(params).items() if nv.array.is_nvfp4(leaf)}
    paths = sorted({p for _, p in kernels})
    rng = np.random.default_rng(5)
    input_amax = {f"blocks/{p}": (rng.random(2) * 9 + 0.1).astype(np.float32) for p in paths}
    export_hf(params, hf_config(), str(tmp_path / "ct"), fmt="nvfp4", names=HF_NAMES, input_amax=input_amax)
    export_hf(params, hf_config(), str(tmp_path / "mo"), fmt="nvfp4", layout="modelopt", names=HF_NAMES,
              input_amax=input_amax)
    q = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert q == dict(NVFP4_QUANTIZATION_CONFIG, ignore=q["ignore"])
    assert q["config_groups"]["group_0"]["input_activations"] == {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "dynamic": "local", "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn"}
    hf_quant = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] == "NVFP4"
    mo_q = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert mo_q["config_groups"]["group_0"]["input_activations"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                                      "group_size": 16}
    ct_h, mo_h = (read_header(tmp_path / d / "model.safetensors") for d in ("ct", "mo"))
    ct, mo = (read_safetensors(tmp_path / d / "model.safetensors") for d in ("ct", "mo"))
    ct_meta, mo_meta = (json.loads(h["__metadata__"][AMAX_METADATA]) for h in (ct_h, mo_h))
    for layer, path in kernels:
        module, a = f"model.layers.{layer}.{HF_NAME[path]}", input_amax[f"blocks/{path}"][layer - 1]
        entry = lambda h, k: (h[f"{module}.{k}"]["dtype"], h[f"{module}.{k}"]["shape"])
        assert entry(ct_h, "input_global_scale") == ("F32", [1]) and entry(mo_h, "input_scale") == ("F32", [])
        s = np.asarray(nx.global_encode_scale(a), np.float32)
        assert ct[f"{module}.input_global_scale"][0] == s == np.float32(448 * 6) / a
        assert mo[f"{module}.input_scale"] == np.float32(1) / s
        assert ulps(mo[f"{module}.input_scale"], a / np.float32(2688)) <= 1
        bits = f"{int(a.view(np.uint32)):08x}"
        assert ct_meta[f"{module}.input_global_scale"] == mo_meta[f"{module}.input_scale"] == bits
    assert "model.layers.0.self_attn.q_proj.input_scale" not in mo  # kept in bf16
    _, back = read_modelopt(str(tmp_path / "mo"), params, names=HF_NAMES)
    assert sorted(back) == sorted(input_amax)
    for k, v in input_amax.items():
        np.testing.assert_array_equal(back[k].view(np.uint32), v.view(np.uint32))
    with pytest.raises(ExportError, match="no input amax for the NVFP4 kernel 'blocks/attn/k/kernel'"):
        export_hf(params, hf_config(), str(tmp_path / "x"), fmt="nvfp4", names=HF_NAMES,
                  input_amax={k: v for k, v in input_amax.items() if "attn/k/" not in k})
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- the hf extra
def test_transformers_loads_the_bf16_export_and_logits_match(exported, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, params, root = exported
    tokens = np.random.default_rng(0).integers(0, SHAPES["vocab"], (2, 24))
    logits = lambda m, p: np.asarray(jax.jit(m.apply)({"params": nv.dequantize_params(p, jnp.bfloat16)}, jnp.asarray(tokens)))
    ours = logits(model, params)
    results = {}
    for tie in (False, True):
        if tie:
            tmodel, tparams = tiny_params(tie=True, keep_first=0)
            ours_t = logits(tmodel, tparams)
            path = export_hf(tparams, hf_config(tie=True), str(tmp_path / "tied"), fmt="bf16", names=HF_NAMES)
        else:
            ours_t, path = ours, str(root / "bf16")
        hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
        assert hf.config.num_key_value_heads == 2 and hf.config.tie_word_embeddings == tie
        with torch.no_grad():
            theirs = hf(torch.tensor(tokens)).logits.float().numpy()
        diff = np.abs(theirs - ours_t)
        results[tie] = (float(diff.max()), float(np.abs(ours_t).max()))
        print(f"\ntie_embeddings={tie}: max |logit diff| {diff.max():.4g}, mean {diff.mean():.3g}, "
              f"max |logit| {np.abs(ours_t).max():.3g}, argmax agreement {np.mean(theirs.argmax(-1) == ours_t.argmax(-1)):.3f}")
        # bf16 tolerance: a few bf16 ulps of the logits' scale (different GEMM/softmax orders).
        assert diff.max() <= 0.02 * max(1.0, np.abs(ours_t).max()), results[tie]
        assert np.mean(theirs.argmax(-1) == ours_t.argmax(-1)) > 0.95


def test_compressed_tensors_decompresses_the_nvfp4_export_bit_for_bit(exported):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    _, params, root = exported
    qcfg = QuantizationConfig.model_validate(json.loads((root / "nvfp4" / "config.json").read_text())["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    tensors = load_file(str(root / "nvfp4" / "model.safetensors"))
    checked = 0
    for (layer, path), leaf in layer_leaves(params).items():
        if not nv.array.is_nvfp4(leaf):
            continue
        module = f"model.layers.{layer}.{HF_NAME[path]}"
        sd = {k: tensors[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        w = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert w.dtype == torch.bfloat16
        want = np.asarray(nv.dequantize(leaf, jnp.bfloat16)).T
        np.testing.assert_array_equal(w.view(torch.int16).numpy().view(np.uint16), want.view(np.uint16), err_msg=module)
        checked += 1
    assert checked == 14


def test_transformers_loads_the_nvfp4_export_as_the_bf16_weights(exported):
    """transformers + compressed-tensors read DIR/nvfp4 (decompressed on load) into the weights of
    DIR/bf16, bit for bit where the global scale reaches the decompressor as the file's float32
    (then both give the same logits). transformers 4.57 with compressed-tensors 0.20 casts every
    float parameter, ``weight_global_scale`` included, to the model's bf16 before decompressing:
    its weights are then exactly compressed-tensors' decode with the global scale rounded to bf16
    (within a bf16 ulp of the trained values), which this checks instead."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file as load_torch
    _, _, root = exported
    import inspect

    # transformers < 5 names the switch run_compressed (an unknown keyword lands in **kwargs unread)
    names = inspect.signature(transformers.CompressedTensorsConfig.__init__).parameters
    qcfg = transformers.CompressedTensorsConfig(
        **({"run_compressed": False} if "run_compressed" in names else {"dequantize": True}))
    a = transformers.LlamaForCausalLM.from_pretrained(str(root / "bf16"), dtype=torch.bfloat16)
    b = transformers.LlamaForCausalLM.from_pretrained(str(root / "nvfp4"), dtype=torch.bfloat16, quantization_config=qcfg)
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) <= set(sb)
    scheme = QuantizationConfig.model_validate(
        json.loads((root / "nvfp4" / "config.json").read_text())["quantization_config"]).config_groups["group_0"]
    stored = load_torch(str(root / "nvfp4" / "model.safetensors"))
    as_loaded = 0
    for k in sa:
        module = k.removesuffix(".weight")
        held = sb.get(f"{module}.weight_global_scale")
        if held is None or held.dtype == torch.float32:
            assert torch.equal(sa[k], sb[k]), k
            continue
        sd = {t: stored[f"{module}.{t}"] for t in ("weight_packed", "weight_scale", "weight_global_scale")}
        assert torch.equal(NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"], sa[k]), k  # float32 scale
        sd["weight_global_scale"] = sd["weight_global_scale"].to(held.dtype)
        assert torch.equal(NVFP4PackedCompressor.decompress(sd, scheme)["weight"].to(sb[k].dtype), sb[k]), k
        as_loaded += 1
    if as_loaded:
        return  # the weights differ by the global scale's rounding: the logits would too
    tokens = torch.tensor(np.random.default_rng(1).integers(0, SHAPES["vocab"], (2, 16)))
    with torch.no_grad():
        assert torch.equal(a(tokens).logits, b(tokens).logits)


def test_modelopt_reads_the_modelopt_export_as_the_trained_weights(exported):
    """ModelOpt's own NVFP4 dequantization (``NVFP4QTensor.dequantize``: ``e2m1 * (scale *
    scale_2)``, the products associated the other way) gives the trained bf16 weights exactly
    and their float32 values within one ulp; its config conversion of hf_quant_config.json is
    the export's config.json quantization_config."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("modelopt")
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    _, params, root = exported
    st = read_safetensors(root / "modelopt" / "model.safetensors")
    hf_quant = json.loads((root / "modelopt" / "hf_quant_config.json").read_text())
    assert convert_hf_quant_config_format(hf_quant) == json.loads((root / "modelopt" / "config.json").read_text())[
        "quantization_config"]
    checked = differing = 0
    for (layer, path), leaf in layer_leaves(params).items():
        if not nv.array.is_nvfp4(leaf):
            continue
        module = f"model.layers.{layer}.{HF_NAME[path]}"
        w = torch.from_numpy(st[f"{module}.weight"].copy())
        scale = torch.from_numpy(st[f"{module}.weight_scale"].view(np.uint8).copy()).view(torch.float8_e4m3fn)
        s2 = torch.from_numpy(st[f"{module}.weight_scale_2"].copy())
        q = NVFP4QTensor(torch.Size([w.shape[0], 2 * w.shape[1]]), torch.bfloat16, w)
        kw = dict(scale=scale, double_scale=s2, block_sizes={-1: 16})
        want32 = np.asarray(nv.dequantize(leaf, jnp.float32)).T
        got32 = q.dequantize(dtype=torch.float32, **kw).numpy()
        assert ulps(got32, want32).max() <= 1
        differing += int((ulps(got32, want32) > 0).sum())
        got16 = q.dequantize(dtype=torch.bfloat16, **kw).float().numpy()
        want16 = np.asarray(nv.dequantize(leaf, jnp.bfloat16)).T.astype(np.float32)
        np.testing.assert_array_equal(got16 + np.float32(0), want16 + np.float32(0))  # ModelOpt decodes code 8 as +0
        checked += 1
    assert checked == 14
    print(f"\nModelOpt's e2m1 * (scale * scale_2): {differing} float32 values one ulp from (e2m1 * scale) * scale_2")
