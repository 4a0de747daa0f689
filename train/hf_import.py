"""Start a run from a Hugging Face Llama checkpoint (``train.init_from: DIR``, ``--init-from DIR``): the model's shape
from ``DIR/config.json`` (:func:`resolve_config`), its safetensors (plain or compressed-tensors NVFP4, losslessly)
read by each process where its devices store them (:func:`load`, :func:`plan`), the optimizer fresh. What is read
how, and the refusals (ConfigError, one line, before anything compiles): docs/TRAINING.md, ``--init-from``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from train.config import Config, ConfigError, RopeScaling

__all__ = ["Checkpoint", "Read", "amax_from_global_scale", "hf_config", "load", "model_values", "notice", "plan",
           "read_hf_config", "resolve_config", "tokenizer_source"]

# transformers' keys of a Llama 3.x rotary scaling (rope_type "llama3"), as train.model reads them.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# The weights of jax_nvfp4.export's NVFP4A16_QUANTIZATION_CONFIG (resolving a config imports no JAX).
_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
# model config key -> its config.json name.
_HF_KEYS = {"vocab": "vocab_size", "d_model": "hidden_size", "mlp_hidden": "intermediate_size",
            "layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
# The files of a Hugging Face tokenizer, copied from a checkpoint folder into an export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
# Buffers of older Llama exports that are not weights: config.json defines the positions (transformers skips them).
_SKIPPED = re.compile(r"\.rotary_emb\.inv_freq$")
# _Target kind -> (its tensor, logical rows (inputs) per entry: 2 codes a byte, 16 a scale; 0: all, per layer).
_READS = {"whole": ("weight", 0), "amax": ("weight_global_scale", 0), "values": ("weight", 1),
          "codes": ("weight_packed", 2), "scales": ("weight_scale", 16)}


def _fail(where: str, text: str):
    raise ConfigError(f"train.init_from={where}: {text}")


def read_hf_config(directory: str) -> Dict[str, Any]:
    """``DIR/config.json`` as a dict. Raises ConfigError: no such folder or file, or not a JSON object."""
    if not os.path.isdir(directory):
        _fail(directory, "not a folder")
    try:
        with open(os.path.join(directory, "config.json")) as f:
            hf = json.load(f)
    except FileNotFoundError:
        _fail(directory, "no config.json (a Hugging Face checkpoint folder has one)")
    except (OSError, ValueError) as e:
        _fail(directory, f"cannot read config.json: {e}")
    if not isinstance(hf, dict):
        _fail(directory, "config.json is not a JSON object")
    return hf


def _rope(hf: Dict[str, Any], where: str) -> Tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, scaling)`` from transformers 5's ``rope_parameters`` or 4's ``rope_scaling``; llama3's only."""
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        d = hf.get(name)
        if d is None:
            continue
        if not isinstance(d, dict) or any(isinstance(v, dict) for v in d.values()):
            _fail(where, f"config.json {name}={json.dumps(d)[:60]}: expected one mapping of rope settings")
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            found.append(None)
            continue
        if kind != "llama3":
            _fail(where, f"config.json {name}.rope_type={kind!r}: this model has plain rotary positions and Llama "
                         "3.x's scaling (rope_type 'llama3') only")
        missing = [k for k in _LLAMA3_KEYS if d.get(k) is None]
        if missing:
            _fail(where, f"config.json {name} (rope_type 'llama3') has no {missing[0]}")
        values = {k: d[k] for k in _LLAMA3_KEYS}
        old = values["original_max_position_embeddings"]
        values["original_max_position_embeddings"] = int(old) if isinstance(old, float) and old.is_integer() else old
        try:
            found.append(RopeScaling(**values))
        except ConfigError as e:
            _fail(where, f"config.json {name}: {e}".replace("model.rope_scaling.", f"{name}."))
    if len(found) == 2 and found[0] != found[1]:
        _fail(where, "config.json rope_parameters and rope_scaling disagree; keep one")
    inner, outer = (hf.get("rope_parameters") or {}).get("rope_theta"), hf.get("rope_theta")
    if inner is not None and outer is not None and inner != outer:
        _fail(where, f"config.json rope_theta={outer} and rope_parameters.rope_theta={inner} disagree; keep one")
    theta = next((t for t in (inner, outer) if t is not None), 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        _fail(where, f"config.json rope_theta={theta!r}: expected a number")
    return float(theta), (found[0] if found else None)


def _check_quantization(hf: Dict[str, Any], where: str) -> None:
    """Refuse a ``quantization_config`` other than compressed-tensors' weight-only NVFP4."""
    q = hf.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):
        _fail(where, "config.json quantization_config is not a JSON object")
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != "nvfp4-pack-quantized":
        _fail(where, f"config.json quantization_config has quant_method={method!r}, format={fmt!r}: only "
                     "compressed-tensors' 'nvfp4-pack-quantized' NVFP4 weights (or plain weights) are read")
    if q.get("quantization_status") not in (None, "compressed"):
        _fail(where, f"config.json quantization_config.quantization_status={q['quantization_status']!r}: only "
                     "compressed checkpoints are read")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if q.get(key):
            _fail(where, f"config.json quantization_config.{key} is set: this import reads NVFP4 weights only")
    groups = q.get("config_groups") or {}
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        group = group if isinstance(group, dict) else {}
        got = {k: (group.get("weights") or {}).get(k) for k in _NVFP4_WEIGHTS}
        if group.get("format", fmt) != fmt or got != _NVFP4_WEIGHTS:
            _fail(where, f"config.json quantization_config.config_groups.{name}: weights {json.dumps(got)} in format "
                         f"{group.get('format', fmt)!r}; only NVFP4 weights ({json.dumps(_NVFP4_WEIGHTS)}) are read")
        if group.get("input_activations") or group.get("output_activations"):
            _fail(where, f"config.json quantization_config.config_groups.{name} quantizes activations; this import "
                         "reads weight-only NVFP4 (NVFP4A16), the model computes its own activation scales")


def notice(hf: Dict[str, Any], where: str = "DIR") -> Optional[str]:
    """The line :func:`load` prints for the non-zero dropouts of ``config.json`` it ignores, or None."""
    shown = ", ".join(f"{k}={v}" for k, v in hf.items() if (k.endswith("dropout") or k.endswith("pdrop"))
                      and isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0)
    return (f"train.init_from={where}: config.json {shown} ignored: this model has no dropout (it trains without)"
            if shown else None)


def model_values(hf: Dict[str, Any], where: str = "DIR") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``(values, names)``: the ``model`` keys a Llama ``config.json`` defines, and their names there. Raises
    ConfigError: a feature this model lacks (architecture, biases, rope scaling, activation, head size, format)."""
    if hf.get("model_type") != "llama":
        _fail(where, f"config.json model_type={hf.get('model_type')!r}: only Llama checkpoints ('llama') are read")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("partial_rotary_factor", 1.0)):
        if hf.get(key, want) != want:
            _fail(where, f"config.json {key}={hf.get(key)!r}: this model has {key}={want!r}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            _fail(where, f"config.json has no integer {key}")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // heads) or d % heads:
        _fail(where, f"config.json head_dim={hf.get('head_dim')} with hidden_size={d}, num_attention_heads={heads}: "
                     "this model's head size is hidden_size / num_attention_heads")
    _check_quantization(hf, where)
    theta, scaling = _rope(hf, where)
    values = {k: hf[_HF_KEYS[k]] for k in ("vocab", "d_model", "mlp_hidden", "layers", "heads")}
    values.update(kv_heads=hf.get("num_key_value_heads") or heads, rope_theta=theta, rope_scaling=scaling,
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", 0)))
    return values, dict(_HF_KEYS, rope_scaling="rope_parameters" if hf.get("rope_parameters") else "rope_scaling")


def resolve_config(cfg: Config, given: Optional[set] = None) -> Config:
    """``cfg`` with the model shape of ``cfg.train.init_from``'s config.json: the ``model`` keys in ``given`` (explicit
    ``section.key`` names; None: all) must agree with it, the others are taken from it. Needs no JAX. Raises
    ConfigError: the first key that differs, or a checkpoint this model cannot represent."""
    where = cfg.train.init_from
    if not where:
        return cfg
    values, names = model_values(read_hf_config(where), where)
    shown = lambda v: json.dumps(dataclasses.asdict(v)) if isinstance(v, RopeScaling) else repr(v)
    take = {}
    for key, value in values.items():
        have = cfg.model.n_kv_heads if key == "kv_heads" else getattr(cfg.model, key)
        if given is not None and f"model.{key}" not in given:
            take[key] = value
        elif have != value:
            raise ConfigError(f"model.{key}={shown(have)}: train.init_from={where} has {names[key]}={shown(value)} "
                              "in its config.json")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **take)) if take else cfg


def hf_config(cfg: Config, **kw) -> Dict[str, Any]:
    """The ``config.json`` of ``cfg.model`` that :func:`model_values` reads back (``kw``: ``llama_config``'s)."""
    from train.model import llama_config
    m, kw = cfg.model, {"max_position_embeddings": cfg.model.seq_len, **kw}
    return llama_config(vocab=m.vocab, d_model=m.d_model, layers=m.layers, heads=m.heads, kv_heads=m.n_kv_heads,
                        mlp_hidden=m.mlp_hidden, rope_theta=m.rope_theta, rope_scaling=m.rope_scaling,
                        norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings, **kw)


def tokenizer_source(directory: Optional[str]) -> Optional[str]:
    """``directory`` when it holds a Hugging Face tokenizer (``tokenizer.json``), else None."""
    return directory if directory and os.path.isfile(os.path.join(directory, "tokenizer.json")) else None


def tokenizer_files(tokenizer: Optional[str], max_positions: int, *, eos_id: Optional[int] = None,
                    bos_id: Optional[int] = None) -> Dict[str, Any]:
    """An export's ``files=``: a folder's :data:`TOKENIZER_FILES`, or a ``tokenizer.json`` and (unless there is one) a
    ``tokenizer_config.json``: documents end with token ``eos_id`` (else ``<|endoftext|>``), start with ``bos_id``."""
    if tokenizer and os.path.isdir(tokenizer):
        files = {n: os.path.join(tokenizer, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer, n))}
    else:
        files = {"tokenizer.json": tokenizer} if tokenizer else {}
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        tok = None
        if eos_id is not None or bos_id is not None:
            from tokenizers import Tokenizer
            try:
                tok = Tokenizer.from_file(files["tokenizer.json"])
            except Exception:  # noqa: BLE001 - a tokenizer this package cannot read is copied as it is
                pass
        eos, bos = (tok.id_to_token(int(i)) if tok is not None and i is not None else None for i in (eos_id, bos_id))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos or "<|endoftext|>",
                  "model_max_length": max_positions}
        if bos:
            config.update(bos_token=bos, add_bos_token=True)
        files["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    return files


@dataclasses.dataclass(frozen=True)
class Read:
    """One slice of one stored tensor: ``tensor[index]`` (a slice per axis), ``nbytes`` long."""
    tensor: str
    index: Tuple[slice, ...]
    nbytes: int


def _refused(f, *args, **kw):
    """``f(*args, **kw)``, its :class:`jax_nvfp4.export.Safetensors` ExportError (``"DIR: ..."``) as ConfigError."""
    from jax_nvfp4.export import ExportError
    try:
        return f(*args, **kw)
    except ExportError as e:
        raise ConfigError(f"train.init_from={e}") from None


class Checkpoint:
    """The tensors of a checkpoint folder (:class:`jax_nvfp4.export.Safetensors`: its ``entries``, ``amax``) read by
    :class:`Read` slices; ``reads`` lists every one served. Raises ConfigError where that reader refuses the folder."""

    def __init__(self, directory: str):
        from jax_nvfp4.export import Safetensors
        self.files = _refused(Safetensors, directory)
        self.directory, self.entries, self.amax, self.reads = directory, self.files.entries, self.files.amax, []

    def shape(self, tensor: str) -> Tuple[int, ...]:
        return self.entries[tensor].shape

    def dtype(self, tensor: str) -> str:  # BF16, F32, U8, F8_E4M3...
        return self.entries[tensor].dtype

    def request(self, tensor: str, *index: slice) -> Read:
        """The :class:`Read` of ``tensor[index]`` (nothing is read)."""
        shape = self.shape(tensor)
        index = tuple(slice(*s.indices(d)) for s, d in zip(index + (slice(None),) * (len(shape) - len(index)), shape))
        n = math.prod(len(range(s.start, s.stop, s.step)) for s in index)
        return Read(tensor, index, n * self.files.numpy_dtype(tensor).itemsize)

    def read(self, r: Read) -> np.ndarray:
        """``r.tensor[r.index]`` in its stored dtype. Raises ConfigError: a NaN or Inf in it (a NaN E4M3 byte)."""
        out = _refused(self.files.array, r.tensor, r.index, finite=True)
        self.reads.append(r)
        return out


def amax_from_global_scale(s, recorded: Optional[int] = None) -> np.float32:
    """:func:`jax_nvfp4.export.amax_from_global_scale`, imported on use (resolving a config imports no JAX)."""
    from jax_nvfp4 import export
    return export.amax_from_global_scale(s, recorded)


class _Param:
    """The checkpoint tensors of one param (all its stacked layers, compressed-tensors' read into NVFP4 ``block``),
    checked, addressed in this model's orientation (a Flax ``[in, out]`` kernel is the ``[out, in]`` weight)."""

    def __init__(self, ckpt: Checkpoint, path: str, modules, shape: Tuple[int, ...], linear: bool, block):
        from jax_nvfp4.export import nvfp4_layout_refusal
        self.ckpt, self.path, self.linear, where = ckpt, path, linear, ckpt.directory
        self.module, self.layer_axes = {idx: m for m, idx in modules}, len(modules[0][1])
        self.layer_shape = tuple(shape[self.layer_axes:])
        for m, _ in modules:
            if f"{m}.weight" not in ckpt.entries and f"{m}.weight_packed" not in ckpt.entries:
                _fail(where, f"the checkpoint has no {m}.weight (nor {m}.weight_packed) for the parameter {path}")
        kinds = {"plain" if f"{m}.weight" in ckpt.entries else "nvfp4" for m, _ in modules}
        if len(kinds) > 1:
            _fail(where, f"{path}: some layers are NVFP4 and some are not; read as one parameter, they must agree")
        self.kind = kinds.pop()
        if self.kind == "plain":
            want = {"weight": (("BF16", "F16", "F32"), self.layer_shape[::-1] if linear else self.layer_shape)}
        elif not linear or len(self.layer_shape) != 2:
            _fail(where, f"{path}: compressed-tensors NVFP4 tensors for a parameter that is not a Linear weight")
        else:
            rows, cols = self.layer_shape
            why = nvfp4_layout_refusal(block, rows)
            if why:
                _fail(where, f"{path}: {why}")
            want = {"weight_packed": (("U8",), (cols, rows // 2)), "weight_scale": (("F8_E4M3",), (cols, rows // 16)),
                    "weight_global_scale": (("F32",), (1,))}
        self.tensors = [f"{m}.{suffix}" for m, _ in modules for suffix in want]
        for t in self.tensors:
            _refused(ckpt.files.expect, t, *want[t.rpartition(".")[2]])

    def request(self, layer, suffix: str, *band: slice) -> Read:
        """``layer``'s ``suffix`` tensor's :class:`Read`: ``band`` (logical rows, cols in its units) or all of it."""
        return self.ckpt.request(f"{self.module[layer]}.{suffix}", *(band[::-1] if self.linear else band))

    def values(self, a: np.ndarray) -> np.ndarray:
        return a.astype(np.float32).T if self.linear and a.ndim == 2 else a.astype(np.float32)

    def amax_bits(self, a: np.ndarray, tensor: str) -> np.uint32:
        """The float32 bits of the amax behind the global scale ``a`` (the export's own where it recorded it)."""
        try:
            return np.float32(amax_from_global_scale(a.reshape(-1)[0], self.ckpt.amax.get(tensor))).view(np.uint32)
        except ValueError as e:
            _fail(self.ckpt.directory, f"{tensor}: {e}")


def _rectangles(lay, ti: int, tiles: range) -> List[Tuple[int, slice, slice]]:
    """The stored tiles ``tiles`` of tensor shard ``ti`` of ``lay`` (row-major in the shard's grid, as Layout stores
    them; padding dropped) as at most three rectangles of whole tiles: ``[(first position in tiles, rows, cols)]``."""
    from jax_nvfp4.layout import TILE
    (sr, sc), (_, gc), (n_rows, n_cols) = lay.sub, lay.grid, lay.matrix
    r0, c0 = {-2: (ti * sr, 0), -1: (0, ti * sc)}.get(lay.tensor_dim, (0, 0))
    out, a, b = [], tiles.start, min(tiles.stop, lay.tiles)
    while a < b:
        g, j = divmod(a, gc)
        h, w = ((b - a) // gc, gc) if j == 0 and b - a >= gc else (1, min(gc - j, b - a))  # whole rows, or one's part
        out.append((a - tiles.start, slice(r0 + g * TILE, min(r0 + (g + h) * TILE, n_rows)),
                    slice(c0 + j * TILE, min(c0 + (j + w) * TILE, n_cols))))
        a += h * w
    return out


class _Target:
    """One array to build, of global ``shape``. ``kind``: ``values`` (float32 tiles), ``codes`` / ``scales`` (an
    NVFP4 param's tiles in ``layout`` with ``block``; the codes as the checkpoint's bytes, ``[..., 8, 16]`` per tile,
    packed in :func:`load`'s program), ``amax`` (per layer) or ``whole`` (a replicated leaf)."""

    def __init__(self, shape, dtype, sharding, param: _Param, kind: str, layout=None, block=None):
        self.shape, self.dtype, self.sharding, self.param, self.kind, self.layout, self.block = \
            tuple(shape), dtype, sharding, param, kind, layout, block

    def parts(self, index) -> List[Tuple[Any, Read, Any]]:
        """``[(where in the block at index, Read, convert)]``: ``convert(the array read)`` is that part."""
        from jax_nvfp4.layout import Layout
        p, r, out = self.param, [range(*s.indices(n)) for s, n in zip(index, self.shape)], []
        suffix, per = _READS[self.kind]
        for pos in itertools.product(*(range(len(x)) for x in r[:p.layer_axes])):
            layer = tuple(x[i] for x, i in zip(r, pos))
            if not per:  # the whole tensor
                read = p.request(layer, suffix)
                out.append((pos, read, lambda a, t=read.tensor: p.values(a) if self.kind == "whole" else
                            p.amax_bits(a, t)))
                continue
            for j, ti in enumerate(r[p.layer_axes]):  # then the tensor shards and the tiles
                for first, rows, cols in _rectangles(self.layout, ti, r[p.layer_axes + 1]):
                    rect = Layout((rows.stop - rows.start, cols.stop - cols.start))  # a matrix of its own
                    read = p.request(layer, suffix, slice(rows.start // per, -(-rows.stop // per)), cols)
                    out.append(((*pos, j, slice(first, first + rect.tiles)), read,
                                lambda a, rect=rect, layer=layer: self._tiles(rect, a, layer)))
        return out

    def _tiles(self, rect, a: np.ndarray, layer) -> np.ndarray:
        """The tiles of ``rect`` from ``a``, its band of the checkpoint's tensor."""
        if self.kind == "values":
            return rect.to_tiles(self.param.values(a))[0]
        if self.kind == "codes":
            return rect.to_tiles(a.T, 16, 8)[0]
        if tuple(self.block) == (16, 1):
            return rect.scales_to_tiles(a.view(np.uint8).T, (16, 1))[0]
        from jax_nvfp4.export import scales_per_tile
        tiles = scales_per_tile(a)  # 16x16 tiles: one scale each, so the checkpoint's must repeat over the tile
        if tiles is None:
            raise ConfigError(f"nvfp4.block=2d: {self.param.module[layer]}'s NVFP4 scales (one per 16 inputs of "
                              f"each output) differ inside a 16x16 tile; read it with nvfp4.block=1d")
        return rect.scales_to_tiles(tiles.view(np.uint8).T, (16, 16))[0]

    def fill(self, index) -> np.ndarray:
        """The block at ``index``, read from the checkpoint."""
        block = np.zeros([len(range(*s.indices(n))) for s, n in zip(index, self.shape)], self.dtype)
        for where, read, convert in self.parts(index):
            block[where] = convert(self.param.ckpt.read(read))
        return block


def _targets(ckpt: Checkpoint, trainer, cfg: Config, *, read_values: bool) -> List[Tuple[_Param, Any, Any, Any]]:
    """``[(param, abstract param, abstract master, its tree of _Target)]`` of ``trainer``'s state; ckpt checked."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_nvfp4 as nv
    from jax_nvfp4.export import hf_modules, is_linear
    from train.model import HF_NAMES

    sh = lambda spec: NamedSharding(trainer.mesh, spec)
    masters = nv.find_state(trainer.abstract_state).master
    by_path = {nv.params.path_str(p): m
               for p, m in jax.tree_util.tree_flatten_with_path(masters, is_leaf=nv.layout.is_tiled)[0]}
    leaves = []
    for path, a_p, modules in hf_modules(trainer.abstract_params, HF_NAMES):
        a_m, stored = by_path[path], isinstance(a_p, nv.TiledNVFP4)
        block = tuple(a_p.block) if stored else (16, 1)
        param = _Param(ckpt, path, modules, a_p.shape, is_linear(path), block)
        if param.kind == "nvfp4":  # into bf16 params: read in the master's tiles (or one tile list), dequantized
            lay = a_p.layout if stored else (a_m.layout if isinstance(a_m, nv.Tiled) else
                                             nv.Layout(tuple(a_p.shape[-2:])))
            batch, tail = tuple(a_p.shape[:-2]), () if block == (16, 16) else (16,)
            source = nv.TiledNVFP4(
                _Target(lay.shape(batch, (8, 16)), np.uint8, sh(lay.spec(len(batch))), param, "codes", lay, block),
                _Target(lay.shape(batch, tail), np.uint8, sh(lay.spec(len(batch), len(tail))), param, "scales", lay,
                        block),
                _Target(batch, np.uint32, sh(P()), param, "amax"), lay, block)
        elif isinstance(a_m, nv.Tiled):
            source = nv.Tiled(_Target(a_m.value.shape, np.float32, sh(a_m.spec()), param, "values", a_m.layout),
                              a_m.layout)
        else:
            source = _Target(tuple(a_m.shape), np.float32, sh(P()), param, "whole")
        leaves.append((param, a_p, a_m, source))
    _check_tensors(ckpt, [p for p, *_ in leaves], cfg, read_values=read_values)
    return leaves


def _check_tensors(ckpt: Checkpoint, params: List[_Param], cfg: Config, *, read_values: bool) -> None:
    """Refuse tensors of ``ckpt`` the model would not read: layers past ``model.layers``, an ``lm_head`` of its own
    under ``tie_embeddings`` unless it equals the embedding (compared only with ``read_values``), any other."""
    from train.model import HF_NAMES

    def same_values(a: str, b: str) -> bool:  # read in bands of 16 MB of float32
        if ckpt.shape(a) != ckpt.shape(b) or not {ckpt.dtype(a), ckpt.dtype(b)} <= {"BF16", "F16", "F32", "F64"}:
            return False
        shape = ckpt.shape(a)
        step = max(1, (1 << 24) // max(1, math.prod(shape[1:]) * 4))
        bands = ([ckpt.read(ckpt.request(t, slice(i, i + step))).astype(np.float32) for t in (a, b)]
                 for i in range(0, shape[0] if shape else 1, step))
        return all(np.array_equal(*band) for band in bands)

    where, prefix = ckpt.directory, re.compile(re.escape(HF_NAMES.layer_prefix) + r"\.(\d+)\.")
    extra = sorted(t for t in ckpt.entries if (m := prefix.match(t)) and int(m.group(1)) >= cfg.model.layers)
    if extra:
        layers = sorted({int(prefix.match(t).group(1)) for t in extra})
        shown = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
        _fail(where, f"the checkpoint has tensors for layer{'s' if len(layers) > 1 else ''} {shown} ({extra[0]}, ...) "
                     f"but config.json num_hidden_layers={cfg.model.layers}; this model would not read them")
    read = {t for p in params for t in p.tensors}
    unread = [t for t in ckpt.entries if t not in read and not _SKIPPED.search(t)]
    head, embed = dict(HF_NAMES.top)["head/kernel"], dict(HF_NAMES.top)["embed"]
    own_head = [t for t in unread if t.startswith(head + ".")]
    if cfg.model.tie_embeddings and own_head:
        plain = own_head == [f"{head}.weight"]
        if not plain or (read_values and not same_values(f"{head}.weight", f"{embed}.weight")):
            what = f"{own_head[0]}, different from {embed}.weight" if plain else own_head[0]
            _fail(where, f"config.json tie_word_embeddings=true, but the checkpoint has its own {what}: this model's "
                         "head would be the embedding; set tie_word_embeddings to false to read that head")
        unread = [t for t in unread if t not in own_head]  # the embedding again
    if unread:
        more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
        _fail(where, f"the checkpoint has {len(unread)} tensor{'s' if len(unread) > 1 else ''} this Llama does not "
                     f"read: {', '.join(unread[:3])}{more} (another architecture's, e.g. biases?); refused")


def plan(directory: str, trainer, devices: Optional[Sequence] = None) -> Dict[Any, List[Read]]:
    """``{device: [Read]}``: what each of ``devices`` (default: this process's; a process reads their union) reads to
    build ``trainer``'s state from ``directory``, from the headers and abstract state alone (nothing is read)."""
    import jax
    leaves = _targets(Checkpoint(directory), trainer, trainer.cfg, read_values=False)
    out: Dict[Any, List[Read]] = {d: [] for d in (jax.local_devices() if devices is None else devices)}
    for *_, source in leaves:
        for t in jax.tree.leaves(source, is_leaf=lambda x: isinstance(x, _Target)):
            idx = t.sharding.devices_indices_map(t.shape)
            for d in out:
                out[d] += [read for _, read, _ in t.parts(idx[d])]
    return out


def load(directory: str, trainer, *, checkpoint: Optional[Checkpoint] = None) -> Tuple[Any, Any]:
    """``(params, opt_state)`` of ``trainer`` (``train.programs.build(cfg, mesh, init=False)``) from ``directory``,
    in its shardings, on every process; read through ``checkpoint`` (its ``reads``) if given. All is checked and read
    before anything compiles; :func:`notice` is printed (process 0). Raises ConfigError (naming the key or tensor):
    a checkpoint that does not fit the run's model or NVFP4 settings."""
    import jax
    import jax.numpy as jnp
    import jax_nvfp4 as nv
    from jax_nvfp4 import numerics as nx

    def device_array(t: _Target):  # this process's blocks, each read once and put on its devices before the next
        indices, first, arrays = t.sharding.addressable_devices_indices_map(t.shape), {}, {}
        for d, index in indices.items():
            src = first.setdefault(tuple(tuple(s.indices(n)) for s, n in zip(index, t.shape)), d)
            arrays[d] = jax.device_put(t.fill(index) if src == d else arrays[src], d)
        return jax.make_array_from_single_device_arrays(t.shape, t.sharding, [arrays[d] for d in indices])

    cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, init_from=directory))
    resolve_config(cfg, given=None)  # every model key must agree with config.json
    leaves = _targets(checkpoint if checkpoint is not None else Checkpoint(directory), trainer, cfg, read_values=True)
    line = notice(read_hf_config(directory), directory)
    if line and jax.process_index() == 0:
        print(line, flush=True)
    sources = [jax.tree.map(device_array, s, is_leaf=lambda x: isinstance(x, _Target)) for *_, s in leaves]
    params_def = jax.tree.structure(trainer.abstract_params, is_leaf=nv.layout.is_tiled)
    mesh, policy = trainer.mesh, trainer.policy

    def assemble(sources):
        # The checkpoint's code tiles [..., 8, 16] (bytes of 2 inputs of 16 outputs) as the kernel's [..., 16, 8].
        codes = lambda raw: nx.pack_codes(jnp.swapaxes(nx.unpack_codes(jnp.swapaxes(raw, -1, -2)), -1, -2))
        sources = [s.replace(codes(s.data), s.scale_bits) if isinstance(s, nv.TiledNVFP4) else s for s in sources]
        # Float weights quantized here take the policy's shared amax (nvfp4.fused_amax), as every later
        # re-quantization does; stored NVFP4 bits are kept as they are.
        amaxes = {p.path: nv.sharding.global_amax(s, mesh) for (p, a_p, _, _), s in zip(leaves, sources)
                  if isinstance(a_p, nv.TiledNVFP4) and not isinstance(s, nv.TiledNVFP4) and policy.amax_group(p.path)}
        shared = nv.params.shared_amaxes(amaxes, policy)

        def one(param, a_p, a_m, s):  # (stored param, float32 master)
            m = s
            if isinstance(s, nv.TiledNVFP4):
                m = nv.Tiled(s.dequantize_tiles(jnp.float32), s.layout) if isinstance(a_m, nv.Tiled) else \
                    s.dequantize(jnp.float32)
            if isinstance(a_p, nv.TiledNVFP4):
                return (s if isinstance(s, nv.TiledNVFP4) else
                        nv.sharding.requantize(m, mesh, block=a_p.block, amax=shared.get(param.path))), m
            if isinstance(a_p, nv.Tiled):
                return nv.Tiled(m.value.astype(a_p.value.dtype), a_p.layout), m
            return m.astype(a_p.dtype), m

        params, masters = zip(*(one(*leaf[:3], s) for leaf, s in zip(leaves, sources)))
        return jax.tree.unflatten(params_def, params), trainer.tx.init(jax.tree.unflatten(params_def, masters))

    with jax.set_mesh(mesh):
        return jax.jit(assemble, out_shardings=(trainer.param_shardings, trainer.state_shardings))(sources)
