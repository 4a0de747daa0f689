"""Start a run from a Hugging Face Llama checkpoint: ``train.init_from: DIR`` (``--init-from DIR``).

What it reads (``DIR``):

- ``config.json``: the model's shape. :func:`resolve_config` sets the run's ``model`` keys from
  it, except those given explicitly (``--set``), which must agree with it (a mismatch is one
  line naming the key); :func:`check_model` only checks (what :func:`load` does).
- safetensors weights, one ``model.safetensors`` or shards listed by
  ``model.safetensors.index.json``: plain bf16 / f16 / f32 tensors, or compressed-tensors'
  ``nvfp4-pack-quantized`` Linear weights (``weight_packed`` u8 ``[out, in/2]``,
  ``weight_scale`` E4M3 ``[out, in/16]``, ``weight_global_scale`` f32 ``[1]``).
- The names map to this model's params through :func:`jax_nvfp4.export.hf_modules`, the map
  the Hugging Face export writes with.

What it builds (:func:`load`): the run's stored params and optimizer state, as
``train.programs.build(cfg, mesh, init=False)`` plans them, straight into their shardings:

- NVFP4 Linear weights into NVFP4 params losslessly: the codes and scale bytes as they are
  (1x16 groups of inputs are ``nvfp4.block: 1d``; with ``nvfp4.block: 2d`` the checkpoint's
  scales must be uniform over each 16x16 tile, as this project's own 2d export writes them),
  the global amax from the global scale (exactly the exported one where the export recorded
  it, :data:`jax_nvfp4.export.AMAX_METADATA`); the float32 masters are their dequantized
  values. Into bf16 params (``nvfp4.weights: bf16``, or a layer kept in bf16): the dequantized
  values.
- Plain weights: the float32 masters are their values; NVFP4 params are quantized from them
  (round to nearest, the run's block), bf16 params are their bf16 rounding.
- The optimizer starts fresh (``tx.init`` of those masters: zero moments, step 0).

Reading: each process reads only the slices of each tensor that its own devices store (the
tile-major layout, :mod:`jax_nvfp4.layout`, keeps whole tile rows of a matrix together, so a
device's tiles are one band of rows of the ``[in, out]`` kernel: a band of columns of the
``[out, in]`` weight); a replicated leaf is read once per process. Host memory holds one
device's block of one leaf at a time. :func:`plan` says what each device reads without
reading it (the byte counts come from the safetensors headers). The files are read through
``numpy.memmap`` slices of the data behind each header (safetensors' own NumPy reader has no
float8 type for the E4M3 scales); only the touched pages are read.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from train.config import Config, ConfigError

__all__ = ["Checkpoint", "Read", "amax_from_global_scale", "check_model", "hf_config", "load", "model_values", "plan",
           "read_hf_config", "resolve_config", "tokenizer_source"]

E2M1_X_E4M3 = np.float32(6 * 448)  # 448 * 6: the global encode scale's numerator (jax_nvfp4.numerics)
F32_MAX = np.float32(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- config.json
def _fail(where: str, text: str):
    raise ConfigError(f"train.init_from={where}: {text}")


def read_hf_config(directory: str) -> Dict[str, Any]:
    """``DIR/config.json`` as a dict.

    Raises:
      ConfigError: no such folder or file, or not a JSON object (one line naming it).
    """
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        _fail(directory, "not a folder")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        _fail(directory, "no config.json (a Hugging Face checkpoint folder has one)")
    except (OSError, ValueError) as e:
        _fail(directory, f"cannot read config.json: {e}")
    if not isinstance(hf, dict):
        _fail(directory, "config.json is not a JSON object")
    return hf


def _rope_theta(hf: Dict[str, Any], where: str) -> float:
    """``rope_theta`` from either spelling (``rope_parameters`` in transformers 5, top-level
    before); a rope scaling other than the default is refused (this model has none)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = d.get("rope_type", d.get("type", "default")) if isinstance(d, dict) else d
        if kind not in (None, "default"):
            _fail(where, f"config.json {name}.rope_type={kind!r}: this model has plain rotary positions only")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0)) if isinstance(params, dict) else hf.get("rope_theta")
    return float(theta)


def model_values(hf: Dict[str, Any], where: str = "DIR") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``(values, names)``: ``{model config key: value}`` that a Llama ``config.json``
    defines, and ``{key: its config.json name}`` for messages. Features this model does not
    have (another architecture, biases, rope scaling, another activation or head size) are
    refused (ConfigError, one line)."""
    if hf.get("model_type") != "llama":
        _fail(where, f"config.json model_type={hf.get('model_type')!r}: only Llama checkpoints ('llama') are read")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            _fail(where, f"config.json {key}={hf.get(key)!r}: this model has {key}={want!r}")
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for key in need:
        if not isinstance(hf.get(key), int):
            _fail(where, f"config.json has no integer {key}")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // heads) or d % heads:
        _fail(where, f"config.json head_dim={hf.get('head_dim')} with hidden_size={d}, num_attention_heads={heads}: "
                     "this model's head size is hidden_size / num_attention_heads")
    values = {"vocab": hf["vocab_size"], "d_model": d, "mlp_hidden": hf["intermediate_size"],
              "layers": hf["num_hidden_layers"], "heads": heads,
              "kv_heads": hf.get("num_key_value_heads") or heads, "rope_theta": _rope_theta(hf, where),
              "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    names = {"vocab": "vocab_size", "d_model": "hidden_size", "mlp_hidden": "intermediate_size",
             "layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
    return values, names


def _model_value(cfg: Config, key: str):
    return cfg.model.n_kv_heads if key == "kv_heads" else getattr(cfg.model, key)


def resolve_config(cfg: Config, given: Optional[set] = None) -> Config:
    """``cfg`` with the model shape of ``cfg.train.init_from``'s ``config.json``: the ``model``
    keys in ``given`` (``section.key`` names given explicitly, e.g. the command line's
    :func:`train.config.override_keys`; None: all of them) must agree with it, the others are
    taken from it (a config file's values included: the checkpoint is the model). Needs no JAX.

    Raises:
      ConfigError: one line naming the first key that differs, or a checkpoint this model
        cannot represent.
    """
    where = cfg.train.init_from
    if not where:
        return cfg
    values, names = model_values(read_hf_config(where), where)
    take = {}
    for key, value in values.items():
        if given is None or f"model.{key}" in given:
            if _model_value(cfg, key) != value:
                raise ConfigError(f"model.{key}={_model_value(cfg, key)!r}: train.init_from={where} has "
                                  f"{names[key]}={value!r} in its config.json")
        else:
            take[key] = value
    if not take:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **take))


def check_model(cfg: Config) -> None:
    """Raise ConfigError (one line naming the key) unless ``cfg.model`` is the shape of
    ``cfg.train.init_from``'s ``config.json``."""
    resolve_config(cfg, given=None)


def hf_config(cfg: Config, **kw) -> Dict[str, Any]:
    """The ``config.json`` of ``cfg.model`` (:func:`train.model.llama_config`; ``kw``:
    ``max_position_embeddings`` (default ``model.seq_len``), token ids): what
    :func:`model_values` reads back as the same model."""
    from train.model import llama_config

    m = cfg.model
    kw.setdefault("max_position_embeddings", m.seq_len)
    return llama_config(vocab=m.vocab, d_model=m.d_model, layers=m.layers, heads=m.heads, kv_heads=m.n_kv_heads,
                        mlp_hidden=m.mlp_hidden, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
                        tie_embeddings=m.tie_embeddings, **kw)


def tokenizer_source(directory: Optional[str]) -> Optional[str]:
    """``directory`` when it holds a Hugging Face tokenizer (``tokenizer.json``), for the run's
    exports to carry (:func:`tokenizer_files`); else None."""
    if directory and os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return directory
    return None


# The files of a Hugging Face tokenizer, copied from a checkpoint folder into an export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def tokenizer_files(tokenizer: Optional[str], max_positions: int) -> Dict[str, Any]:
    """The tokenizer files an export carries (``files=`` of
    :func:`jax_nvfp4.export.export_hf`): those of a checkpoint folder (:data:`TOKENIZER_FILES`)
    as they are, or a ``tokenizer.json`` with a ``tokenizer_config.json`` made for it (a fast
    tokenizer ending documents with ``<|endoftext|>``) unless the folder has its own."""
    files: Dict[str, Any] = {}
    if tokenizer and os.path.isdir(tokenizer):
        files = {n: os.path.join(tokenizer, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer, n))}
    elif tokenizer:
        files = {"tokenizer.json": tokenizer}
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        files["tokenizer_config.json"] = json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
             "model_max_length": max_positions}, indent=2).encode()
    return files


# ----------------------------------------------------------------------------- safetensors
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8", "I8": "int8",
           "I16": "int16", "I32": "int32", "I64": "int64", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    t = _DTYPES.get(name)
    if t is None:
        raise ValueError(f"safetensors dtype {name} is not read here")
    return np.dtype(getattr(ml_dtypes, t) if t in ("bfloat16", "float8_e4m3fn") else t)


@dataclasses.dataclass(frozen=True)
class Read:
    """One slice of one stored tensor: ``tensor[index]`` (``index``: a slice per axis)."""

    tensor: str
    index: Tuple[slice, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # of the first byte in the file


class Checkpoint:
    """The safetensors tensors of a Hugging Face checkpoint folder, read by slices.

    ``reads`` lists every :class:`Read` this object has served (for accounting: what a
    process read, in bytes)."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                _fail(directory, f"cannot read model.safetensors.index.json: {e}")
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            _fail(directory, "no model.safetensors (nor model.safetensors.index.json)")
        self.entries: Dict[str, _Entry] = {}
        self.metadata: Dict[str, str] = {}
        self.amax: Dict[str, int] = {}  # HF name of a global scale -> exact amax bits (export_hf)
        for name in files:
            self._read_header(name)
        self.reads: List[Read] = []

    def _read_header(self, name: str) -> None:
        from jax_nvfp4.export import AMAX_METADATA

        path = os.path.join(self.directory, name)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            _fail(self.directory, f"cannot read the safetensors header of {name}: {e}")
        meta = header.pop("__metadata__", None) or {}
        self.metadata.update(meta)
        if AMAX_METADATA in meta:
            self.amax.update({k: int(v, 16) for k, v in json.loads(meta[AMAX_METADATA]).items()})
        for tensor, e in header.items():
            self.entries[tensor] = _Entry(path, e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0])

    def __contains__(self, tensor: str) -> bool:
        return tensor in self.entries

    def shape(self, tensor: str) -> Tuple[int, ...]:
        return self.entries[tensor].shape

    def dtype(self, tensor: str) -> str:
        """The safetensors dtype name (``BF16``, ``F32``, ``U8``, ``F8_E4M3`` ...)."""
        return self.entries[tensor].dtype

    def request(self, tensor: str, *index: slice) -> Read:
        """The :class:`Read` of ``tensor[index]`` (nothing is read)."""
        e = self.entries[tensor]
        index = tuple(index) + (slice(None),) * (len(e.shape) - len(index))
        n = math.prod(len(range(*s.indices(d))) for s, d in zip(index, e.shape))
        return Read(tensor, index, n * _np_dtype(e.dtype).itemsize)

    def read(self, r: Read) -> np.ndarray:
        """``r.tensor[r.index]`` as a NumPy array of the stored dtype."""
        e = self.entries[r.tensor]
        dtype = _np_dtype(e.dtype)
        if math.prod(e.shape) == 0:
            return np.zeros(e.shape, dtype)[r.index]
        m = np.memmap(e.file, dtype=dtype, mode="r", offset=e.offset, shape=e.shape)
        out = np.array(m[r.index])
        del m
        self.reads.append(r)
        return out


# ----------------------------------------------------------------------------- one parameter's tensors
def _unpack(p: np.ndarray) -> np.ndarray:
    """``[..., n] uint8`` packed E2M1 codes -> ``[..., 2n]`` codes (element 2k in the low nibble)."""
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def _pack(c: np.ndarray) -> np.ndarray:
    """``[..., n]`` codes -> ``[..., ceil(n/2)] uint8`` (zero-padded to even)."""
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros((*c.shape[:-1], 1), c.dtype)], axis=-1)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def amax_from_global_scale(s: np.float32) -> np.float32:
    """An amax whose global encode scale (:func:`jax_nvfp4.numerics.global_encode_scale`) is
    ``s`` exactly, so that the dequantized values are those the scale gives. ``448 * 6 / s``
    and its neighbours are tried; one global scale may come from several amaxes (they all
    dequantize alike), so the exact one of an export is read from its header instead."""
    s = np.float32(s)
    if not np.isfinite(s) or s <= 0:
        raise ValueError(f"global scale {s} is not a positive finite number")
    if s >= F32_MAX:
        return np.float32(0)

    def enc(a):
        with np.errstate(divide="ignore", over="ignore"):
            v = np.minimum(E2M1_X_E4M3 / np.float32(a), F32_MAX)
        return np.float32(1) if v == 0 else v

    a = np.float32(E2M1_X_E4M3 / s)
    for k in range(9):
        for c in {a, *(np.float32(x) for x in (_ulp(a, k), _ulp(a, -k)))}:
            if enc(c) == s:
                return c
    return a


def _ulp(a: np.float32, k: int) -> np.float32:
    bits = np.array(a, np.float32).view(np.uint32) + np.uint32(k) if k >= 0 else \
        np.array(a, np.float32).view(np.uint32) - np.uint32(-k)
    return np.asarray(bits, np.uint32).view(np.float32)[()]


class _Param:
    """The tensors of one param (all its stacked layers) in the checkpoint, addressed in this
    model's orientation: the logical ``[rows, cols]`` matrix of a Flax ``[in, out]`` kernel is
    the transposed ``[out, in]`` weight; embeddings ``[vocab, d]`` and norm scales ``[d]`` keep
    theirs."""

    def __init__(self, ckpt: Checkpoint, path: str, modules, shape: Tuple[int, ...], linear: bool):
        self.ckpt, self.path, self.modules, self.linear = ckpt, path, modules, linear
        self.layer_shape = tuple(shape[len(modules[0][1]):])  # the shape of one layer's matrix
        where = ckpt.directory
        kinds = set()
        for m, _ in modules:
            if f"{m}.weight" in ckpt:
                kinds.add("plain")
            elif f"{m}.weight_packed" in ckpt:
                kinds.add("nvfp4")
            else:
                _fail(where, f"the checkpoint has no {m}.weight (nor {m}.weight_packed) for the parameter {path}")
        if len(kinds) > 1:
            _fail(where, f"{path}: some layers are NVFP4 and some are not; read as one parameter, they must agree")
        self.kind = kinds.pop()
        if self.kind == "nvfp4" and (not linear or len(self.layer_shape) != 2):
            _fail(where, f"{path}: compressed-tensors NVFP4 tensors for a parameter that is not a Linear weight")
        hf_shape = self.layer_shape[::-1] if linear else self.layer_shape
        for m, _ in modules:
            if self.kind == "plain":
                self._check(f"{m}.weight", hf_shape, ("BF16", "F16", "F32"))
            else:
                rows, cols = self.layer_shape
                if rows % 16:
                    _fail(where, f"{m}: {rows} input features; compressed-tensors NVFP4 groups need a multiple of 16")
                self._check(f"{m}.weight_packed", (cols, rows // 2), ("U8",))
                self._check(f"{m}.weight_scale", (cols, rows // 16), ("F8_E4M3",))
                self._check(f"{m}.weight_global_scale", (1,), ("F32",))

    def _check(self, tensor: str, shape, dtypes) -> None:
        got = self.ckpt.shape(tensor)
        if tuple(got) != tuple(shape):
            _fail(self.ckpt.directory, f"{tensor} has shape {list(got)}; this model's {self.path} needs {list(shape)}")
        if self.ckpt.dtype(tensor) not in dtypes:
            _fail(self.ckpt.directory, f"{tensor} is {self.ckpt.dtype(tensor)}; expected one of {', '.join(dtypes)}")

    def module(self, layer: Tuple[int, ...]) -> str:
        return dict((idx, m) for m, idx in self.modules)[tuple(layer)]

    # Requests for a band of the logical matrix: rows [r0, r1), cols [c0, c1).
    def value_reads(self, layer, rows: slice, cols: slice) -> List[Read]:
        t = f"{self.module(layer)}.weight"
        if len(self.layer_shape) == 1:
            return [self.ckpt.request(t, cols)]
        return [self.ckpt.request(t, cols, rows) if self.linear else self.ckpt.request(t, rows, cols)]

    def values(self, arrays: List[np.ndarray]) -> np.ndarray:
        v = arrays[0].astype(np.float32)
        return v.T if self.linear and v.ndim == 2 else v

    def code_reads(self, layer, rows: slice, cols: slice) -> List[Read]:
        # rows start on a tile row (a multiple of 16): whole bytes of the [out, in/2] codes.
        return [self.ckpt.request(f"{self.module(layer)}.weight_packed", cols,
                                  slice(rows.start // 2, -(-rows.stop // 2)))]

    def codes(self, arrays: List[np.ndarray], n_rows: int) -> np.ndarray:
        """The ``[out, in/2]`` band -> this kernel's ``[rows, ceil(cols/2)]`` packed codes."""
        return _pack(_unpack(arrays[0])[:, :n_rows].T)

    def scale_reads(self, layer, tile_rows: slice, cols: slice) -> List[Read]:
        return [self.ckpt.request(f"{self.module(layer)}.weight_scale", cols, tile_rows)]

    def scales(self, arrays: List[np.ndarray]) -> np.ndarray:
        """The ``[out, in/16]`` E4M3 band -> ``[tile rows, cols]`` scale bytes (the ``(16, 1)``
        blocks of the ``[in, out]`` kernel)."""
        return np.ascontiguousarray(arrays[0].view(np.uint8).T)

    def amax_reads(self, layer) -> List[Read]:
        return [self.ckpt.request(f"{self.module(layer)}.weight_global_scale")]

    def amax_bits(self, arrays: List[np.ndarray], layer) -> np.uint32:
        """The float32 bits of the layer's global amax, from its global scale ``arrays[0]``:
        the exported amax where the export recorded it (and the scale still is its own),
        else :func:`amax_from_global_scale`."""
        t = f"{self.module(layer)}.weight_global_scale"
        s = np.float32(arrays[0].reshape(-1)[0])
        exact = self.ckpt.amax.get(t)
        if exact is not None:
            a = np.array(exact, np.uint32).view(np.float32)[()]
            with np.errstate(divide="ignore"):
                if np.minimum(E2M1_X_E4M3 / a, F32_MAX) == s:
                    return np.uint32(exact)
        try:
            a = amax_from_global_scale(s)
        except ValueError as e:
            _fail(self.ckpt.directory, f"{t}: {e}")
        return np.array(a, np.float32).view(np.uint32)[()]


# ----------------------------------------------------------------------------- tile-major blocks
def _ranges(index, shape) -> List[range]:
    return [range(*s.indices(n)) for s, n in zip(index, shape)]


def _rectangles(lay, t0: int, t1: int):
    """Tiles ``[t0, t1)`` of one tensor shard's sub-matrix (row-major tile order; padding
    tiles past the matrix dropped) as at most three rectangles of whole tiles, each a run of
    consecutive tiles: ``[(first tile, (tile rows), (tile columns))]`` (a partial first tile
    row, whole tile rows, a partial last one), so that a device reads exactly its tiles."""
    gc = lay.grid[1]
    t1 = min(t1, lay.tiles)
    out = []
    while t0 < t1:
        g, j = divmod(t0, gc)
        if j or t1 - t0 < gc:  # part of one tile row
            end = min(t1, (g + 1) * gc)
            out.append((t0, (g, g + 1), (j, end - g * gc)))
            t0 = end
        else:  # whole tile rows
            g1 = t1 // gc
            out.append((t0, (g, g1), (0, gc)))
            t0 = g1 * gc
    return out


class _Target:
    """One array to build: its global ``shape``, ``dtype`` and sharding, and how a device's
    block of it is read (:meth:`parts`: the reads of each part and how they become the block).
    ``kind``: ``values`` (float32 tiles), ``codes`` / ``scales`` (an NVFP4 param's tiles, in
    ``layout`` with ``block``), ``amax`` (per layer) or ``whole`` (a replicated logical leaf)."""

    def __init__(self, name: str, shape, dtype, sharding, param: _Param, kind: str, layout=None, block=None):
        self.name, self.shape, self.dtype, self.sharding = name, tuple(shape), np.dtype(dtype), sharding
        self.param, self.kind, self.layout, self.block = param, kind, layout, block

    def parts(self, index):
        """``[(where in the block, [Read], convert)]``: ``convert(arrays)`` is the part's value."""
        p, r = self.param, _ranges(index, self.shape)
        out = []
        if self.kind in ("whole", "amax"):  # per layer: a replicated logical leaf, or an amax
            nb = len(self.shape) - (len(p.layer_shape) if self.kind == "whole" else 0)
            for pos in itertools.product(*(range(len(x)) for x in r[:nb])):
                layer = tuple(x[i] for x, i in zip(r[:nb], pos))
                if self.kind == "whole":
                    whole = [slice(None)] * 2 if len(p.layer_shape) == 2 else [None, slice(None)]
                    out.append((pos, p.value_reads(layer, *whole), p.values))
                else:
                    out.append((pos, p.amax_reads(layer), lambda arrays, layer=layer: p.amax_bits(arrays, layer)))
            return out
        lay = self.layout
        trailing = 2 if self.kind in ("values", "codes") else (0 if tuple(self.block) == (16, 16) else 1)
        nb = len(self.shape) - 2 - trailing
        t_first = r[nb + 1].start
        sub_r, sub_c = lay.sub
        for pos in itertools.product(*(range(len(x)) for x in r[:nb])):
            layer = tuple(x[i] for x, i in zip(r[:nb], pos))
            for j, ti in enumerate(r[nb]):
                roff = ti * sub_r if lay.tensor_dim == -2 else 0
                coff = ti * sub_c if lay.tensor_dim == -1 else 0
                for t, (g0, g1), (j0, j1) in _rectangles(lay, t_first, r[nb + 1].stop):
                    rows = slice(roff + g0 * 16, roff + min(g1 * 16, sub_r))
                    cols = slice(coff + j0 * 16, coff + min(j1 * 16, sub_c))
                    rect = type(lay)((rows.stop - rows.start, cols.stop - cols.start))  # a matrix of its own
                    where = (*pos, j, slice(t - t_first, t - t_first + rect.tiles))
                    if self.kind == "values":
                        reads = p.value_reads(layer, rows, cols)
                        conv = lambda arrays, rect=rect: rect.to_tiles(p.values(arrays))[0]
                    elif self.kind == "codes":
                        reads = p.code_reads(layer, rows, cols)
                        conv = lambda arrays, rect=rect: rect.to_tiles(p.codes(arrays, rect.matrix[0]), 8)[0]
                    else:
                        reads = p.scale_reads(layer, slice(rows.start // 16, -(-rows.stop // 16)), cols)
                        conv = lambda arrays, rect=rect, layer=layer: self._tile_scales(rect, p.scales(arrays), layer)
                    out.append((where, reads, conv))
        return out

    def _tile_scales(self, band, s: np.ndarray, layer) -> np.ndarray:
        """The ``[tile rows, cols]`` scale bytes of ``(16, 1)`` blocks as the tiles' scales of
        ``self.block``."""
        if tuple(self.block) == (16, 1):
            return band.scales_to_tiles(s, (16, 1))[0]
        # 16x16 tiles: one scale per tile, so the checkpoint's must repeat over each tile's columns.
        cols = s.shape[1]
        padded = np.pad(s, [(0, 0), (0, -cols % 16)], mode="edge").reshape(s.shape[0], -1, 16)
        if np.any(padded != padded[..., :1]):
            raise ConfigError(f"nvfp4.block=2d: {self.param.module(layer)}'s NVFP4 scales (one per 16 inputs of "
                              f"each output) differ inside a 16x16 tile; read it with nvfp4.block=1d")
        return band.scales_to_tiles(np.ascontiguousarray(padded[..., 0]), (16, 16))[0]

    def fill(self, index, ckpt: Checkpoint) -> np.ndarray:
        """The block at ``index``, read from ``ckpt``."""
        block = np.zeros([len(x) for x in _ranges(index, self.shape)], self.dtype)
        for where, reads, conv in self.parts(index):
            block[where] = conv([ckpt.read(r) for r in reads])
        return block

    def reads(self, index) -> List[Read]:
        return [r for _, reads, _ in self.parts(index) for r in reads]


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class _Leaf:
    path: str
    param: _Param
    abstract_param: Any
    abstract_master: Any
    source: Any  # the tree of _Target (a Tiled / TiledNVFP4 / NVFP4-less array of targets)


def _targets(ckpt: Checkpoint, trainer) -> List[_Leaf]:
    """What to read for each param of ``trainer``'s state, and into which arrays."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_nvfp4 as nv
    from jax_nvfp4.export import hf_modules, is_linear
    from train.model import HF_NAMES

    mesh = trainer.mesh
    masters = nv.find_state(trainer.abstract_state).master
    by_path = {nv.params.path_str(p): m for p, m in jax.tree_util.tree_flatten_with_path(masters, is_leaf=nv.layout.is_tiled)[0]}
    leaves = []
    for path, a_p, modules in hf_modules(trainer.abstract_params, HF_NAMES):
        a_m = by_path[path]
        param = _Param(ckpt, path, modules, a_p.shape, is_linear(path))
        sh = lambda spec: NamedSharding(mesh, spec)
        if param.kind == "nvfp4":
            if isinstance(a_p, nv.TiledNVFP4):
                lay, block = a_p.layout, tuple(a_p.block)
                if block not in ((16, 1), (16, 16)):
                    _fail(ckpt.directory, f"{path}: NVFP4 block {block} cannot hold compressed-tensors' 1x16 groups")
            else:  # read as NVFP4 in the master's tiles (or one replicated tile list) and dequantized
                lay = a_m.layout if isinstance(a_m, nv.Tiled) else nv.Layout(tuple(a_p.shape[-2:]))
                block = (16, 1)
            batch = tuple(a_p.shape[:-2])
            k = len(batch)
            scale_tail = () if block == (16, 16) else (16,)
            source = nv.TiledNVFP4(
                _Target(f"{path}/data", lay.shape(batch, (16, 8)), np.uint8, sh(lay.spec(k)), param, "codes", lay, block),
                _Target(f"{path}/scale_bits", lay.shape(batch, scale_tail), np.uint8,
                        sh(lay.spec(k, len(scale_tail))), param, "scales", lay, block),
                _Target(f"{path}/amax_bits", batch, np.uint32, sh(P()), param, "amax"),
                lay, block)
        elif isinstance(a_m, nv.Tiled):
            lay = a_m.layout
            source = nv.Tiled(_Target(path, a_m.value.shape, np.float32, sh(a_m.spec()), param, "values", lay), lay)
        else:
            source = _Target(path, a_m.shape, np.float32, sh(P()), param, "whole")
        leaves.append(_Leaf(path, param, a_p, a_m, source))
    return leaves


def _target_list(source) -> List[_Target]:
    import jax

    return [t for t in jax.tree.leaves(source, is_leaf=lambda x: isinstance(x, _Target))]


def plan(directory: str, trainer, devices: Optional[Sequence] = None) -> Dict[Any, List[Read]]:
    """``{device: [Read]}``: what each of ``devices`` (default: this process's) reads to
    build ``trainer``'s state from the checkpoint in ``directory``, from the headers and the
    abstract state alone (nothing is read or allocated). A process reads the union of its
    devices' reads, each distinct block once."""
    import jax

    ckpt = Checkpoint(directory)
    devices = list(devices) if devices is not None else jax.local_devices()
    out: Dict[Any, List[Read]] = {d: [] for d in devices}
    for leaf in _targets(ckpt, trainer):
        for t in _target_list(leaf.source):
            idx = t.sharding.devices_indices_map(t.shape)
            for d in devices:
                out[d] += t.reads(idx[d])
    return out


def _device_array(t: _Target, ckpt: Checkpoint):
    """``t`` as a global array: this process's blocks read from ``ckpt`` (each distinct block
    once), each put on its devices before the next is read."""
    import jax

    groups: Dict[tuple, List[Any]] = {}
    indices = {}
    for d, index in t.sharding.addressable_devices_indices_map(t.shape).items():
        key = tuple(tuple(s.indices(n)) for s, n in zip(index, t.shape))
        groups.setdefault(key, []).append(d)
        indices[key] = index
    arrays = {}
    for key, devs in groups.items():
        block = t.fill(indices[key], ckpt)
        for d in devs:
            arrays[d] = jax.device_put(block, d)
        del block
    order = list(t.sharding.addressable_devices_indices_map(t.shape))
    return jax.make_array_from_single_device_arrays(t.shape, t.sharding, [arrays[d] for d in order])


def load(directory: str, trainer, *, checkpoint: Optional[Checkpoint] = None) -> Tuple[Any, Any]:
    """``(params, opt_state)`` of ``trainer`` (``train.programs.build(cfg, mesh, init=False)``)
    from the Hugging Face checkpoint in ``directory``, in the trainer's shardings (module
    docstring). Call it on every process. ``checkpoint``: a :class:`Checkpoint` of
    ``directory`` to read through (its ``reads`` then list what this process read).

    Raises:
      ConfigError: the checkpoint's config.json or tensors do not fit the run's model or
        NVFP4 settings (one line naming the key or tensor).
    """
    import jax
    import jax.numpy as jnp

    import jax_nvfp4 as nv

    check_model(dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, init_from=directory)))
    ckpt = checkpoint if checkpoint is not None else Checkpoint(directory)
    leaves = _targets(ckpt, trainer)
    sources = [jax.tree.map(lambda t: _device_array(t, ckpt), leaf.source, is_leaf=lambda x: isinstance(x, _Target))
               for leaf in leaves]
    kinds = [(leaf.abstract_param, leaf.abstract_master) for leaf in leaves]
    params_def = jax.tree.structure(trainer.abstract_params, is_leaf=nv.layout.is_tiled)
    mesh, tx = trainer.mesh, trainer.tx

    def assemble(sources):
        params, masters = [], []
        for (a_p, a_m), s in zip(kinds, sources):
            if isinstance(s, nv.TiledNVFP4):
                m = nv.Tiled(s.dequantize_tiles(jnp.float32), s.layout) if isinstance(a_m, nv.Tiled) else s.dequantize(jnp.float32)
            else:
                m = s
            if isinstance(a_p, nv.TiledNVFP4):
                p = s if isinstance(s, nv.TiledNVFP4) else nv.sharding.requantize(m, mesh, block=a_p.block)
            elif isinstance(a_p, nv.Tiled):
                p = nv.Tiled(m.value.astype(a_p.value.dtype), a_p.layout)
            else:
                p = m.astype(a_p.dtype)
            params.append(p)
            masters.append(m)
        masters = jax.tree.unflatten(params_def, masters)
        return jax.tree.unflatten(params_def, params), tx.init(masters)

    with jax.set_mesh(mesh):
        return jax.jit(assemble, out_shardings=(trainer.param_shardings, trainer.state_shardings))(sources)

