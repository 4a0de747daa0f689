"""train.hf_import (``train.init_from``, ``--init-from``): a run started from a Hugging Face Llama
checkpoint.

The round trips read back the job's own exports (the job's trained NVFP4 params, :func:`conftest.job_run`):
the NVFP4 export gives the stored params bit for bit, the bf16 export with bf16 weights too,
on the mesh they were trained on and on others. The external writers (``hf`` extra: torch,
transformers, compressed-tensors; skipped without it): a ``LlamaForCausalLM`` trained with
torch on real text, a compressed-tensors NVFP4 checkpoint made by its own compressor, and a
``LlamaForCausalLM`` with Llama 3.x rope scaling. The refusals run the CLI on copies of the job's
untrained exports, altered: exit 2, one line, nothing compiled.
"""

import dataclasses
import json
import os
import re
import shutil
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4.export import Safetensors, amax_from_global_scale, export_hf
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
        np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


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
    # --export-hf of a bf16-weights run writes DIR/bf16 alone (no NVFP4 checkpoint of nothing NVFP4).
    from train.__main__ import export_hf as cli_export_hf

    cli_export_hf(cfg, params, str(tmp_path / "cli"))
    assert os.listdir(tmp_path / "cli") == ["bf16"]


def test_bf16_weights_imported_into_nvfp4_share_the_fused_amax(exports):
    """A bf16 checkpoint quantized at import takes nvfp4.fused_amax as every re-quantization
    does: q/k/v of each layer (and gate/up) share one amax, the maximum of theirs."""
    trainer, _, _ = build(job(), mesh_of(job(), 8), init=False)
    params, opt_state = hf_import.load(str(exports / "bf16"), trainer)
    blocks = host_logical(params)["blocks"]
    masters = host_logical(nv.find_state(opt_state).master)["blocks"]
    for sec, group in (("attn", ("q", "k", "v")), ("mlp", ("gate", "up"))):
        want = np.max([np.abs(np.asarray(masters[sec][n]["kernel"])).max(axis=(-2, -1)) for n in group], axis=0)
        for n in group:
            np.testing.assert_array_equal(np.asarray(blocks[sec][n]["kernel"].amax), want)


@pytest.mark.slow
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
    ckpt = Safetensors(directory)
    devices = list(mesh.devices.flat)
    procs = [devices[2 * i:2 * i + 2] for i in range(4)]
    plans = [hf_import.plan(directory, trainer, devs) for devs in procs]
    # What each process reads (each distinct slice once: devices sharing a block share a read).
    reads = [{(r.tensor, tuple((s.start, s.stop) for s in r.index)): r.nbytes for rs in p.values() for r in rs}
             for p in plans]
    replicated = {"norm", "global_scale"}
    sharded = lambda name: not any(k in name for k in replicated)
    per_proc = [sum(b for (t, _), b in rd.items() if sharded(t)) for rd in reads]
    size = lambda t, other: np.prod(ckpt.entries[t].shape) * (2 if ckpt.entries[t].dtype == "BF16" else other)
    total = sum(size(t, 1) for t in ckpt.entries if sharded(t))
    # Every byte of every sharded tensor read once, by one process.
    assert sum(per_proc) == total, (per_proc, total)
    # ... a quarter each, less where a process holds the tile list's zero padding.
    assert max(per_proc) <= 0.3 * total and min(per_proc) >= 0.15 * total, (per_proc, total)
    # Replicated leaves (norm scales, global scales): read once per process, whole.
    for rd in reads:
        assert sum(b for (t, _), b in rd.items() if not sharded(t)) == sum(
            size(t, 4) for t in ckpt.entries if not sharded(t))
    # A real import reads exactly the union of its devices' plans.
    ckpt = Safetensors(directory)
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
    derived = np.array([amax_from_global_scale(x) for x in s], np.float32)
    # Always a scale-preserving amax (so the dequantized values are the checkpoint's) ...
    np.testing.assert_array_equal(np.asarray(nx.global_encode_scale(jnp.asarray(derived))), s)
    # ... but not always the amax itself: neighbouring amaxes share a global scale, which is why
    # the export records it.
    assert 0 < np.mean(derived != amax) < 0.5
    assert amax_from_global_scale(np.finfo(np.float32).max) == 0


@pytest.mark.slow
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
                              "--set", "optim.clip_norm=0", "--set", "optim.warmup_steps=0",
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


def test_the_checkpoints_model_is_what_the_rules_across_sections_see(tmp_path):
    """``--init-from``'s config.json replaces tiny.yaml's model before the config is checked:
    keeping 3 of the checkpoint's 4 blocks in bf16, or 300 Markov states under its vocabulary of
    1000, is accepted (tiny.yaml's 2 layers and 256 tokens would refuse both). A field of its
    rotary scaling set alike is accepted, set otherwise refused; so is a model key it contradicts."""
    from train.config import ConfigError, load_config

    source = load_config(None, ["model.layers=4", "model.vocab=1000",
                                "model.rope_scaling={factor: 8, original_max_position_embeddings: 16}"])
    (tmp_path / "config.json").write_text(json.dumps(hf_import.hf_config(source)))
    rules = ["nvfp4.keep_first_blocks=1", "nvfp4.keep_last_blocks=2", "data.markov_states=300"]
    with pytest.raises(ConfigError, match="exceeds model.layers=2"):
        load_config(TINY, rules)  # the rule itself, on tiny.yaml's model
    for init in ((str(tmp_path),), ()):  # --init-from, or train.init_from in the overrides
        extra = [] if init else [f"train.init_from={tmp_path}"]
        cfg = hf_import.load_config(TINY, [*rules, *extra, "model.rope_scaling.factor=8"], *init)
        assert (cfg.model.layers, cfg.model.vocab, cfg.nvfp4.keep_last_blocks) == (4, 1000, 2)
        assert cfg.model.rope_scaling == source.model.rope_scaling and cfg.train.init_from == str(tmp_path)
    with pytest.raises(ConfigError, match=r"model.rope_scaling.factor=4: .* has rope_scaling.factor=8.0"):
        hf_import.load_config(TINY, ["model.rope_scaling.factor=4"], str(tmp_path))
    with pytest.raises(ConfigError, match="model.layers=2: .* has num_hidden_layers=4"):
        hf_import.load_config(TINY, ["model.layers=2"], str(tmp_path))
    # A contradiction is named before the rules it breaks; 0 key/value heads is the checkpoint's count.
    with pytest.raises(ConfigError, match="model.heads=1: .* has num_attention_heads=2"):
        hf_import.load_config(TINY, ["model.heads=1"], str(tmp_path))
    assert hf_import.load_config(TINY, ["model.kv_heads=0"], str(tmp_path)).model.kv_heads == 2
    # The file's own model keys are still checked, though the checkpoint's replace them.
    (tmp_path / "bad.yaml").write_text("model:\n  layers: abc\n")
    with pytest.raises(ConfigError, match="model.layers: expected int, got str 'abc'"):
        hf_import.load_config(str(tmp_path / "bad.yaml"), [], str(tmp_path))
    # Where a run writes needs no checkpoint: train.runs reads the train section alone.
    from train import runs
    assert runs.metrics_path(["--config", TINY, "--init-from", str(tmp_path / "gone"), "--set",
                              "train.out_dir=r1"]) == os.path.join("r1", "metrics.jsonl")


def test_a_token_file_of_another_tokenizer_than_the_checkpoints_is_refused(tmp_path):
    """Training an imported checkpoint on a token file: the file's tokenizer (recorded by
    train.prepare) must be the checkpoint's tokenizer.json, which the export ships with its
    chat template; another is refused, naming the fix."""
    from train.config import ConfigError, load_config

    ours = _stdlib_tokens(tmp_path / "a", n_files=2, vocab=300)
    other = _stdlib_tokens(tmp_path / "b", n_files=3, vocab=320)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(hf_import.hf_config(load_config(None, ["model.vocab=512"]))))
    (ck / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    shutil.copy(ours + ".tokenizer.json", ck / "tokenizer.json")
    tokens = lambda path: hf_import.load_config(TINY, ["data.source=tokens", f"data.path={path}"], str(ck))
    hf_import.check_tokens(tokens(ours))
    with pytest.raises(ConfigError, match=r"made with another tokenizer .* train.prepare --tokenizer"):
        hf_import.check_tokens(tokens(other))
    # An older sidecar without the sha256: the tokenizer file beside it is compared; without one, refused.
    sidecar = json.loads(open(other + ".json").read())
    del sidecar["tokenizer_sha256"]
    open(other + ".json", "w").write(json.dumps(sidecar))
    with pytest.raises(ConfigError, match=r"made with another tokenizer"):
        hf_import.check_tokens(tokens(other))
    os.remove(other + ".tokenizer.json")
    with pytest.raises(ConfigError, match=r"its sidecar names no tokenizer"):
        hf_import.check_tokens(tokens(other))
    assert set(hf_import.tokenizer_files(str(ck), 64)) == {"tokenizer.json", "chat_template.jinja",
                                                           "tokenizer_config.json"}
    # A checkpoint whose tokenizer is a tokenizer.model alone: nothing to check the ids against.
    os.rename(ck / "tokenizer.json", ck / "tokenizer.model")
    with pytest.raises(ConfigError, match=r"a tokenizer.model but no tokenizer.json"):
        hf_import.check_tokens(tokens(ours))


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


# ----------------------------------------------------------------------------- rope scaling
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def test_rope_scaling_from_either_spelling(tmp_path):
    """Llama 3.x's rotary scaling from transformers 4's rope_scaling or transformers 5's
    rope_parameters (which carries rope_theta too); the export writes rope_scaling, read back
    as the same model; other rope types are one line."""
    from train.config import RopeScaling

    cfg = job("model.rope_theta=500000.0", "model.rope_scaling={factor: 8, original_max_position_embeddings: 8192}")
    hf = hf_import.hf_config(cfg)
    assert hf["rope_scaling"] == LLAMA3_SCALING and hf["rope_theta"] == 500000.0
    values, _ = hf_import.model_values(hf)
    assert values["rope_scaling"] == RopeScaling() == cfg.model.rope_scaling and values["rope_theta"] == 500000.0
    v5 = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(LLAMA3_SCALING, rope_theta=500000.0)
    assert hf_import.model_values(v5)[0] == values
    v4 = dict(hf, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}})
    assert hf_import.model_values(v4)[0] == values
    plain = dict(v5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert hf_import.model_values(plain)[0]["rope_scaling"] is None
    assert hf_import.model_values(plain)[0]["rope_theta"] == 10000.0
    for name, bad, want in (("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn'"),
                            ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters.rope_type="),
                            ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "has no low_freq_factor")):
        with pytest.raises(hf_import.ConfigError, match=re.escape(want)) as e:
            hf_import.model_values(dict(hf, **{name: bad}))
        assert "\n" not in str(e.value)
    # A config that contradicts config.json's scaling: one line naming the key.
    (tmp_path / "config.json").write_text(json.dumps(hf))
    base = job()
    plain_cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, init_from=str(tmp_path)))
    with pytest.raises(hf_import.ConfigError, match=r"^model.rope_scaling=None: train.init_from=.* has rope_scaling="):
        hf_import.resolve_config(plain_cfg, given={"model.rope_scaling"})
    assert hf_import.resolve_config(plain_cfg, given=set()).model.rope_scaling == RopeScaling()


def test_config_values_transformers_would_not_build_are_refused_and_its_aliases_read():
    """config.json values of the wrong type or range are one line naming the key (a zero count of
    key/value heads was read as multi-head attention, layers=true as 1, tie_word_embeddings
    "false" as tied); swish is transformers' other name of silu."""
    hf = hf_import.hf_config(job())
    assert hf_import.model_values(dict(hf, hidden_act="swish"))[0] == hf_import.model_values(hf)[0]
    for key, bad in (("num_key_value_heads", 0), ("num_hidden_layers", True), ("hidden_size", -64),
                     ("tie_word_embeddings", "false"), ("rms_norm_eps", "1e-5"), ("hidden_act", "gelu")):
        with pytest.raises(hf_import.ConfigError, match=rf"config.json {key}={re.escape(repr(bad))}: ") as e:
            hf_import.model_values(dict(hf, **{key: bad}))
        assert "\n" not in str(e.value)


def test_llama3_rope_scaling_imports_to_transformers_loss(tmp_path):
    """transformers' LlamaForCausalLM with Llama 3.x rope scaling (original_max_position_embeddings
    256, so that the scaled wavelengths matter on a sequence of 2304 positions), imported with
    --init-from's load: its loss equals transformers' within 1e-5 nats, both in float32 activations;
    the same model without the scaling is far off."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from train.config import RopeScaling
    from train.model import cross_entropy, from_config

    scaling = dict(LLAMA3_SCALING, original_max_position_embeddings=256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=scaling))
    with torch.no_grad():  # sharp attention, so that the positions matter
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    hf.save_pretrained(str(tmp_path / "hf"))
    rows = torch.tensor(np.random.default_rng(0).integers(0, 128, (1, 2305)))
    try:
        with torch.no_grad():
            logits = hf(input_ids=rows[:, :-1]).logits
            theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 128), rows[:, 1:].reshape(-1)))
            logits = logits.numpy()
    finally:
        torch.set_num_threads(threads)

    cfg = import_config(str(tmp_path / "hf"), "model.seq_len=2304", "data.batch_size=1", "mesh.data=1",
                        "nvfp4.weights=bf16")
    assert cfg.model.rope_scaling == RopeScaling(**scaling)
    trainer, _, _ = build(cfg, mesh_of(cfg, 1), init=False)
    _, opt_state = hf_import.load(cfg.train.init_from, trainer)
    masters = host_logical(nv.find_state(opt_state).master)  # the checkpoint's float32 values
    tokens = jnp.asarray(rows.numpy(), jnp.int32)

    def run(model):
        out = jax.jit(lambda p: model.apply({"params": p}, tokens[:, :-1]))(masters)
        return float(cross_entropy(out, tokens[:, 1:])), float(np.max(np.abs(np.asarray(out) - logits)))

    model = from_config(cfg.model, cfg.nvfp4).clone(dtype=jnp.float32)
    (ours, err), (unscaled, err_unscaled) = run(model), run(model.clone(rope_scaling=None))
    print(f"\nllama3 rope scaling, 2304 positions, float32: loss imported {ours:.7f}, transformers {theirs:.7f} "
          f"(difference {abs(ours - theirs):.1e}, logits within {err:.1e}); without the scaling: loss {unscaled:.7f}, "
          f"logits within {err_unscaled:.1e}")
    assert abs(ours - theirs) <= 1e-5
    assert err_unscaled > 100 * err and abs(unscaled - theirs) > 10 * abs(ours - theirs)


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The job's model at initialization (untrained), exported: ``bf16`` and ``nvfp4``."""
    root = tmp_path_factory.mktemp("hf-fresh")
    cfg = job()
    _, params, _ = build(cfg, mesh_of(cfg, 8))
    for fmt in ("bf16", "nvfp4"):
        export_hf(params, hf_import.hf_config(cfg), str(root / fmt), fmt=fmt, names=HF_NAMES)
    return root


def variant(fresh, tmp_path, fmt="bf16", config=None, tensors=None):
    """A copy of ``fresh``'s ``fmt`` export with ``config`` merged into its config.json and its
    tensors (bf16: one file) replaced by ``tensors(dict of them)``."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / f"{fmt}-variant"
    shutil.copytree(fresh / fmt, folder)
    if config:
        hf = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf, **config}))
    if tensors:
        path = str(folder / "model.safetensors")
        save_file(tensors(load_file(path)), path)
    return folder


def poke(folder, tensor, index, raw: bytes):
    """Overwrite the element ``index`` of ``tensor`` in the folder's safetensors file with ``raw``."""
    ckpt = Safetensors(str(folder))
    e = ckpt.entries[tensor]
    size = len(raw)
    with open(folder / e.file, "r+b") as f:
        f.seek(e.offset + size * int(np.ravel_multi_index(index, e.shape)))
        f.write(raw)


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def refusal(folder, capfd, *args):
    """``--init-from folder`` of the job: exit status 2, one line on stderr (returned) and no XLA
    compilation (jax.monitoring's backend-compile events) before it."""
    from jax import monitoring

    compiled = []
    listener = lambda event, *a, **kw: compiled.append(kw.get("fun_name")) if event == BACKEND_COMPILE else None
    monitoring.register_event_duration_secs_listener(listener)
    try:
        rc, _, err = main_here([*sets(JOB), *args, "--init-from", str(folder), "--out", f"{folder}-run"], capfd)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert rc == 2 and len(err) == 1 and not compiled, (rc, err, compiled)
    assert not os.path.exists(f"{folder}-run/metrics.jsonl")
    return err[0]


def test_refused_a_tied_config_over_a_head_of_its_own(fresh, tmp_path, capfd):
    """tie_word_embeddings over a checkpoint with its own, different lm_head.weight: refused; an
    lm_head.weight equal to the embedding (some writers store both) is read as the tied head.
    A non-zero attention_dropout is ignored with one notice (this model has no dropout)."""
    err = refusal(variant(fresh, tmp_path, config={"tie_word_embeddings": True}), capfd)
    assert all(k in err for k in ("tie_word_embeddings=true", "lm_head.weight", "model.embed_tokens.weight")), err
    same = variant(fresh, tmp_path / "same", config={"tie_word_embeddings": True, "attention_dropout": 0.1},
                   tensors=lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"]})
    cfg = import_config(str(same), *JOB)
    assert cfg.model.tie_embeddings
    trainer, _, _ = build(cfg, mesh_of(cfg, 8), init=False)
    capfd.readouterr()
    params, _ = hf_import.load(str(same), trainer)
    out = capfd.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"train.init_from={same}: config.json attention_dropout=0.1"), out
    assert "head" not in params


def test_a_w4a4_checkpoint_imports_its_weights(fresh, tmp_path, capfd):
    """The W4A4 preset (NVFP4 weights and Linear inputs, each module's input_global_scale, as
    --calibrate exports) imports the weights of its W4A16 twin bit for bit, with a notice that
    the activation scales are not read; activations quantized another way are refused."""
    from safetensors.numpy import save_file

    w4a4 = variant(fresh, tmp_path, "nvfp4", config={"quantization_config": nv.export.NVFP4_QUANTIZATION_CONFIG})
    names = list(Safetensors(str(w4a4)).entries)  # the scales in a second shard, beside the weights' file
    scales = {k.replace("weight_packed", "input_global_scale"): np.float32([3.5]) for k in names
              if k.endswith(".weight_packed")}
    save_file(scales, str(w4a4 / "model-scales.safetensors"))
    os.rename(w4a4 / "model.safetensors", w4a4 / "model-weights.safetensors")  # else read alone, as transformers does
    (w4a4 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        **{k: "model-weights.safetensors" for k in names}, **{k: "model-scales.safetensors" for k in scales}}}))
    cfg = import_config(str(w4a4), *JOB)
    trainer, _, _ = build(cfg, mesh_of(cfg, 8), init=False)
    capfd.readouterr()
    params, _ = hf_import.load(str(w4a4), trainer)
    out = capfd.readouterr().out.splitlines()
    assert out == [f"train.init_from={w4a4}: config.json quantization_config quantizes the Linear inputs (W4A4): "
                   "their input_global_scale are not read (this run computes its own activation scales)"], out
    twin, _ = hf_import.load(str(fresh / "nvfp4"), trainer)
    bits = lambda t: [np.asarray(a).tobytes() for a in jax.tree.leaves(jax.device_get(t))]
    assert bits(params) == bits(twin)
    fp8 = {**nv.export.NVFP4_QUANTIZATION_CONFIG["config_groups"]["group_0"]["input_activations"], "num_bits": 8}
    q = {**nv.export.NVFP4_QUANTIZATION_CONFIG, "config_groups": {"group_0": {
        **nv.export.NVFP4_QUANTIZATION_CONFIG["config_groups"]["group_0"], "input_activations": fp8}}}
    err = refusal(variant(fresh, tmp_path / "fp8", "nvfp4", config={"quantization_config": q}), capfd)
    assert "quantizes activations other than the Linear inputs in NVFP4" in err, err


def test_a_folder_with_both_layouts_reads_the_single_file_and_an_index_stays_inside(exports, tmp_path):
    """model.safetensors beside a stale index and its shards: the single file is the checkpoint, as
    transformers loads it (the index was read first, silently another model). An index naming a
    file outside its folder is refused."""
    mixed = tmp_path / "mixed"
    shutil.copytree(exports / "nvfp4", mixed)
    shutil.copyfile(exports / "bf16" / "model.safetensors", mixed / "model.safetensors")
    assert set(Safetensors(str(mixed)).entries) == set(Safetensors(str(exports / "bf16")).entries)
    outside = tmp_path / "outside"
    outside.mkdir()
    index = json.loads((exports / "nvfp4" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"../../{exports.name}/nvfp4/{v}" for k, v in index["weight_map"].items()}
    (outside / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(nv.export.ExportError, match=r"model.safetensors.index.json names '\.\./.*', not a file of "
                                                    r"this folder"):
        Safetensors(str(outside))


def test_refused_tensors_the_model_does_not_read(fresh, tmp_path, capfd):
    # A Qwen2 relabelled llama: the same names plus q/k/v biases.
    biases = lambda t: {**t, **{f"model.layers.{i}.self_attn.{m}.bias": t[f"model.layers.{i}.input_layernorm.weight"]
                                for i in range(2) for m in ("q_proj", "k_proj", "v_proj")}}
    err = refusal(variant(fresh, tmp_path, tensors=biases), capfd)
    assert "6 tensors" in err and "_proj.bias" in err and "and 3 more" in err, err


def test_blocks_a_quantizer_left_plain_are_refused_naming_the_keep_that_reads_them(fresh, tmp_path, capfd):
    """A compressed-tensors checkpoint whose quantizer ignored one block's down_proj (a plain
    bf16 weight beside the NVFP4 ones): refused, naming that module and, for the first or last
    block, the nvfp4.keep_*_blocks that keeps it in bf16."""
    def tensors(path):  # {name: (header entry, bytes)} of a safetensors file (numpy reads no E4M3)
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            data = f.read()
        header.pop("__metadata__", None)
        return {k: (v, data[slice(*v["data_offsets"])]) for k, v in header.items()}

    plain = tensors(fresh / "bf16" / "model.safetensors")
    for layer, fix in ((0, "nvfp4.keep_first_blocks=1"), (1, "nvfp4.keep_last_blocks=1")):
        module = f"model.layers.{layer}.mlp.down_proj"
        folder = variant(fresh, tmp_path / str(layer), "nvfp4")
        kept = {k: t for k, t in tensors(folder / "model.safetensors").items() if not k.startswith(module + ".")}
        kept[module + ".weight"] = plain[module + ".weight"]
        header, offset = {}, 0
        for k, (entry, raw) in kept.items():
            header[k] = {**entry, "data_offsets": [offset, offset + len(raw)]}
            offset += len(raw)
        text = json.dumps(header).encode()
        (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text
                                                   + b"".join(raw for _, raw in kept.values()))
        err = refusal(folder, capfd)
        assert f"1 of its 2 layers are plain ({module}), the others NVFP4" in err and err.endswith(fix), err


def test_refused_layers_past_num_hidden_layers(fresh, tmp_path, capfd):
    err = refusal(variant(fresh, tmp_path, config={"num_hidden_layers": 1}), capfd)
    assert "layer 1 (model.layers.1." in err and "num_hidden_layers=1" in err, err


def test_refused_quantization_formats_it_does_not_read(fresh, tmp_path, capfd):
    for q, want in (({"quant_method": "fp8", "fmt": "e4m3"}, "quant_method='fp8', format=None"),
                    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format='float-quantized'"),
                    ({**nv.export.NVFP4A16_QUANTIZATION_CONFIG, "config_groups": {"group_0": {"weights": {
                        "num_bits": 8, "type": "float", "group_size": 16, "strategy": "tensor_group"}}}},
                     "config_groups.group_0: weights {\"num_bits\": 8")):
        folder = variant(fresh, tmp_path / q.get("format", "fp8"), "nvfp4", config={"quantization_config": q})
        err = refusal(folder, capfd)
        assert want in err, err


def test_refused_a_truncated_safetensors_file(fresh, tmp_path, capfd):
    folder = variant(fresh, tmp_path)
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(folder / "model.safetensors") - 100)
    err = refusal(folder, capfd)
    assert "model.safetensors is not a complete safetensors file" in err, err


def test_refused_non_finite_values(fresh, tmp_path, capfd):
    folder = variant(fresh, tmp_path)
    inf = np.array([np.inf], np.float32).astype(jnp.bfloat16).tobytes()
    poke(folder, "model.layers.1.mlp.up_proj.weight", (3, 5), inf)
    err = refusal(folder, capfd)
    assert "model.layers.1.mlp.up_proj.weight holds a non-finite value" in err and "at [3, 5]" in err, err
    folder = variant(fresh, tmp_path / "nvfp4", "nvfp4")
    poke(folder, "model.layers.0.self_attn.o_proj.weight_scale", (7, 2), b"\x7f")
    err = refusal(folder, capfd)
    assert "model.layers.0.self_attn.o_proj.weight_scale holds a NaN" in err and "at [7, 2]" in err, err


def test_an_export_names_the_token_files_bos_and_eos(tmp_path):
    """The tokenizer_config.json an export makes for a token file's tokenizer names the token
    file's own end and start tokens, and <|endoftext|> without token ids."""
    from tokenizers import Tokenizer, models

    path = tmp_path / "tok.json"
    Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, unk_token="a")).save(str(path))
    files = hf_import.tokenizer_files(str(path), 64, eos_id=1, bos_id=0)
    config = json.loads(files["tokenizer_config.json"])
    assert (config["eos_token"], config["bos_token"], config["add_bos_token"]) == ("</s>", "<s>", True)
    assert files["tokenizer.json"] == str(path) and config["model_max_length"] == 64
    plain = json.loads(hf_import.tokenizer_files(str(path), 64)["tokenizer_config.json"])
    assert plain["eos_token"] == "<|endoftext|>" and "bos_token" not in plain


def test_an_export_names_the_bos_and_eos_of_the_tokenizer_it_ships(fresh, tmp_path):
    """The checkpoint's tokenizer (a Llama 3.x Instruct list of end ids: the first names the
    token) or, where it has none, the token file's: never the checkpoint's ids over the token
    file's tokenizer; resolved before training (a list used to fail the export after it)."""
    from tokenizers import Tokenizer, models

    from train.__main__ import hf_metadata
    from train.prepare import prepare

    words = {"<s>": 0, "</s>": 1, "<eot>": 2, "the": 3, "cat": 4, "sat": 5}
    tok = tmp_path / "tok.json"
    Tokenizer(models.WordLevel(words, unk_token="the")).save(str(tok))
    with_tok = variant(fresh, tmp_path, config={"eos_token_id": [2, 1], "bos_token_id": 0})
    shutil.copy(tok, with_tok / "tokenizer.json")
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat")
    tokens = str(tmp_path / "t.bin")
    prepare([str(doc)], tokens, tokenizer=str(tok), eos="</s>")
    without = variant(fresh, tmp_path, fmt="nvfp4", config={"eos_token_id": 2, "bos_token_id": 0})
    for folder, data, want in ((with_tok, (), ([2, 1], "<eot>", "<s>")),
                               (without, ("data.source=tokens", f"data.path={tokens}"), (1, "</s>", None))):
        cfg = job(*data)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(folder)))
        hf_cfg, files = hf_metadata(cfg)
        config = json.loads(files["tokenizer_config.json"])
        assert (hf_cfg["eos_token_id"], config["eos_token"], config.get("bos_token")) == want
    # A checkpoint's generation settings travel with its ids, and a slow (SentencePiece) tokenizer is its tokenizer:
    # both were dropped where the folder had no tokenizer.json.
    (without / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
    cfg = job()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(without)))
    assert hf_metadata(cfg)[1] == {"generation_config.json": str(without / "generation_config.json")}
    (without / "tokenizer.model").write_bytes(b"sentencepiece")
    assert set(hf_metadata(cfg)[1]) == {"generation_config.json", "tokenizer.model"}
    cfg = job("data.source=tokens", f"data.path={tokens}")  # another tokenizer's ids: not the checkpoint's settings
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(tmp_path / "bare")))
    shutil.copytree(fresh / "bf16", tmp_path / "bare")
    (tmp_path / "bare" / "generation_config.json").write_text("{}")
    assert "generation_config.json" not in hf_metadata(cfg)[1]


# ----------------------------------------------------------------------------- the library, another model
# A user's model, not train's Llama: GPT-2-like names, a stacked block of two tensor-split NVFP4
# kernels and a norm scale, an unstacked NVFP4 head, an embedding kept out of NVFP4 (a float32
# tile-major matrix).
USER_NAMES = nv.export.HFNames.of(
    top={"wte": "transformer.wte", "ln_f/scale": "transformer.ln_f", "score/kernel": "score"},
    layer={"attn/c_attn/kernel": "attn.c_attn", "attn/c_proj/kernel": "attn.c_proj", "ln/scale": "ln_1"},
    segments=("h",), layer_prefix="transformer.h")
USER_RULES = nv.Rules(stacked=(r"^h/",), tensor=((r"c_attn/kernel$", -1), (r"c_proj/kernel$", -2)))
USER_POLICY = nv.Policy(keep=(r"^wte$",))


def user_state(data, tensor):
    """The user's model on a data x tensor mesh: ``(params, opt_state, abstract, shardings, mesh, tx)``."""
    import optax

    mesh = jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * tensor])
    tx = nv.master_weights(optax.adam(1e-2), policy=USER_POLICY, rules=USER_RULES)
    rng = np.random.default_rng(0)
    # Values bf16 holds exactly: the float32 norm scales travel as the export's bf16.
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(jnp.bfloat16).astype(np.float32)
    fp32 = {"wte": w(256, 64), "h": {"attn": {"c_attn": {"kernel": w(2, 64, 192)}, "c_proj": {"kernel": w(2, 64, 64)}},
                                     "ln": {"scale": 1 + w(2, 64)}},
            "ln_f": {"scale": 1 + w(64)}, "score": {"kernel": w(64, 48)}}
    fp32 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(np.float32), fp32)

    def build():
        params = nv.shard_params(fp32, mesh, USER_RULES, USER_POLICY)
        return params, tx.init(params)

    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(build)
        shardings = nv.shardings(abstract, mesh)
        params, opt_state = jax.jit(build, out_shardings=shardings)()
    return params, opt_state, abstract, shardings, mesh, tx


def user_args(abstract, shardings, mesh, tx):
    return dict(names=USER_NAMES, abstract_params=abstract[0], abstract_state=abstract[1],
                param_shardings=shardings[0], state_shardings=shardings[1], mesh=mesh, policy=USER_POLICY,
                init=tx.init)


@pytest.mark.slow
def test_the_library_reads_another_models_export_back_bit_for_bit(tmp_path):
    """jax_nvfp4.hf on the user's model: its compressed-tensors NVFP4 export (data 2 x tensor 2)
    reads back as the same stored params and the same fresh optimizer state, bit for bit, on
    that mesh and on data 3 (other tile padding, no tensor split); a process reads exactly the
    union of its devices' plans, each slice once. A checkpoint with tensors the model would not
    read is refused, naming them."""
    from safetensors.numpy import load_file, save_file

    from jax_nvfp4.hf import load_hf, plan_hf

    params, opt_state, abstract, shardings, mesh, tx = user_state(2, 2)
    assert isinstance(params["score"]["kernel"], nv.TiledNVFP4) and isinstance(params["wte"], nv.Tiled)
    export_hf(params, {"model_type": "user"}, str(tmp_path / "hf"), names=USER_NAMES, fmt="nvfp4")

    files = Safetensors(str(tmp_path / "hf"))
    again, again_state = load_hf(files, **user_args(abstract, shardings, mesh, tx))
    assert_bits_equal(again, params)
    assert_bits_equal(again_state, opt_state)
    plan = plan_hf(str(tmp_path / "hf"), names=USER_NAMES, abstract_params=abstract[0], abstract_state=abstract[1],
                   mesh=mesh, devices=list(mesh.devices.flat))
    planned = {(r.tensor, tuple((s.start, s.stop) for s in r.index)) for rs in plan.values() for r in rs}
    assert {(r.tensor, tuple((s.start, s.stop) for s in r.index)) for r in files.reads} == planned
    assert len(files.reads) == len(planned)

    *_, abstract3, shardings3, mesh3, tx3 = user_state(3, 1)
    other, _ = load_hf(str(tmp_path / "hf"), **user_args(abstract3, shardings3, mesh3, tx3))
    assert_bits_equal(host_logical(other), host_logical(params))

    export_hf(params, {"model_type": "user"}, str(tmp_path / "bf16"), names=USER_NAMES)  # NumPy reads it
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name, want in (("transformer.h.0.attn.c_attn.bias", "1 tensor this model does not read: "
                                                            "transformer.h.0.attn.c_attn.bias"),
                       ("transformer.h.2.ln_1.weight", "layer 2 (transformer.h.2.ln_1.weight, ...) but config.json "
                                                       "num_hidden_layers=2")):
        folder = tmp_path / name
        folder.mkdir()
        save_file({**tensors, name: tensors["transformer.h.0.ln_1.weight"]}, str(folder / "model.safetensors"))
        with pytest.raises(nv.export.ExportError, match=f"^{re.escape(str(folder))}: .*{re.escape(want)}"):
            plan_hf(str(folder), names=USER_NAMES, abstract_params=abstract[0], abstract_state=abstract[1], mesh=mesh)


def test_an_export_of_per_matrix_amaxes_notices_the_engines_that_fuse_them(capfd):
    # nvfp4.fused_amax=false: q/k/v and gate/up carry a global scale each, which vLLM and SGLang
    # read under the group's largest (up to 13% smaller weights in a probe): said before training.
    from train.__main__ import hf_check

    for fused in (True, False):
        cfg = job(f"nvfp4.fused_amax={str(fused).lower()}")
        capfd.readouterr()
        hf_check(cfg, mesh_of(cfg, 8))
        assert ("notice: nvfp4.fused_amax=false: the --export-hf NVFP4 checkpoint" in capfd.readouterr().err) != fused
