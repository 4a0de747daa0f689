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
reading it (the byte counts come from the safetensors headers). The files are opened with
safetensors' own reader (``safe_open``: it validates each header and that the data covers the
file) and read by ``get_slice`` slices; only the touched pages are read. Its NumPy reader has
no float8 type, so the E4M3 scales are read through ``numpy.memmap`` at the offset that
reader's validation implies (tensors back to back in ``offset_keys()`` order, the data ending
the file).

Refused, one line each (ConfigError; the CLI exits 2 before anything is compiled): a
``config.json`` this model cannot represent (another architecture, biases, a rope scaling other
than Llama 3.x's ``llama3``, a ``quantization_config`` other than compressed-tensors'
``nvfp4-pack-quantized`` NVFP4 weights); a safetensors file that is truncated or corrupt;
tensors the model does not read (biases of another architecture labelled ``llama``, layers past
``num_hidden_layers``, an ``lm_head.weight`` of its own under ``tie_word_embeddings``; only
``rotary_emb.inv_freq`` buffers are skipped, as transformers skips them: ``config.json``
defines the positions); a NaN or Inf in any tensor read, or a NaN E4M3 scale byte. Training-time
settings the model does not implement (a non-zero ``attention_dropout``) are ignored with one
notice: the run trains without dropout.
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

__all__ = ["Checkpoint", "Read", "amax_from_global_scale", "check_model", "hf_config", "load", "model_values",
           "notice", "plan", "read_hf_config", "resolve_config", "tokenizer_source"]


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


# transformers' keys of a Llama 3.x rotary scaling (rope_type "llama3"), as train.model reads them.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(hf: Dict[str, Any], where: str) -> Tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, rope scaling)`` from either spelling: transformers 5's ``rope_parameters``
    (``rope_type``, ``rope_theta`` and the scaling's keys) or transformers 4's ``rope_scaling``
    beside a top-level ``rope_theta``. Llama 3.x's ``llama3`` scaling is read; any other
    ``rope_type`` is refused (one line)."""
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
        if isinstance(old, float) and old.is_integer():
            values["original_max_position_embeddings"] = int(old)
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


# The quantization this import reads: compressed-tensors' NVFP4 weights (jax_nvfp4.export writes
# them: NVFP4A16_QUANTIZATION_CONFIG), 4-bit floats in groups of 16 inputs with a per-tensor
# global scale.
_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}


def _check_quantization(hf: Dict[str, Any], where: str) -> None:
    """Refuse a ``quantization_config`` whose format this import does not read (one line)."""
    q = hf.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):
        _fail(where, "config.json quantization_config is not a JSON object")
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != "nvfp4-pack-quantized":
        _fail(where, f"config.json quantization_config has quant_method={method!r}, format={fmt!r}: only "
                     "compressed-tensors' 'nvfp4-pack-quantized' NVFP4 weights are read (or plain bf16/f16/f32 "
                     "weights, without a quantization_config)")
    status = q.get("quantization_status")
    if status not in (None, "compressed"):
        _fail(where, f"config.json quantization_config.quantization_status={status!r}: only compressed "
                     "checkpoints (weight_packed, weight_scale, weight_global_scale) are read")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if q.get(key):
            _fail(where, f"config.json quantization_config.{key} is set: this import reads NVFP4 weights only")
    groups = q.get("config_groups") or {}
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        group = group if isinstance(group, dict) else {}
        weights = group.get("weights") or {}
        got = {k: weights.get(k) for k in _NVFP4_WEIGHTS}
        if group.get("format", fmt) != fmt or got != _NVFP4_WEIGHTS:
            _fail(where, f"config.json quantization_config.config_groups.{name}: weights {json.dumps(got)} in format "
                         f"{group.get('format', fmt)!r}; only NVFP4 weights ({json.dumps(_NVFP4_WEIGHTS)}) in "
                         "'nvfp4-pack-quantized' are read")
        if group.get("input_activations") or group.get("output_activations"):
            _fail(where, f"config.json quantization_config.config_groups.{name} quantizes activations with "
                         "calibrated scales; this import reads weight-only NVFP4 (NVFP4A16), the model computes "
                         "its own activation scales")


def _dropouts(hf: Dict[str, Any]) -> Dict[str, float]:
    """The training-time dropout settings of ``config.json`` that are non-zero (this model has
    no dropout: they are ignored, with a notice)."""
    return {k: v for k, v in hf.items() if (k.endswith("dropout") or k.endswith("pdrop"))
            and isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0}


def notice(hf: Dict[str, Any], where: str = "DIR") -> Optional[str]:
    """The one line :func:`load` prints for settings of ``config.json`` it ignores (a
    non-zero ``attention_dropout``: this model has no dropout), or None."""
    ignored = _dropouts(hf)
    if not ignored:
        return None
    shown = ", ".join(f"{k}={v}" for k, v in ignored.items())
    return f"train.init_from={where}: config.json {shown} ignored: this model has no dropout (it trains without)"


def model_values(hf: Dict[str, Any], where: str = "DIR") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``(values, names)``: ``{model config key: value}`` that a Llama ``config.json``
    defines, and ``{key: its config.json name}`` for messages. Features this model does not
    have (another architecture, biases, a rope scaling other than Llama 3.x's, another
    activation or head size, a quantization format it does not read) are refused
    (ConfigError, one line)."""
    if hf.get("model_type") != "llama":
        _fail(where, f"config.json model_type={hf.get('model_type')!r}: only Llama checkpoints ('llama') are read")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("partial_rotary_factor", 1.0)):
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
    _check_quantization(hf, where)
    theta, scaling = _rope(hf, where)
    values = {"vocab": hf["vocab_size"], "d_model": d, "mlp_hidden": hf["intermediate_size"],
              "layers": hf["num_hidden_layers"], "heads": heads,
              "kv_heads": hf.get("num_key_value_heads") or heads, "rope_theta": theta, "rope_scaling": scaling,
              "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    names = {"vocab": "vocab_size", "d_model": "hidden_size", "mlp_hidden": "intermediate_size",
             "layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
             "rope_scaling": "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"}
    return values, names


def _shown(value) -> str:
    """A config value in a message: a rope scaling as its mapping."""
    if isinstance(value, RopeScaling):
        return json.dumps(dataclasses.asdict(value))
    return repr(value)


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
                raise ConfigError(f"model.{key}={_shown(_model_value(cfg, key))}: train.init_from={where} has "
                                  f"{names[key]}={_shown(value)} in its config.json")
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
                        mlp_hidden=m.mlp_hidden, rope_theta=m.rope_theta, rope_scaling=m.rope_scaling,
                        norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings, **kw)


def tokenizer_source(directory: Optional[str]) -> Optional[str]:
    """``directory`` when it holds a Hugging Face tokenizer (``tokenizer.json``), for the run's
    exports to carry (:func:`tokenizer_files`); else None."""
    if directory and os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return directory
    return None


# The files of a Hugging Face tokenizer, copied from a checkpoint folder into an export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def tokenizer_files(tokenizer: Optional[str], max_positions: int, *, eos_id: Optional[int] = None,
                    bos_id: Optional[int] = None) -> Dict[str, Any]:
    """The tokenizer files an export carries (``files=`` of
    :func:`jax_nvfp4.export.export_hf`): those of a checkpoint folder (:data:`TOKENIZER_FILES`)
    as they are, or a ``tokenizer.json`` with a ``tokenizer_config.json`` made for it unless
    the folder has its own: a fast tokenizer whose documents end with the token ``eos_id``
    (the token file's, else ``<|endoftext|>``) and start with ``bos_id`` when there is one."""
    files: Dict[str, Any] = {}
    if tokenizer and os.path.isdir(tokenizer):
        files = {n: os.path.join(tokenizer, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer, n))}
    elif tokenizer:
        files = {"tokenizer.json": tokenizer}
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        name = lambda i: None
        if eos_id is not None or bos_id is not None:
            from tokenizers import Tokenizer

            try:
                tok = Tokenizer.from_file(files["tokenizer.json"])
                name = lambda i: tok.id_to_token(int(i)) if i is not None else None
            except Exception:  # noqa: BLE001 - a tokenizer this package cannot read is copied as it is
                pass
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": name(eos_id) or "<|endoftext|>",
                  "model_max_length": max_positions}
        if name(bos_id):
            config.update(bos_token=name(bos_id), add_bos_token=True)
        files["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    return files


# ----------------------------------------------------------------------------- safetensors
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8", "I8": "int8",
           "I16": "int16", "I32": "int32", "I64": "int64", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}
# Bytes per element of every safetensors dtype (to place the tensors that follow one in a file).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
             "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8,
             "U64": 8, "F64": 8, "C64": 8, "F4": 0.5}
_FLOATS = ("BF16", "F16", "F32", "F64")


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
    file: str  # the safetensors file's name in the folder
    dtype: str
    shape: Tuple[int, ...]
    offset: Optional[int]  # of its first byte in the file (None: after a tensor of unknown size)


class Checkpoint:
    """The safetensors tensors of a Hugging Face checkpoint folder, read by slices.

    ``reads`` lists every :class:`Read` this object has served (for accounting: what a
    process read, in bytes).

    Raises:
      ConfigError: no safetensors file, an unreadable index, a file that is not a complete
        safetensors file (truncated or corrupt), or a tensor in two files (one line naming it).
    """

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        weight_map = None
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
                _fail(directory, f"cannot read model.safetensors.index.json: {e}")
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            _fail(directory, "no model.safetensors (nor model.safetensors.index.json)")
        self.entries: Dict[str, _Entry] = {}
        self.metadata: Dict[str, str] = {}
        self.amax: Dict[str, int] = {}  # HF name of a global scale -> exact amax bits (export_hf)
        self._files: Dict[str, Any] = {}  # file name -> its safetensors.safe_open
        for name in files:
            self._open(name)
        for tensor, name in (weight_map or {}).items():
            if self.entries.get(tensor, _Entry(None, "", (), None)).file != name:
                _fail(directory, f"model.safetensors.index.json maps {tensor} to {name}, which does not hold it")
        self.reads: List[Read] = []

    def _open(self, name: str) -> None:
        import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy, for safetensors' NumPy reader
        from safetensors import safe_open

        from jax_nvfp4.export import AMAX_METADATA

        path = os.path.join(self.directory, name)
        try:
            f = safe_open(path, framework="numpy")
        except OSError as e:
            _fail(self.directory, f"cannot open {name}: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError: the header or sizes are wrong
            _fail(self.directory, f"{name} is not a complete safetensors file (truncated or corrupt?): {e}")
        self._files[name] = f
        meta = f.metadata() or {}
        self.metadata.update(meta)
        if AMAX_METADATA in meta:
            try:
                self.amax.update({k: int(v, 16) for k, v in json.loads(meta[AMAX_METADATA]).items()})
            except (ValueError, AttributeError, TypeError) as e:
                _fail(self.directory, f"{name}: unreadable {AMAX_METADATA} metadata: {e}")
        # safe_open has checked that the tensors lie back to back (offset_keys() order) and that
        # their data ends the file: each one's offset follows (for the E4M3 tensors its NumPy
        # reader cannot build).
        tensors = [(t, f.get_slice(t)) for t in f.offset_keys()]
        shapes = [(t, sl.get_dtype(), tuple(sl.get_shape())) for t, sl in tensors]
        sizes = [_ITEMSIZE.get(dtype, math.nan) * math.prod(shape) for _, dtype, shape in shapes]
        offset = os.path.getsize(path) - sum(sizes)
        for (tensor, dtype, shape), size in zip(shapes, sizes):
            if tensor in self.entries:
                _fail(self.directory, f"{tensor} is in both {self.entries[tensor].file} and {name}")
            self.entries[tensor] = _Entry(name, dtype, shape, None if math.isnan(offset) else int(offset))
            offset += size

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
        index = tuple(slice(*s.indices(d)) for s, d in zip(index, e.shape))  # in bounds, as safetensors needs
        n = math.prod(len(range(*s.indices(d))) for s, d in zip(index, e.shape))
        return Read(tensor, index, n * _np_dtype(e.dtype).itemsize)

    def read(self, r: Read) -> np.ndarray:
        """``r.tensor[r.index]`` as a NumPy array of the stored dtype.

        Raises:
          ConfigError: the slice holds a NaN or Inf (a NaN byte, for E4M3 scales), naming the
            tensor and the first such element.
        """
        e = self.entries[r.tensor]
        dtype = _np_dtype(e.dtype)
        if math.prod(e.shape) == 0:
            return np.zeros(e.shape, dtype)[r.index]
        if e.dtype == "F8_E4M3":  # safetensors' NumPy reader has no float8 type
            if e.offset is None:
                _fail(self.directory, f"{r.tensor}: {e.file} holds a tensor of a dtype of unknown size before it")
            m = np.memmap(os.path.join(self.directory, e.file), dtype=dtype, mode="r", offset=e.offset, shape=e.shape)
            out = np.array(m[r.index])
            del m
            bad = (out.view(np.uint8) & 0x7F) == 0x7F
            what = "a NaN E4M3 scale byte"
        else:
            sl = self._files[e.file].get_slice(r.tensor)
            out = np.asarray(sl[r.index] if r.index else sl[...], dtype)
            bad = ~np.isfinite(out) if e.dtype in _FLOATS else None
            what = "a non-finite value (NaN or Inf)"
        if bad is not None and bad.any():
            at = [int(i) + s.indices(n)[0] for i, s, n in zip(np.argwhere(bad)[0], r.index, e.shape)]
            _fail(self.directory, f"{r.tensor} holds {what} at {at}; a checkpoint to train from must be finite")
        self.reads.append(r)
        return out


# ----------------------------------------------------------------------------- one parameter's tensors
def amax_from_global_scale(s: np.float32) -> np.float32:
    """An amax whose global encode scale (:func:`jax_nvfp4.numerics.global_encode_scale`,
    ``min(E4M3_MAX * E2M1_MAX / amax, F32_MAX)``, 1 where that is 0) is ``s`` exactly, so that
    the dequantized values are those the scale gives. ``448 * 6 / s`` and its neighbours are
    tried (on the host, in float32: nothing is compiled); one global scale may come from several
    amaxes (they all dequantize alike), so the exact one of an export is read from its header
    instead."""
    from jax_nvfp4 import numerics as nx

    s = np.float32(s)
    if not np.isfinite(s) or s <= 0:
        raise ValueError(f"global scale {s} is not a positive finite number")
    if s >= nx.F32_MAX:
        return np.float32(0)
    a = np.float32(nx.E4M3_MAX * nx.E2M1_MAX / s)
    for k in range(9):
        for c in {a, *(np.float32(x) for x in (_ulp(a, k), _ulp(a, -k)))}:
            if _encode_scale(c) == s:
                return c
    return a


def _encode_scale(amax: np.float32) -> np.float32:
    """:func:`jax_nvfp4.numerics.global_encode_scale` of one float32 ``amax``, on the host."""
    from jax_nvfp4 import numerics as nx

    with np.errstate(divide="ignore", over="ignore"):
        v = np.minimum(nx.E4M3_MAX * nx.E2M1_MAX / np.float32(amax), nx.F32_MAX)
    return np.float32(1) if v == 0 else np.float32(v)


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

    def tensors(self) -> List[str]:
        """The checkpoint tensors this param reads."""
        kinds = ("weight",) if self.kind == "plain" else ("weight_packed", "weight_scale", "weight_global_scale")
        return [f"{m}.{k}" for m, _ in self.modules for k in kinds]

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

    def code_bytes(self, arrays: List[np.ndarray]) -> np.ndarray:
        """The ``[out, in/2]`` band of packed codes as ``[in/2, out]``: each byte holds the codes
        of two consecutive inputs of one output (:func:`_tile_codes` turns a tile of them into
        the kernel's packed ``[in, out]`` codes)."""
        return arrays[0].T

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
        if exact is not None and _encode_scale(np.array(exact, np.uint32).view(np.float32)[()]) == s:
            return np.uint32(exact)
        try:
            a = amax_from_global_scale(s)
        except ValueError as e:
            _fail(self.ckpt.directory, f"{t}: {e}")
        return np.array(a, np.float32).view(np.uint32)[()]


# ----------------------------------------------------------------------------- tile-major blocks
def _ranges(index, shape) -> List[range]:
    return [range(*s.indices(n)) for s, n in zip(index, shape)]


def _tile_grid(lay) -> Tuple[np.ndarray, int]:
    """``(where, columns)``: ``where [nt, T] int32`` says where each stored tile of ``lay`` lies
    in the row-major grid of the whole matrix's tiles (its index there; -1 for padding), from the
    layout's own relayout (:meth:`jax_nvfp4.Layout.to_tiles` of the grid, one entry per tile);
    ``columns``: the grid's width."""
    from jax_nvfp4.layout import TILE

    rows, cols = (-(-n // TILE) for n in lay.matrix)
    grid = np.arange(1, rows * cols + 1, dtype=np.int32).reshape(rows, cols)
    where = lay.to_tiles(grid, width=1, height=1)[..., 0, 0]
    where -= 1
    return where, cols


def _rectangles(tiles: np.ndarray, grid_cols: int):
    """Consecutive stored tiles (``tiles``: their grid indices, :func:`_tile_grid`) as at most a
    few rectangles of whole tiles, each a run of consecutive tiles: ``[(first, (tile rows),
    (tile columns))]`` (``first``: the rectangle's first position in ``tiles``), so that a
    device reads exactly its tiles. Padding tiles (-1, at the end) are dropped."""
    tiles = tiles[tiles >= 0]
    if not tiles.size:
        return []
    g, j = np.divmod(tiles, grid_cols)
    breaks = np.flatnonzero((np.diff(g) != 0) | (np.diff(j) != 1)) + 1
    runs = [(int(a), int(b)) for a, b in zip(np.r_[0, breaks], np.r_[breaks, tiles.size])]  # one tile row each
    out = []
    for a, b in runs:
        span = (int(j[a]), int(j[b - 1]) + 1)
        if out and out[-1][2] == span and out[-1][1][1] == g[a] and out[-1][0] + out[-1][3] == a:
            first, (g0, g1), _, n = out[-1]
            out[-1] = (first, (g0, g1 + 1), span, n + b - a)  # the same columns on the next row: one rectangle
        else:
            out.append((a, (int(g[a]), int(g[a]) + 1), span, b - a))
    return [(first, rows, cols) for first, rows, cols, _ in out]


def _tile_codes(raw):
    """Checkpoint tiles ``[..., 8, 16]`` (bytes of two consecutive inputs of each of a tile's 16
    outputs, :meth:`_Param.code_bytes`) -> the kernel's packed tiles ``[..., 16, 8]`` (16 inputs,
    the codes of 16 outputs), with :mod:`jax_nvfp4.numerics`' packing (in the import's program)."""
    import jax.numpy as jnp

    from jax_nvfp4 import numerics as nx

    codes = nx.unpack_codes(jnp.swapaxes(raw, -1, -2))  # [..., 16 outputs, 16 inputs]
    return nx.pack_codes(jnp.swapaxes(codes, -1, -2))


class _Target:
    """One array to build: its global ``shape``, ``dtype`` and sharding, and how a device's
    block of it is read (:meth:`parts`: the reads of each part and how they become the block).
    ``kind``: ``values`` (float32 tiles), ``codes`` / ``scales`` (an NVFP4 param's tiles, in
    ``layout`` with ``block``; the codes as the checkpoint's bytes, ``[..., 8, 16]`` per tile,
    packed by :func:`_tile_codes`), ``amax`` (per layer) or ``whole`` (a replicated logical leaf)."""

    def __init__(self, name: str, shape, dtype, sharding, param: _Param, kind: str, layout=None, block=None):
        self.name, self.shape, self.dtype, self.sharding = name, tuple(shape), np.dtype(dtype), sharding
        self.param, self.kind, self.layout, self.block = param, kind, layout, block
        self._grid = None  # _tile_grid(layout), once needed

    def parts(self, index):
        """``[(where in the block, [Read], convert)]``: ``convert(arrays)`` is the part's value."""
        from jax_nvfp4.layout import TILE

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
        if self._grid is None:
            self._grid = _tile_grid(lay)
        grid, grid_cols = self._grid
        (rows_n, cols_n), tile = lay.matrix, TILE
        rects = [_rectangles(grid[ti, t_first:r[nb + 1].stop], grid_cols) for ti in r[nb]]
        for pos in itertools.product(*(range(len(x)) for x in r[:nb])):
            layer = tuple(x[i] for x, i in zip(r[:nb], pos))
            for j in range(len(r[nb])):
                for first, (g0, g1), (j0, j1) in rects[j]:
                    rows = slice(g0 * tile, min(g1 * tile, rows_n))
                    cols = slice(j0 * tile, min(j1 * tile, cols_n))
                    rect = type(lay)((rows.stop - rows.start, cols.stop - cols.start))  # a matrix of its own
                    where = (*pos, j, slice(first, first + rect.tiles))
                    if self.kind == "values":
                        reads = p.value_reads(layer, rows, cols)
                        conv = lambda arrays, rect=rect: rect.to_tiles(p.values(arrays))[0]
                    elif self.kind == "codes":
                        reads = p.code_reads(layer, rows, cols)
                        conv = lambda arrays, rect=rect: rect.to_tiles(p.code_bytes(arrays), tile, tile // 2)[0]
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
                _Target(f"{path}/data", lay.shape(batch, (8, 16)), np.uint8, sh(lay.spec(k)), param, "codes", lay, block),
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


# Buffers of older Llama exports that are not weights: config.json defines the positions
# (transformers skips them alike).
_SKIPPED = re.compile(r"\.rotary_emb\.inv_freq$")


def _same_values(ckpt: Checkpoint, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same values (read in bands of rows)."""
    if ckpt.shape(a) != ckpt.shape(b) or not {ckpt.dtype(a), ckpt.dtype(b)} <= set(_FLOATS):
        return False
    shape = ckpt.shape(a)
    step = max(1, (1 << 24) // max(1, math.prod(shape[1:]) * 4))  # 16 MB of float32 per band
    for i in range(0, shape[0] if shape else 1, step):
        band = [ckpt.read(ckpt.request(t, slice(i, i + step))).astype(np.float32) for t in (a, b)]
        if not np.array_equal(*band):
            return False
    return True


def _check_tensors(ckpt: Checkpoint, leaves: List[_Leaf], cfg: Config, *, read_values: bool) -> None:
    """Refuse (ConfigError, one line) tensors of ``ckpt`` that the model would not read: those
    of layers past ``model.layers``, an ``lm_head`` of its own under ``tie_embeddings`` unless
    it equals the embedding (compared only with ``read_values``), any other tensor no param
    reads."""
    from train.model import HF_NAMES

    where = ckpt.directory
    prefix = re.compile(re.escape(HF_NAMES.layer_prefix) + r"\.(\d+)\.")
    extra = sorted(t for t in ckpt.entries if (m := prefix.match(t)) and int(m.group(1)) >= cfg.model.layers)
    if extra:
        layers = sorted({int(prefix.match(t).group(1)) for t in extra})
        shown = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
        _fail(where, f"the checkpoint has tensors for layer{'s' if len(layers) > 1 else ''} {shown} ({extra[0]}, ...) "
                     f"but config.json num_hidden_layers={cfg.model.layers}; this model would not read them")
    read = {t for leaf in leaves for t in leaf.param.tensors()}
    unread = [t for t in ckpt.entries if t not in read and not _SKIPPED.search(t)]
    top = dict(HF_NAMES.top)
    head, embed = top["head/kernel"], top["embed"]
    own_head = [t for t in unread if t.startswith(head + ".")]
    if cfg.model.tie_embeddings and own_head:
        plain = own_head == [f"{head}.weight"]
        if not plain or (read_values and not _same_values(ckpt, f"{head}.weight", f"{embed}.weight")):
            what = f"{own_head[0]}, different from {embed}.weight" if plain else own_head[0]
            _fail(where, f"config.json tie_word_embeddings=true, but the checkpoint has its own {what}: this "
                         "model's head would be the embedding; set tie_word_embeddings to false in config.json to "
                         "read that head")
        unread = [t for t in unread if t not in own_head]  # the embedding again
    if unread:
        more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
        _fail(where, f"the checkpoint has {len(unread)} tensor{'s' if len(unread) > 1 else ''} this Llama does not "
                     f"read: {', '.join(unread[:3])}{more} (another architecture's weights, e.g. biases, "
                     "under model_type 'llama'?); refused rather than dropped")


def _packed(source):
    """An NVFP4 source (its codes still the checkpoint's tiles) with the kernel's packed codes."""
    import jax_nvfp4 as nv

    return source.replace(_tile_codes(source.data), source.scale_bits) if isinstance(source, nv.TiledNVFP4) else source


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
    leaves = _targets(ckpt, trainer)
    _check_tensors(ckpt, leaves, trainer.cfg, read_values=False)
    for leaf in leaves:
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

    Everything is checked and read before anything is compiled: a refusal compiles nothing.
    Settings of ``config.json`` it ignores are one line on stdout (:func:`notice`, process 0).

    Raises:
      ConfigError: the checkpoint's config.json or tensors do not fit the run's model or
        NVFP4 settings, or it holds tensors the model would not read or non-finite values
        (module docstring; one line naming the key or tensor).
    """
    import jax
    import jax.numpy as jnp

    import jax_nvfp4 as nv

    cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, init_from=directory))
    check_model(cfg)
    ckpt = checkpoint if checkpoint is not None else Checkpoint(directory)
    leaves = _targets(ckpt, trainer)
    _check_tensors(ckpt, leaves, cfg, read_values=True)
    line = notice(read_hf_config(directory), directory)
    if line and jax.process_index() == 0:
        print(line, flush=True)
    sources = [jax.tree.map(lambda t: _device_array(t, ckpt), leaf.source, is_leaf=lambda x: isinstance(x, _Target))
               for leaf in leaves]
    kinds = [(leaf.abstract_param, leaf.abstract_master) for leaf in leaves]
    flat = jax.tree_util.tree_flatten_with_path(trainer.abstract_params, is_leaf=nv.layout.is_tiled)
    params_def, paths = flat[1], [nv.params.path_str(p) for p, _ in flat[0]]
    mesh, tx, policy = trainer.mesh, trainer.tx, trainer.policy

    def assemble(sources):
        params, masters = [], []
        sources = [_packed(s) for s in sources]
        # Float weights quantized here take the policy's shared amax (nvfp4.fused_amax), as
        # every later re-quantization does; stored NVFP4 bits are kept as they are.
        quantized = [i for i, ((a_p, _), s) in enumerate(zip(kinds, sources))
                     if isinstance(a_p, nv.TiledNVFP4) and not isinstance(s, nv.TiledNVFP4)]
        shared = nv.params.shared_amaxes({paths[i]: nv.sharding.global_amax(sources[i], mesh) for i in quantized
                                          if policy.amax_group(paths[i])}, policy)
        for i, ((a_p, a_m), s) in enumerate(zip(kinds, sources)):
            if isinstance(s, nv.TiledNVFP4):
                m = nv.Tiled(s.dequantize_tiles(jnp.float32), s.layout) if isinstance(a_m, nv.Tiled) else s.dequantize(jnp.float32)
            else:
                m = s
            if isinstance(a_p, nv.TiledNVFP4):
                p = s if isinstance(s, nv.TiledNVFP4) else nv.sharding.requantize(m, mesh, block=a_p.block,
                                                                                amax=shared.get(paths[i]))
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

