"""train.hf_import (``train.init_from``, ``--init-from``): a run started from a Hugging Face Llama
checkpoint.

The round trips read back the job's own exports (the job's trained NVFP4 params, :func:`conftest.job_run`):
the NVFP4 export gives the stored params bit for bit, the bf16 export with bf16 weights too,
on the mesh they were trained on and on others. The external writers (``hf`` extra: torch,
transformers, compressed-tensors; skipped without it): a ``LlamaForCausalLM`` trained with
torch on real text, and a compressed-tensors NVFP4 checkpoint made by its own compressor.
"""

import dataclasses
import json
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4.export import export_hf
from train import hf_import
from train.model import HF_NAMES
from train.programs import build
from train.step import validation_loss

from conftest import JOB, TINY, job, job_worker, main_here, mesh_of, sets

# The job's fixture and programs live on the job's worker.
pytestmark = job_worker


def host_logical(tree):
    """The logical view of a stored tree, relaid out on the host (no device programs)."""
    return nv.sharding.logical(jax.device_get(tree))


def host_leaves(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def assert_bits_equal(a, b):
    la, lb = host_leaves(a), host_leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.fixture(scope="module")
def exports(job_run, tmp_path_factory):
    """The job's trained params exported: ``nvfp4`` in several safetensors shards (with the
    index), ``bf16`` in one file."""
    root = tmp_path_factory.mktemp("hf-import")
    cfg = job()
    export_hf(job_run["params"], hf_import.hf_config(cfg), str(root / "nvfp4"), fmt="nvfp4", names=HF_NAMES,
              max_shard_bytes=40_000)
    export_hf(job_run["params"], hf_import.hf_config(cfg), str(root / "bf16"), fmt="bf16", names=HF_NAMES)
    return root


def test_nvfp4_export_reads_back_bit_identical(job_run, exports):
    assert os.path.isfile(exports / "nvfp4" / "model.safetensors.index.json")
    assert len({v for v in json.loads((exports / "nvfp4" / "model.safetensors.index.json").read_text())
                ["weight_map"].values()}) > 3
    cfg = job()
    trainer, _, _ = build(cfg, mesh_of(cfg, 8), init=False)
    params, opt_state = hf_import.load(str(exports / "nvfp4"), trainer)
    assert_bits_equal(params, job_run["params"])
    # The masters are the dequantized NVFP4 weights (and the bf16 leaves' values); the
    # optimizer starts fresh.
    mw = nv.find_state(opt_state)
    for p, m in zip(jax.tree.leaves(params, is_leaf=nv.layout.is_tiled), jax.tree.leaves(mw.master, is_leaf=nv.layout.is_tiled)):
        want = p.dequantize_tiles(jnp.float32) if isinstance(p, nv.TiledNVFP4) else (
            p.value.astype(jnp.float32) if isinstance(p, nv.Tiled) else p.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(m.value if isinstance(m, nv.Tiled) else m), np.asarray(want))
    assert int(mw.skipped) == 0
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(mw.inner_state)
               if hasattr(x, "dtype") and x.dtype == jnp.float32 and x.ndim >= 4)


def test_bf16_export_reads_back_with_bf16_weights(job_run, exports, tmp_path):
    cfg = job("nvfp4.weights=bf16")
    trainer, _, _ = build(cfg, mesh_of(cfg, 8), init=False)
    params, _ = hf_import.load(str(exports / "bf16"), trainer)
    # The bf16 export holds the dequantized NVFP4 weights: bf16 params of exactly those values.
    want = nv.dequantize_params(host_logical(job_run["params"]), jnp.bfloat16)
    assert_bits_equal(host_logical(params), want)
    # A bf16-weights state, exported and read back: bit-identical.
    export_hf(params, hf_import.hf_config(cfg), str(tmp_path / "again"), fmt="bf16", names=HF_NAMES)
    again, _ = hf_import.load(str(tmp_path / "again"), trainer)
    assert_bits_equal(again, params)


def test_2d_tiles_read_back_when_the_scales_repeat_over_each_tile(exports, tmp_path):
    # The 2d export repeats each tile's scale on its 16 rows: read with 2d tiles, bit-identical;
    # with 1d blocks, the same values. A 1d checkpoint's scales differ inside tiles: refused.
    cfg = job("nvfp4.block=2d")
    trainer, params, _ = build(cfg, mesh_of(cfg, 8))
    export_hf(params, hf_import.hf_config(cfg), str(tmp_path / "2d"), fmt="nvfp4", names=HF_NAMES)
    again, _ = hf_import.load(str(tmp_path / "2d"), trainer)
    assert_bits_equal(again, params)
    one_d, _ = build(job(), mesh_of(cfg, 8), init=False)[:2]
    as_1d, _ = hf_import.load(str(tmp_path / "2d"), one_d)
    assert_bits_equal(nv.dequantize_params(host_logical(as_1d)), nv.dequantize_params(host_logical(params)))
    with pytest.raises(hf_import.ConfigError, match="nvfp4.block=2d: model.layers.0."):
        hf_import.load(str(exports / "nvfp4"), trainer)


@pytest.mark.parametrize("devices, overrides", [(6, ()), (8, ("mesh.tensor=2",))])
def test_import_onto_another_mesh(job_run, exports, devices, overrides):
    # Other tile paddings (6 data shards) and tensor splits: each device reads its own tiles.
    cfg = job(*overrides)
    trainer, _, _ = build(cfg, mesh_of(cfg, devices), init=False)
    params, _ = hf_import.load(str(exports / "nvfp4"), trainer)
    assert_bits_equal(host_logical(params), host_logical(job_run["params"]))


def test_each_process_reads_only_its_slices(exports):
    """4 processes of 2 devices each (the job's 8 devices, split as a launch would): each
    plans to read its own tiles of every sharded tensor and nothing else; no byte of a
    sharded tensor is read by two processes; a single process reads what the plan says."""
    cfg = job()
    mesh = mesh_of(cfg, 8)
    trainer, _, _ = build(cfg, mesh, init=False)
    directory = str(exports / "nvfp4")
    ckpt = hf_import.Checkpoint(directory)
    devices = list(mesh.devices.flat)
    procs = [devices[2 * i:2 * i + 2] for i in range(4)]
    plans = [hf_import.plan(directory, trainer, devs) for devs in procs]
    # What each process reads (each distinct slice once: devices sharing a block share a read).
    reads = [{(r.tensor, tuple((s.start, s.stop) for s in r.index)): r.nbytes for rs in p.values() for r in rs}
             for p in plans]
    replicated = {"norm", "global_scale"}
    sharded = lambda name: not any(k in name for k in replicated)
    per_proc = [sum(b for (t, _), b in rd.items() if sharded(t)) for rd in reads]
    total = sum(np.prod(ckpt.shape(t)) * (2 if ckpt.dtype(t) == "BF16" else 1) for t in ckpt.entries if sharded(t))
    # Every byte of every sharded tensor read once, by one process.
    assert sum(per_proc) == total, (per_proc, total)
    # ... a quarter each, less where a process holds the tile list's zero padding.
    assert max(per_proc) <= 0.3 * total and min(per_proc) >= 0.15 * total, (per_proc, total)
    # Replicated leaves (norm scales, global scales): read once per process, whole.
    for rd in reads:
        assert sum(b for (t, _), b in rd.items() if not sharded(t)) == sum(
            np.prod(ckpt.shape(t)) * (2 if ckpt.dtype(t) == "BF16" else 4) for t in ckpt.entries if not sharded(t))
    # A real import reads exactly the union of its devices' plans.
    ckpt = hf_import.Checkpoint(directory)
    hf_import.load(directory, trainer, checkpoint=ckpt)
    got = {(r.tensor, tuple((s.start, s.stop) for s in r.index)) for r in ckpt.reads}
    assert got == set().union(*(set(rd) for rd in reads))
    assert len(ckpt.reads) == len(got)  # nothing read twice


def test_an_8b_import_is_planned_without_reading_or_allocating(tmp_path):
    """Llama 3 8B's shapes (GQA, 128256 vocab: 16 GB of bf16) in a checkpoint whose data is a
    sparse file: the plan of 4 processes of 2 devices each, from the headers and the abstract
    state alone, gives each a quarter of the bytes; nothing is read, nothing model-sized is
    allocated."""
    import struct
    import tracemalloc

    from jax_nvfp4.export import hf_modules, is_linear

    cfg = job("model.d_model=4096", "model.layers=32", "model.heads=32", "model.kv_heads=8", "model.mlp_hidden=14336",
              "model.vocab=128256", "model.rope_theta=500000.0")
    mesh = mesh_of(cfg, 8)
    trainer, _, _ = build(cfg, mesh, init=False)
    header, end = {}, 0
    for path, leaf, modules in hf_modules(trainer.abstract_params, HF_NAMES):  # the export's own map
        for module, idx in modules:
            shape = list(leaf.shape[len(idx):])
            shape = shape[::-1] if is_linear(path) else shape
            n = 2 * int(np.prod(shape))
            header[f"{module}.weight"] = {"dtype": "BF16", "shape": shape, "data_offsets": [end, end + n]}
            end += n
    raw = json.dumps(header).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + end)  # sparse: no data on disk
    (tmp_path / "config.json").write_text(json.dumps(hf_import.hf_config(cfg)))
    assert end > 16e9
    devices = list(mesh.devices.flat)
    tracemalloc.start()
    try:
        shares = []
        for i in range(4):
            plan = hf_import.plan(str(tmp_path), trainer, devices[2 * i:2 * i + 2])
            distinct = {(r.tensor, tuple((s.start, s.stop) for s in r.index)): r.nbytes for rs in plan.values() for r in rs}
            shares.append(sum(distinct.values()) / end)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # A quarter each, plus the replicated norm scales (0.003% of the model).
    assert all(0.25 <= s < 0.2501 for s in shares), shares
    assert peak < 50e6, peak


def test_amax_from_global_scale():
    from jax_nvfp4 import numerics as nx

    rng = np.random.default_rng(0)
    amax = (rng.random(4000) * 10 + 1e-3).astype(np.float32)
    s = np.asarray(nx.global_encode_scale(jnp.asarray(amax)))
    derived = np.array([hf_import.amax_from_global_scale(x) for x in s], np.float32)
    # Always a scale-preserving amax (so the dequantized values are the checkpoint's) ...
    np.testing.assert_array_equal(np.asarray(nx.global_encode_scale(jnp.asarray(derived))), s)
    # ... but not always the amax itself: neighbouring amaxes share a global scale, which is why
    # the export records it.
    assert 0 < np.mean(derived != amax) < 0.5
    assert hf_import.amax_from_global_scale(np.finfo(np.float32).max) == 0


def test_cli_init_from(exports, tmp_path, capfd):
    """--init-from: the imported model's validation loss at step 0 is the exporting run's
    final one (same params, same evaluation); the checkpoint's tokenizer travels into the new
    run's export; a config that contradicts config.json is one line naming the key."""
    base = [*sets(JOB), "--set", "train.eval_every=6", "--set", "train.eval_batches=2"]
    rc, _, err = main_here([*base, "--export-hf", str(tmp_path / "a-hf"), "--out", str(tmp_path / "a")], capfd)
    assert rc == 0, err
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "a-hf" / "nvfp4" / "tokenizer.json").write_text('{"model": "stand-in"}')
    # The model keys come from config.json (tiny.yaml's are replaced); d_model given here agrees.
    rc, out, err = main_here(["--set", "train.steps=1", "--set", "train.eval_every=1", "--set", "train.eval_batches=2",
                              "--set", "data.batch_size=24", "--set", "model.seq_len=32", "--set", "model.d_model=96",
                              "--set", "optim.clip_norm=0",
                              "--init-from", str(tmp_path / "a-hf" / "nvfp4"), "--export-hf", str(tmp_path / "b-hf"),
                              "--out", str(tmp_path / "b")], capfd)
    assert rc == 0, err
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert b[0] == {"step": 0, "val_loss": a[-1]["val_loss"]}
    assert "step 0 (imported from" in out
    assert (tmp_path / "b-hf" / "nvfp4" / "tokenizer.json").read_text() == '{"model": "stand-in"}'
    # A contradiction, and a folder that is not a checkpoint: one line, exit 2, nothing run.
    for args, want in ((["--set", "model.kv_heads=1"], "model.kv_heads=1"), ([], "no config.json")):
        where = str(tmp_path / "a-hf" / "nvfp4") if args else str(tmp_path)
        rc, _, err = main_here([*args, "--init-from", where, "--out", str(tmp_path / "c")], capfd)
        assert rc == 2 and len(err) == 1 and want in err[0], err


# ----------------------------------------------------------------------------- external writers (hf extra)
def _stdlib_tokens(tmp_path, n_files=12, vocab=512):
    """A few stdlib modules tokenized by ``train.prepare`` (a BPE trained on them)."""
    from train.prepare import prepare

    src = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(src) if f.endswith(".py"))[:n_files]
    out = str(tmp_path / "stdlib.bin")
    prepare([os.path.join(src, f) for f in files], out, vocab_size=vocab)
    return out


def import_config(path, *overrides):
    """tiny.yaml with ``overrides``, starting from the checkpoint ``path``: its config.json
    sets the model keys."""
    from train.config import load_config

    cfg = load_config(TINY, overrides)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=path))
    return hf_import.resolve_config(cfg, given=set())


def test_transformers_checkpoint_imports_to_its_own_loss(tmp_path):
    """A LlamaForCausalLM (GQA) trained by torch on real text and saved by save_pretrained:
    imported with bf16 weights, its step-0 validation loss is transformers' on the same
    windows, within 1% (bf16 against torch's float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from train import data as data_lib

    data = _stdlib_tokens(tmp_path)
    tokens = np.memmap(data, dtype=np.uint16, mode="r")
    # One thread: torch's small ops spin on the shared cores otherwise (7x slower here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0))
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    train_end = int(len(tokens) * 0.8)
    try:
        for _ in range(100):
            starts = rng.integers(0, train_end - 33, 16)
            batch = torch.tensor(np.stack([tokens[s:s + 33] for s in starts]).astype(np.int64))
            loss = hf(input_ids=batch, labels=batch).loss  # transformers shifts the labels itself
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    hf.save_pretrained(str(tmp_path / "hf"))

    cfg = import_config(str(tmp_path / "hf"), "data.source=tokens", f"data.path={data}", "data.val_fraction=0.2",
                        "train.eval_every=1", "train.eval_batches=2", "data.batch_size=8", "model.seq_len=32",
                        "mesh.data=1", "nvfp4.weights=bf16")
    assert (cfg.model.vocab, cfg.model.n_kv_heads, cfg.model.mlp_hidden) == (512, 2, 128)
    trainer, _, _ = build(cfg, mesh_of(cfg, 1), init=False)
    params, _ = hf_import.load(cfg.train.init_from, trainer)
    val = data_lib.eval_batches(cfg, data_lib.make_source(cfg.data, cfg.model, split="val"))
    ours = validation_loss(trainer.eval_fn, params, val)
    with torch.no_grad():
        rows = torch.tensor(np.concatenate(val).astype(np.int64))
        logits = hf(input_ids=rows[:, :-1]).logits
        theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)))
    print(f"\nstep-0 validation loss: imported {ours:.4f}, transformers {theirs:.4f}")
    assert theirs < 5.5  # trained: well below ln(512) = 6.24
    assert abs(ours - theirs) <= 0.01 * theirs


def test_compressed_tensors_checkpoint_imports_losslessly(tmp_path):
    """A compressed-tensors NVFP4A16 checkpoint written by its own compressor: the NVFP4
    weights import as its codes and scales, and dequantize to what its decompressor gives, bit
    for bit (masters: the same values in float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file

    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():  # weights of several scales, as trained ones have
        for p in hf.parameters():
            p.mul_(torch.exp(torch.randn(p.shape[0], 1) if p.ndim == 2 else torch.zeros(())))
    qcfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(hf, qcfg)
    for module in hf.modules():  # calibration: the observer's min/max, the library's own formulas
        if hasattr(module, "weight_global_scale"):
            w = module.weight.data
            gs = generate_gparam(w.min(), w.max())
            groups = w.reshape(w.shape[0], -1, 16)
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), module.quantization_scheme.weights, global_scale=gs)
            module.weight_global_scale.data.copy_(gs)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(hf, "nvfp4-pack-quantized")
    compressor.compress_model(hf)
    hf.save_pretrained(str(tmp_path / "ct"))
    compressor.update_config(str(tmp_path / "ct"))

    cfg = import_config(str(tmp_path / "ct"), "mesh.data=2", "data.batch_size=2", "nvfp4.block=1d")
    trainer, _, _ = build(cfg, mesh_of(cfg, 2), init=False)
    params, opt_state = hf_import.load(cfg.train.init_from, trainer)
    logical = host_logical(params)
    masters = host_logical(nv.find_state(opt_state).master)
    tensors = load_file(str(tmp_path / "ct" / "model.safetensors"))
    scheme = QuantizationConfig.model_validate(
        json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]).config_groups["group_0"]
    names = {"attn/q": "self_attn.q_proj", "attn/k": "self_attn.k_proj", "attn/v": "self_attn.v_proj",
             "attn/out": "self_attn.o_proj", "mlp/gate": "mlp.gate_proj", "mlp/up": "mlp.up_proj", "mlp/down": "mlp.down_proj"}
    for ours, theirs in names.items():
        a, b = ours.split("/")
        q, m = logical["blocks"][a][b]["kernel"], masters["blocks"][a][b]["kernel"]
        for layer in range(2):
            module = f"model.layers.{layer}.{theirs}"
            sd = {k: tensors[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            ql = jax.tree.map(lambda x: x[layer], q)
            # Lossless: the same code and scale bytes (transposed into the [in, out] kernel).
            t = nv.array.transpose(ql)
            np.testing.assert_array_equal(np.asarray(t.data), sd["weight_packed"].numpy())
            np.testing.assert_array_equal(np.asarray(t.scale_bits), sd["weight_scale"].view(torch.uint8).numpy())
            w = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
            np.testing.assert_array_equal(np.asarray(nv.dequantize(ql, jnp.bfloat16)).T.view(np.uint16),
                                          w.view(torch.int16).numpy().view(np.uint16), err_msg=module)
            np.testing.assert_array_equal(m[layer], np.asarray(nv.dequantize(ql, jnp.float32)))
