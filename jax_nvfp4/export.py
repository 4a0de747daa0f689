"""Export trained weights: this project's own NVFP4 format (``export_nvfp4`` / ``load_nvfp4``)
and Hugging Face checkpoints for serving engines (``export_hf``: bf16, or NVFP4 in
compressed-tensors' or ModelOpt's layout, the latter read back by ``read_modelopt``; through the
name map its caller gives: :class:`HFNames`; the training stack's Llama map is
``train.model.HF_NAMES``), and the readers of those layouts share (:class:`Safetensors`,
:func:`amax_from_global_scale`, :func:`scales_per_tile`); :mod:`jax_nvfp4.hf` reads a checkpoint
into the sharded training state.

The native format is a directory with one ``.npy`` file per array and a ``manifest.json``::

    {"format": "jax_nvfp4.export", "version": 2,
     "leaves": [{"path": "blocks/attn/q/kernel", "keys": [["dict", "blocks"], ...],
                 "kind": "nvfp4", "shape": [2, 64, 64], "block": [16, 16], "dtype": "nvfp4",
                 "files": {"data":  {"name": "0000.data.npy",  "dtype": "uint8",   "shape": [...], "sha256": "..."},
                           "scale": {"name": "0000.scale.npy", "dtype": "uint8",   ...},
                           "amax":  {"name": "0000.amax.npy",  "dtype": "float32", ...}}},
                {"path": "embed", "kind": "array", "shape": [256, 64], "dtype": "bfloat16",
                 "files": {"value": {"name": "0001.value.npy", "dtype": "bfloat16", "storage": "uint16", ...}}}],
     "sha256": "..."}

``sha256`` hashes the manifest itself (its canonical JSON without that key), so an edited
shape or block is detected like an altered data file; :func:`load_nvfp4` also checks the
manifest's schema before it uses any entry.

NVFP4 leaves: packed E2M1 bytes ``[..., rows, ceil(cols/2)] uint8`` (element ``2k`` in the low
nibble), E4M3 scale bytes (compact, shaped by the block: ``[..., ceil(rows/16), ceil(cols/16)]`` for 16x16 tiles) and the
float32 global amax ``[...]`` — see :mod:`jax_nvfp4.array`. Other leaves keep their dtype; dtypes
NumPy cannot store (bfloat16, float8) are written as their unsigned-integer bits
(``"storage"``). Files are written into a temporary directory that is renamed into place, so a
reader never sees half an export. ``overwrite=True`` replaces a previous export only: a
directory holding anything else is never deleted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.array import (BLOCK_1D, BLOCK_2D, BLOCK_COLUMN, NVFP4Array, as_array, check_values, dequantize,
                             is_nvfp4, packed_shapes)
from jax_nvfp4.params import path_str
from jax_nvfp4.sharding import host_array

__all__ = ["ExportError", "HFNames", "Read", "Safetensors", "SafetensorsEntry", "amax_from_global_scale", "check_hf",
           "export_hf", "export_nvfp4", "hf_modules", "hf_tensors", "is_export", "is_linear", "load_nvfp4",
           "modelopt_quant_config", "nvfp4_layout_refusal", "nvfp4_to_compressed_tensors", "nvfp4_to_modelopt",
           "read_modelopt", "scales_per_tile", "AMAX_METADATA", "EXPORT_FORMAT", "EXPORT_VERSION", "HF_LAYOUTS",
           "MODELOPT_PRODUCER", "MODELOPT_QUANT_CONFIG_FILE", "NVFP4A16_QUANTIZATION_CONFIG",
           "NVFP4_QUANTIZATION_CONFIG", "TIED_HEAD"]

EXPORT_FORMAT = "jax_nvfp4.export"
EXPORT_VERSION = 2  # 2: the manifest hashes itself
MANIFEST = "manifest.json"


class ExportError(ValueError):
    """An export that cannot be read (missing or altered file, bad manifest, non-finite values)."""


def _keys(path) -> List[List[Any]]:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(["dict", k.key if isinstance(k.key, (str, int)) else str(k.key)])
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(["index", k.idx])
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(["attr", k.name])
        else:
            out.append(["dict", str(getattr(k, "key", k))])
    return out


def _storage(dtype: np.dtype):
    """``(numpy dtype to write, name of the logical dtype)``: bits for dtypes ``.npy`` lacks."""
    name = jnp.dtype(dtype).name
    if np.dtype(dtype).kind == "V" or name in ("bfloat16",) or name.startswith("float8") or name.startswith("float4"):
        return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}"), name
    return np.dtype(dtype), name


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write(directory: str, name: str, value: np.ndarray, logical_dtype: Optional[str] = None) -> Dict[str, Any]:
    store, dname = _storage(value.dtype)
    arr = value.view(store) if store != value.dtype else value
    np.save(os.path.join(directory, name), arr, allow_pickle=False)
    entry = {"name": name, "dtype": logical_dtype or dname, "shape": list(value.shape),
             "sha256": _sha256(os.path.join(directory, name))}
    if store != value.dtype:
        entry["storage"] = store.name
    return entry


def _manifest_digest(manifest: Dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_export(directory: str) -> bool:
    """True if ``directory`` holds an export of this library and nothing else (its
    ``manifest.json`` and the files it lists): the only kind of non-empty directory
    ``export_nvfp4(..., overwrite=True)`` replaces."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        names = {MANIFEST} | {fe["name"] for e in manifest["leaves"] for fe in e["files"].values()}
        return manifest.get("format") == EXPORT_FORMAT and set(os.listdir(directory)) <= names
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def export_nvfp4(params, directory: str, *, overwrite: bool = False) -> str:
    """Write ``params`` (any pytree; ``NVFP4Array`` / ``TiledNVFP4`` leaves and plain arrays)
    to ``directory`` (logical layout, independent of the mesh).

    Call it on every process of a multi-process run (sharded arrays are gathered); process 0
    writes. Returns the path of ``manifest.json``.

    Raises:
      FileExistsError: ``directory`` exists and is not empty, unless ``overwrite`` and it is a
        previous export (:func:`is_export`); anything else in it is never deleted.
      TypeError: a leaf that is neither an ``NVFP4Array`` nor an array (e.g. a PRNG key).
      ExportError: a leaf holding NaN or Inf (an NVFP4 leaf: a non-finite amax); two leaves with
        one path (``{"a/b": x, "a": {"b": y}}``).
    """
    from jax_nvfp4.sharding import logical

    directory = os.path.abspath(os.fspath(directory))
    params = logical(params)  # stored (tile-major) params are written by their logical form
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_nvfp4)
    hosts = []
    for path, leaf in flat:
        if is_nvfp4(leaf):
            hosts.append((path, leaf, {"data": host_array(leaf.data),
                                       "scale": host_array(leaf.scale_bits).view(np.uint8),
                                       "amax": host_array(leaf.amax_bits).view(np.float32)}))
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
                raise TypeError(f"export_nvfp4: leaf {path_str(path)!r} is a PRNG key, not a weight")
            hosts.append((path, leaf, {"value": host_array(leaf)}))
        else:
            raise TypeError(f"export_nvfp4: leaf {path_str(path)!r} is a {type(leaf).__name__}, not an array")
    names = [path_str(path) for path, _, _ in hosts]
    if len(set(names)) < len(names):  # e.g. {"a/b": x, "a": {"b": y}}: the manifest names leaves by path
        twice = next(n for n in names if names.count(n) > 1)
        raise ExportError(f"export_nvfp4: two leaves have the path {twice!r} (a key holding '/'?); nothing written")
    for path, leaf, arrays in hosts:
        if not all(_finite(a) for a in arrays.values()):
            what = "amax" if is_nvfp4(leaf) else "values"
            raise ExportError(f"export_nvfp4: leaf {path_str(path)!r} has non-finite {what} (NaN or Inf); nothing written")
        if is_nvfp4(leaf):  # what load_nvfp4 would refuse is not written
            try:
                check_values(arrays["data"], arrays["scale"], arrays["amax"].view(np.uint32))
            except ValueError as e:
                raise ExportError(f"export_nvfp4: leaf {path_str(path)!r}: {e}; nothing written") from None
    if jax.process_index() != 0:
        return os.path.join(directory, MANIFEST)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"export_nvfp4: {directory} exists and is not a directory")
    if os.path.exists(directory) and os.listdir(directory):
        if not is_export(directory):
            raise FileExistsError(f"export_nvfp4: {directory} is not empty and is not an NVFP4 export; "
                                  "refusing to replace it (choose an empty or new directory)")
        if not overwrite:
            raise FileExistsError(f"export_nvfp4: {directory} holds an export (pass overwrite=True to replace it)")

    parent = os.path.dirname(directory) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
        leaves = []
        for i, (path, leaf, arrays) in enumerate(hosts):
            entry: Dict[str, Any] = {"path": path_str(path), "keys": _keys(path)}
            if is_nvfp4(leaf):
                entry.update(kind="nvfp4", shape=list(leaf.shape), block=list(leaf.block), dtype="nvfp4")
                entry["files"] = {
                    "data": _write(tmp, f"{i:04d}.data.npy", arrays["data"]),
                    "scale": _write(tmp, f"{i:04d}.scale.npy", arrays["scale"]),
                    "amax": _write(tmp, f"{i:04d}.amax.npy", arrays["amax"]),
                }
            else:
                v = arrays["value"]
                entry.update(kind="array", shape=list(v.shape), dtype=_storage(v.dtype)[1])
                entry["files"] = {"value": _write(tmp, f"{i:04d}.value.npy", v)}
            leaves.append(entry)
        manifest = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "leaves": leaves}
        manifest["sha256"] = _manifest_digest(manifest)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        os.chmod(tmp, 0o755)
        if os.path.exists(directory):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.old-", dir=parent)
            os.rename(directory, os.path.join(old, "x"))
            os.rename(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(directory, MANIFEST)


def _read(directory: str, where: str, entry: Dict[str, Any]) -> np.ndarray:
    name = entry.get("name")
    if not isinstance(name, str) or os.path.basename(name) != name:
        raise ExportError(f"{where}: bad file name {name!r} in the manifest")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ExportError(f"{where}: file {name} is missing")
    if _sha256(path) != entry.get("sha256"):
        raise ExportError(f"{where}: file {name} does not match its sha256 in the manifest (altered or corrupt)")
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - a malformed file is a bad export
        raise ExportError(f"{where}: cannot read {name}: {e}") from None
    if "storage" in entry:
        if arr.dtype != np.dtype(entry["storage"]):
            raise ExportError(f"{where}: {name} holds {arr.dtype}, the manifest says {entry['storage']}")
        arr = arr.view(jnp.dtype(entry["dtype"]))
    elif arr.dtype != jnp.dtype(entry.get("dtype", arr.dtype)):
        raise ExportError(f"{where}: {name} holds {arr.dtype}, the manifest says {entry['dtype']}")
    if list(arr.shape) != list(entry.get("shape", [])):
        raise ExportError(f"{where}: {name} has shape {list(arr.shape)}, the manifest says {entry.get('shape')}")
    return arr


_HEX = set("0123456789abcdef")


def _check_schema(mpath: str, manifest: Dict[str, Any]) -> None:
    """Raise ExportError (one line naming the entry) unless the manifest has the documented
    structure: checked before any entry is used, so a malformed one cannot surface as an
    AttributeError or a wrong shape."""
    def fail(where, what):
        raise ExportError(f"{mpath}: malformed manifest: {where}: {what}")

    def ints(v, n=None):
        return (isinstance(v, list) and (n is None or len(v) == n)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v))

    leaves = manifest.get("leaves")
    if not isinstance(leaves, list):
        fail("leaves", f"expected a list, got {type(leaves).__name__}")
    required = {"nvfp4": ("data", "scale", "amax"), "array": ("value",)}
    seen = set()
    for i, e in enumerate(leaves):
        where = f"leaves[{i}]"
        if not isinstance(e, dict):
            fail(where, f"expected an object, got {type(e).__name__}")
        if not isinstance(e.get("path"), str) or e["path"] in seen:
            fail(where, f"path {e.get('path')!r} is not a unique string")
        seen.add(e["path"])
        keys = e.get("keys", [])
        if not isinstance(keys, list) or not all(
                isinstance(k, list) and len(k) == 2 and k[0] in ("dict", "index", "attr")
                and isinstance(k[1], (str, int)) and not isinstance(k[1], bool) for k in keys):
            fail(where, "keys must be a list of [dict|index|attr, name]")
        kind = e.get("kind")
        if kind not in required:
            fail(where, f"unknown kind {kind!r}")
        if not ints(e.get("shape")):
            fail(where, f"shape {e.get('shape')!r} is not a list of non-negative ints")
        if kind == "nvfp4" and (not ints(e.get("block"), 2) or len(e["shape"]) < 2):
            fail(where, f"an nvfp4 leaf needs a block [r, c] and at least 2 axes, got block {e.get('block')!r}")
        files = e.get("files")
        if not isinstance(files, dict) or set(files) != set(required[kind]):
            fail(where, f"files must be exactly {list(required[kind])}")
        for name, fe in files.items():
            if not (isinstance(fe, dict) and isinstance(fe.get("name"), str) and isinstance(fe.get("dtype"), str)
                    and ints(fe.get("shape")) and isinstance(fe.get("sha256"), str) and len(fe["sha256"]) == 64
                    and set(fe["sha256"]) <= _HEX and isinstance(fe.get("storage", ""), str)):
                fail(f"{where}.files.{name}", "needs name, dtype, shape, sha256 (64 hex digits)")


def _finite(arr: np.ndarray) -> bool:
    if jnp.issubdtype(arr.dtype, jnp.floating):
        return bool(np.all(np.isfinite(arr.astype(np.float32))))
    return True


def _build(leaves: List[tuple]):
    """Nested dicts / lists from ``[(keys, value)]``; a single leaf with no keys is returned."""
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]
    root: Dict[Any, Any] = {}
    for keys, value in leaves:
        node = root
        for (kind, k), nxt in zip(keys[:-1], keys[1:]):
            node = node.setdefault((kind, k), {})
        node[tuple(keys[-1])] = value

    def finish(node):
        if not isinstance(node, dict):
            return node
        kinds = {kind for kind, _ in node}
        if kinds == {"index"}:  # a None entry is not stored: it comes back as None where a later one follows
            return [finish(node[("index", i)]) if ("index", i) in node else None
                    for i in range(max(k for _, k in node) + 1)]
        return {k: finish(v) for (_, k), v in node.items()}

    return finish(root)


def load_nvfp4(directory: str, *, like=None):
    """Read an export back: a tree of ``NVFP4Array`` (bit-identical to what was exported)
    and plain arrays.

    The tree is rebuilt from the manifest's paths as nested dicts (lists for sequence
    indices, each entry at its index: a None entry, which has no bytes, comes back as None
    before a later entry and is lost at a list's end); pass ``like`` (any tree with the same
    leaf paths, e.g. the params or their ``jax.eval_shape``) to get exactly its structure, its
    leaves' shapes, dtypes and blocks checked.

    Raises:
      ExportError: missing/unreadable manifest or file, a sha256 mismatch, shapes that do not
        fit (the export's, or ``like``'s), non-finite values (an NVFP4 amax or a float leaf
        holding NaN/Inf), or NVFP4 values no quantization writes (:func:`~jax_nvfp4.array.check_values`).
    """
    directory = os.path.abspath(os.fspath(directory))
    mpath = os.path.join(directory, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{directory}: no {MANIFEST}; not an NVFP4 export") from None
    except (OSError, ValueError) as e:
        raise ExportError(f"{mpath}: cannot read: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{mpath}: not a {EXPORT_FORMAT} manifest")
    if manifest.get("version") != EXPORT_VERSION:
        raise ExportError(f"{mpath}: format version {manifest.get('version')}, this code reads {EXPORT_VERSION}")
    if manifest.get("sha256") != _manifest_digest(manifest):
        raise ExportError(f"{mpath}: does not match its own sha256 (edited or corrupt)")
    _check_schema(mpath, manifest)
    out = []
    for entry in manifest.get("leaves", []):
        where = f"{directory}: leaf {entry.get('path')!r}"
        files = entry.get("files", {})
        try:
            if entry.get("kind") == "nvfp4":
                shape, block = tuple(entry["shape"]), tuple(entry["block"])
                data, scale, amax = (_read(directory, where, files[k]) for k in ("data", "scale", "amax"))
                want = packed_shapes(shape, block)
                got = (tuple(data.shape), tuple(scale.shape), tuple(amax.shape))
                if got != tuple(tuple(s) for s in want) or data.dtype != np.uint8 or scale.dtype != np.uint8:
                    raise ExportError(f"{where}: stored arrays {got} do not fit logical shape {list(shape)} with block {list(block)}")
                if amax.dtype != np.float32:
                    raise ExportError(f"{where}: amax must be float32, got {amax.dtype}")
                if not _finite(amax):
                    raise ExportError(f"{where}: non-finite amax (NaN or Inf): the weights it scales are invalid")
                try:
                    check_values(data, scale, amax.view(np.uint32))
                except ValueError as e:
                    raise ExportError(f"{where}: {e}") from None
                value = NVFP4Array(as_array(data), as_array(scale), as_array(amax.view(np.uint32)),
                                   (int(shape[-2]), int(shape[-1])), block)
            elif entry.get("kind") == "array":
                arr = _read(directory, where, files["value"])
                if not _finite(arr):
                    raise ExportError(f"{where}: non-finite values (NaN or Inf)")
                value = as_array(arr)
            else:
                raise ExportError(f"{where}: unknown kind {entry.get('kind')!r}")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ExportError):
                raise
            raise ExportError(f"{where}: malformed manifest entry ({type(e).__name__}: {e})") from None
        out.append((entry.get("path"), [tuple(k) for k in entry.get("keys", [])], value))
    if like is not None:
        flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_nvfp4)
        by_path = {p: v for p, _, v in out}
        want = [path_str(p) for p, _ in flat]
        if sorted(want) != sorted(by_path):
            missing = sorted(set(want) - set(by_path))
            extra = sorted(set(by_path) - set(want))
            raise ExportError(f"{directory}: leaves do not match `like`: missing {missing[:3]}, extra {extra[:3]}")
        for (p, like_leaf), name in zip(flat, want):  # what `like` says of each leaf's shape, dtype and block
            got, shape = by_path[name], getattr(like_leaf, "shape", None)
            kind = "NVFP4" if is_nvfp4(got) else str(got.dtype)
            like_kind = "NVFP4" if is_nvfp4(like_leaf) else str(getattr(like_leaf, "dtype", kind))
            if (shape is not None and tuple(shape) != tuple(got.shape)) or like_kind != kind or (
                    is_nvfp4(got) and tuple(like_leaf.block) != tuple(got.block)):
                held = lambda x, k: f"{k} {list(x.shape)}" + (f" block {list(x.block)}" if is_nvfp4(x) else "")
                raise ExportError(f"{directory}: leaf {name!r} is {held(got, kind)}, but `like` has "
                                  f"{held(like_leaf, like_kind) if shape is not None else like_kind}")
        return jax.tree_util.tree_unflatten(treedef, [by_path[p] for p in want])
    return _build([(keys, v) for _, keys, v in out])


# ----------------------------------------------------------------------------- Hugging Face
#
# A Hugging Face checkpoint (``config.json`` + safetensors) of a params tree, through a name
# map the caller gives (:class:`HFNames`: the training stack's Llama map is
# ``train.model.HF_NAMES``). Only the Flax ``[in, out]`` kernels change orientation, to torch's
# ``[out, in]``; every other leaf maps one to one.


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How a params tree's leaves are named in a Hugging Face checkpoint.

    ``top``: param path -> HF module for unstacked leaves (``{"embed": "model.embed_tokens"}``);
    ``layer``: path inside a stacked-layer sub-tree -> the module's name inside one HF layer
    (``{"attn/q/kernel": "self_attn.q_proj"}``); ``segments``: the stacked-layer sub-trees in
    layer order (their layers are numbered on, one after the other); ``layer_prefix``: the HF
    name of layer ``i`` is ``f"{layer_prefix}.{i}"``."""

    top: Tuple[Tuple[str, str], ...]
    layer: Tuple[Tuple[str, str], ...]
    segments: Tuple[str, ...] = ("blocks",)
    layer_prefix: str = "model.layers"

    @classmethod
    def of(cls, top: Dict[str, str], layer: Dict[str, str], segments=("blocks",), layer_prefix="model.layers"):
        return cls(tuple(top.items()), tuple(layer.items()), tuple(segments), layer_prefix)


# The safetensors header entry (a JSON object: HF name of each global scale -> the hex float32
# bits of the amax it was computed from) that export_hf writes for NVFP4 kernels: their
# ``weight_global_scale`` (compressed-tensors) or ``weight_scale_2`` (ModelOpt), and with
# calibrated activations their ``input_global_scale`` or ``input_scale``.
AMAX_METADATA = "jax_nvfp4.amax"
# transformers' name of a causal LM's head, a module of its own even where tie_word_embeddings shares the embedding.
TIED_HEAD = "lm_head"

# The layouts of ``export_hf(..., fmt="nvfp4")``: compressed-tensors' ``nvfp4-pack-quantized``
# (the default) and NVIDIA ModelOpt's unified Hugging Face checkpoint.
HF_LAYOUTS = ("compressed-tensors", "modelopt")

# compressed-tensors' ``NVFP4A16`` preset (NVFP4 weights in 1x16 groups with E4M3 scales and a
# float32 global scale; bf16 activations), as ``QuantizationConfig.model_dump_json`` writes it
# (compressed-tensors 0.20). Weight-only: the model was trained with bf16 activations.
NVFP4A16_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}}},
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
}

# compressed-tensors' ``NVFP4`` preset (W4A4, compressed-tensors' quant_scheme.py): the weights
# as in NVFP4A16, and the activation entering each Linear in 1x16 groups whose E4M3 scales are
# computed at run time ("dynamic": "local") under a static float32 global scale, the
# checkpoint's ``input_global_scale = 448 * 6 / input_amax`` (its observer, ``static_minmax``:
# the largest |x| over the calibration batches). The preset's ``zp_dtype`` (serialized as null
# for symmetric args) is left out, as in NVFP4A16.
NVFP4_QUANTIZATION_CONFIG = {
    **NVFP4A16_QUANTIZATION_CONFIG,
    "config_groups": {"group_0": {
        **NVFP4A16_QUANTIZATION_CONFIG["config_groups"]["group_0"],
        "input_activations": {
            "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": "local", "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn"}}},
}

# NVIDIA ModelOpt's unified Hugging Face checkpoint (modelopt.torch.export.export_hf_checkpoint),
# as TensorRT-LLM, vLLM (``modelopt_fp4``), SGLang and Megatron-Bridge read it: per NVFP4 Linear
# ``weight`` (packed E2M1 ``[out, in/2] uint8``, element 2k in the low nibble),
# ``weight_scale`` (E4M3 ``[out, in/16]``), ``weight_scale_2`` (float32 scalar: the global
# DECODE scale, ``1 / weight_global_scale``) and, for W4A4, ``input_scale`` (float32 scalar:
# the activation's global decode scale, ``input_amax / (448 * 6)``); its quantization config in
# ``hf_quant_config.json`` and, converted as ModelOpt converts it, in config.json. The producer
# names the format: ModelOpt 0.45 is the first release that writes weight-only NVFP4
# (``W4A16_NVFP4``; ``NVFP4`` is W4A4).
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.45.0"}
MODELOPT_QUANT_CONFIG_FILE = "hf_quant_config.json"


def modelopt_quant_config(exclude_modules, *, activations: bool = False) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(hf_quant_config.json, config.json quantization_config)`` of a ModelOpt NVFP4
    checkpoint whose Linear modules but ``exclude_modules`` are NVFP4 in groups of 16 inputs:
    ``quant_algo`` ``"W4A16_NVFP4"`` (weight-only) or, with ``activations``, ``"NVFP4"`` (W4A4,
    each module's ``input_scale`` calibrated). The second is what ModelOpt's
    ``convert_hf_quant_config_format`` makes of the first."""
    algo = "NVFP4" if activations else "W4A16_NVFP4"
    exclude = sorted(set(exclude_modules))
    hf_quant = {"producer": dict(MODELOPT_PRODUCER), "quantization": {
        "quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}}
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"input_activations": dict(args), "weights": dict(args)} if activations else {"weights": dict(args)}
    config = {"config_groups": {"group_0": {**group, "targets": ["Linear"]}}, "ignore": exclude, "quant_algo": algo,
              "producer": dict(MODELOPT_PRODUCER), "quant_method": "modelopt"}
    return hf_quant, config


def nvfp4_to_compressed_tensors(q: NVFP4Array) -> Dict[str, np.ndarray]:
    """``[..., in, out]`` kernels (16x16 tiles or ``(16, 1)`` blocks; leading axes are batch
    axes, e.g. layers) as compressed-tensors' NVFP4 tensors of the ``[..., out, in]`` torch
    weights, bit for bit, without re-quantizing:

    - ``weight_packed`` ``[..., out, in/2] uint8``: the codes of ``q.T`` (element ``2k`` in the
      low nibble, as here);
    - ``weight_scale`` ``[..., out, in/16] float8_e4m3fn``: the ``(16, 1)`` blocks' scales
      transposed (they are compressed-tensors' groups of 16 inputs), or each 16x16 tile's
      scale repeated on its 16 rows;
    - ``weight_global_scale`` ``[..., 1] float32``: ``S = 448 * 6 / amax``, the global encode
      scale (compressed-tensors decodes ``fp4 * scale / S``).
    """
    if q.block not in (BLOCK_2D, BLOCK_COLUMN):
        raise ValueError(f"nvfp4_to_compressed_tensors: needs 16x16 tiles or (16, 1) blocks (groups of 16 "
                         f"inputs), got {q}")
    why = nvfp4_layout_refusal(q.block, q.shape[-2])
    if why:
        raise ExportError(why)
    return {k: np.asarray(v) for k, v in _to_compressed_tensors(q).items()}


def nvfp4_layout_refusal(block, n_in: int, layout: str = "compressed-tensors") -> str:
    """Why the NVFP4 layout ``layout`` (compressed-tensors' or ModelOpt's: both groups of 16
    inputs) cannot hold a kernel of ``block`` and ``n_in`` input features (empty if it can)."""
    if tuple(block) not in (BLOCK_2D, BLOCK_COLUMN):
        return f"a kernel with {tuple(block)} blocks: {layout} NVFP4 needs groups of 16 inputs"
    if n_in % 16:
        return f"a kernel with {n_in} input features: {layout} NVFP4 needs a multiple of 16"
    return ""


def amax_from_global_scale(s, recorded: Optional[int] = None) -> np.float32:
    """An amax whose global encode scale (:func:`jax_nvfp4.numerics.global_encode_scale`, as
    ``weight_global_scale`` holds it) is ``s`` exactly, computed on the host (nothing compiles):
    the ``recorded`` one (float32 bits, :data:`AMAX_METADATA`) where its scale is ``s``, else
    ``448 * 6 / s`` or the nearest of its float32 neighbours (up to 8 ulps) whose scale is ``s``.
    One scale may come from several amaxes; they all dequantize alike.

    Raises:
      ValueError: ``s`` is not a positive finite number.
    """
    from jax_nvfp4 import numerics as nx

    def encode(a):  # global_encode_scale of one float32 amax, in NumPy
        with np.errstate(divide="ignore", over="ignore"):
            v = np.minimum(nx.E4M3_MAX * nx.E2M1_MAX / np.float32(a), nx.F32_MAX)
        return np.float32(1) if v == 0 else np.float32(v)

    s = np.float32(s)
    if recorded is not None and encode(np.uint32(recorded).view(np.float32)) == s:
        return np.uint32(recorded).view(np.float32)
    if not np.isfinite(s) or s <= 0:
        raise ValueError(f"global scale {s} is not a positive finite number")
    if s >= nx.F32_MAX:
        return np.float32(0)
    a = np.float32(nx.E4M3_MAX * nx.E2M1_MAX / s)
    bits = int(a.view(np.uint32))
    for k in (0, *(d for i in range(1, 9) for d in (i, -i))):
        if encode(np.uint32(bits + k).view(np.float32)) == s:
            return np.uint32(bits + k).view(np.float32)
    return a


def scales_per_tile(scale: np.ndarray) -> Optional[np.ndarray]:
    """compressed-tensors' or ModelOpt's ``[..., out, in/16]`` scales as one per 16x16 tile,
    ``[..., ceil(out/16), in/16]`` (the export repeats each tile's scale on its 16 rows), or None
    where they differ inside a tile."""
    tiles = scale[..., ::16, :]
    repeated = np.repeat(tiles, 16, axis=-2)[..., :scale.shape[-2], :]
    return tiles if np.array_equal(repeated.view(np.uint8), scale.view(np.uint8)) else None


def nvfp4_to_modelopt(q: NVFP4Array) -> Dict[str, np.ndarray]:
    """``[..., in, out]`` kernels as ModelOpt's NVFP4 tensors of the ``[..., out, in]`` torch
    weights, bit for bit, without re-quantizing: ``weight`` and ``weight_scale`` are
    compressed-tensors' ``weight_packed`` and ``weight_scale``
    (:func:`nvfp4_to_compressed_tensors`), ``weight_scale_2`` ``[...] float32`` the global
    decode scale ``D = 1 / (448 * 6 / amax)`` that :func:`jax_nvfp4.dequantize` multiplies by,
    so ``(e2m1 * weight_scale) * weight_scale_2`` is the trained weight exactly. (ModelOpt's
    own quantizer computes ``amax / (448 * 6)``: the same value, or one float32 ulp away.)"""
    if q.block not in (BLOCK_2D, BLOCK_COLUMN):
        raise ValueError(f"nvfp4_to_modelopt: needs 16x16 tiles or (16, 1) blocks (groups of 16 inputs), got {q}")
    why = nvfp4_layout_refusal(q.block, q.shape[-2], "ModelOpt")
    if why:
        raise ExportError(why)
    return {k: np.asarray(v) for k, v in _to_modelopt(q).items()}


@jax.jit
def _to_compressed_tensors(q: NVFP4Array):
    from jax_nvfp4 import numerics as nx

    t = q.T  # [..., out, in]: codes and scales transposed, no re-quantization
    n_out = t.shape[-2]
    scale = t.scale if t.block == BLOCK_1D else jnp.repeat(t.scale, 16, axis=-2)[..., :n_out, :]
    return {"weight_packed": t.data, "weight_scale": scale,
            # NaN for a non-finite matrix (as its decode scale): never a plausible weight.
            "weight_global_scale": jnp.where(jnp.isfinite(t.amax), nx.global_encode_scale(t.amax),
                                             jnp.float32(jnp.nan))[..., None]}


@jax.jit
def _to_modelopt(q: NVFP4Array):
    from jax_nvfp4 import numerics as nx

    ct = _to_compressed_tensors(q)
    return {"weight": ct["weight_packed"], "weight_scale": ct["weight_scale"],
            "weight_scale_2": nx.global_decode_scale(q.amax)}


@jax.jit
def _dequantized_bf16(q: NVFP4Array):
    return dequantize(q, jnp.bfloat16)


def _segment_offsets(flat, segments) -> Dict[str, int]:
    sizes: Dict[str, int] = {}
    for path, leaf in flat:
        seg = path.split("/", 1)[0]
        if seg in segments and "/" in path:
            sizes[seg] = int(leaf.shape[0])
    offsets, n = {}, 0
    for seg in segments:
        offsets[seg] = n
        n += sizes.get(seg, 0)
    return offsets


def is_linear(path: str) -> bool:
    """Whether the parameter at ``path`` is a Flax ``[in, out]`` kernel, whose Hugging Face
    tensor is the transposed ``[out, in]`` Linear weight (embeddings and norm scales keep their
    orientation)."""
    return path == "kernel" or path.endswith("/kernel")  # "kernel": a model that is one Dense


def hf_modules(params, names: HFNames) -> List[tuple]:
    """The one map between a params tree and Hugging Face module names (``names``):
    ``[(path, leaf, [(module, index)])]`` for every leaf of ``params`` (logical or stored,
    concrete or abstract: only ``leaf.shape`` is read), where ``module`` is the HF module
    (``model.layers.3.self_attn.q_proj``; its tensors are ``module.weight`` or the
    compressed-tensors ``module.weight_packed`` ...) and ``index`` the leaf's stacked-layer
    index (``()`` for unstacked leaves). Export and import both read it.

    Raises:
      ExportError: a parameter ``names`` does not name.
    """
    top, layer = dict(names.top), dict(names.layer)
    flat = [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_param)[0]]
    offsets = _segment_offsets(flat, names.segments)
    out = []
    for path, leaf in flat:
        seg, _, rest = path.partition("/")
        if path in top:
            out.append((path, leaf, [(top[path], ())]))
        elif seg in names.segments and rest in layer:
            out.append((path, leaf, [(f"{names.layer_prefix}.{offsets[seg] + i}.{layer[rest]}", (i,))
                                     for i in range(int(leaf.shape[0]))]))
        else:
            raise ExportError(f"export_hf: parameter {path!r} has no Hugging Face name")
    return out


def _is_param(x) -> bool:
    from jax_nvfp4.layout import is_tiled

    return is_nvfp4(x) or is_tiled(x)


def check_hf(params, names: HFNames, *, fmt: str = "bf16", layout: str = "compressed-tensors") -> None:
    """Raise ExportError (one line) if :func:`export_hf` could not write ``params`` in ``fmt``:
    a parameter without a Llama counterpart, or (``"nvfp4"``) an NVFP4 kernel that the
    ``layout``'s NVFP4 (compressed-tensors' or ModelOpt's, groups of 16 inputs both) cannot
    hold. Reads only shapes: ``params`` may be logical arrays or ``jax.eval_shape`` structures
    of them, so a run can be checked before it trains."""
    _check_layout(layout)
    for path, leaf, _ in hf_modules(params, names):
        why = is_nvfp4(leaf) and fmt == "nvfp4" and is_linear(path) and nvfp4_layout_refusal(
            leaf.block, leaf.shape[-2], "ModelOpt" if layout == "modelopt" else layout)
        if why:
            raise ExportError(f"export_hf: {path}: {why}")


def _check_layout(layout: str) -> None:
    if layout not in HF_LAYOUTS:
        raise ValueError(f"layout must be one of {HF_LAYOUTS}, got {layout!r}")


def _input_amax_of(input_amax: Dict[str, Any], path: str, leaf) -> np.ndarray:
    """The calibrated input amax ``[*batch] float32`` of the NVFP4 kernel at ``path``."""
    if path not in input_amax:
        raise ExportError(f"export_hf: no input amax for the NVFP4 kernel {path!r} (calibrate every NVFP4 Linear)")
    a = np.asarray(jax.device_get(input_amax[path]), np.float32)
    batch = tuple(leaf.shape[:-2])
    if a.shape != batch:
        raise ExportError(f"export_hf: the input amax of {path!r} has shape {a.shape}, its kernel {batch} matrices")
    if not (np.all(np.isfinite(a)) and np.all(a > 0)):
        raise ExportError(f"export_hf: the input amax of {path!r} is not positive and finite: {a.ravel()[:4]}")
    return a


def hf_tensors(params, names: HFNames, *, fmt: str = "bf16", amax: Optional[Dict[str, int]] = None,
               layout: str = "compressed-tensors", input_amax: Optional[Dict[str, Any]] = None):
    """``(tensors, ignore)``: an iterator of ``(HF name, numpy array)`` for ``params`` in the
    HF layout ``names`` gives, and (``fmt="nvfp4"``) the names of Linear modules left in bf16.

    ``fmt="bf16"``: every tensor bf16, the NVFP4 leaves dequantized (``dequantize``).
    ``fmt="nvfp4"``: NVFP4 kernels as :func:`nvfp4_to_compressed_tensors` (``layout``
    ``"compressed-tensors"``) or :func:`nvfp4_to_modelopt` (``"modelopt"``); the rest bf16.
    ``input_amax`` (``fmt="nvfp4"``): ``{param path of each NVFP4 kernel: its calibrated
    input amax, [*batch] float32}`` (:func:`jax_nvfp4.calibrate.input_amax`); each NVFP4 Linear then
    also gets its activation's global scale: ``input_global_scale [1] = 448 * 6 / input_amax``
    (compressed-tensors) or ``input_scale [] = 1 / that`` (ModelOpt).
    ``amax``: a dict filled, as the tensors are produced, with ``{HF name of a global scale
    (weight's and input's): the float32 bits of the exact amax behind it}`` (``448 * 6 / S``
    does not always give the amax back: neighbouring amaxes can share one global scale).

    Call on every process of a multi-process run (sharded leaves are gathered).
    """
    from jax_nvfp4 import numerics as nx
    from jax_nvfp4.sharding import logical

    if fmt not in ("bf16", "nvfp4"):
        raise ValueError(f"fmt must be 'bf16' or 'nvfp4', got {fmt!r}")
    _check_layout(layout)
    if input_amax is not None and fmt != "nvfp4":
        raise ValueError("input_amax (calibrated activations) needs fmt='nvfp4'")
    modelopt = layout == "modelopt"
    weight_scale, input_scale = ("weight_scale_2", "input_scale") if modelopt else ("weight_global_scale",
                                                                                     "input_global_scale")
    params = logical(params)  # stored (tile-major) params: their logical form
    modules_of = hf_modules(params, names)
    ignore = []

    def quantized(leaf, path) -> bool:
        return is_nvfp4(leaf) and fmt == "nvfp4" and is_linear(path)

    def tensors(leaf, path, a_in):
        """``{suffix: [..., *shape] host array}`` for a whole (stacked) leaf, converted at once."""
        if quantized(leaf, path):
            out = nvfp4_to_modelopt(leaf) if modelopt else nvfp4_to_compressed_tensors(leaf)
            if a_in is not None:
                scale = nx.global_decode_scale(a_in) if modelopt else nx.global_encode_scale(a_in)[..., None]
                out[input_scale] = np.asarray(scale, np.float32)
            return out
        value = np.asarray(_dequantized_bf16(leaf)) if is_nvfp4(leaf) else np.asarray(jnp.asarray(leaf, jnp.bfloat16))
        return {"weight": np.swapaxes(value, -1, -2) if is_linear(path) else value}

    # Checked before any tensor is produced: a missing or bad input amax writes nothing.
    inputs = {path: _input_amax_of(input_amax, path, leaf) for path, leaf, _ in modules_of
              if input_amax is not None and quantized(leaf, path)}

    def gen():
        for path, leaf, modules in modules_of:
            if is_nvfp4(leaf):
                host = NVFP4Array(host_array(leaf.data), host_array(leaf.scale_bits), host_array(leaf.amax_bits),
                                  leaf.matrix_shape, leaf.block)
            else:
                host = host_array(leaf)
            a_in = inputs.get(path)
            arrays = tensors(host, path, a_in)
            for module, idx in modules:
                if fmt == "nvfp4" and is_linear(path) and not quantized(leaf, path):
                    ignore.append(module)
                if quantized(leaf, path) and amax is not None:
                    amax[f"{module}.{weight_scale}"] = int(np.asarray(host.amax_bits)[idx])
                    if a_in is not None:
                        amax[f"{module}.{input_scale}"] = int(a_in[idx].view(np.uint32))
                for suffix, a in arrays.items():
                    yield f"{module}.{suffix}", a[idx]

    return gen(), ignore


def _sort_metadata(path: str) -> None:
    """The header metadata of the safetensors file ``path`` in key order. The writer serializes it
    from a hash map whose order changes from one call to the next, so the same export would differ
    in its bytes; sorted, the same tensors and metadata are the same file. In place: the header
    keeps its length."""
    with open(path, "r+b") as f:
        (n,) = np.frombuffer(f.read(8), "<u8")
        header, prefix = f.read(int(n)).decode(), '{"__metadata__":'
        if not header.startswith(prefix):
            return
        start = len(prefix)
        meta, end = json.JSONDecoder().raw_decode(header, start)
        text = json.dumps(dict(sorted(meta.items())), separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) == len(header[start:end].encode()):
            f.seek(8 + len(header[:start].encode()))
            f.write(text.encode())


def _write_safetensors(tensors, directory: str, max_shard_bytes: int, metadata=None) -> None:
    """``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + the index, written shard by
    shard (at most about one shard in memory). ``metadata(names)``: more string entries for the
    header of the shard holding the tensors ``names``."""
    from safetensors.numpy import save_file

    shards, current, size = [], {}, 0
    # The writer leaves its files 0600, unreadable to a server running as another user: they take the mode a
    # file open() creates here has (the umask's), as the config beside them.
    probe = os.path.join(directory, ".mode")
    open(probe, "w").close()
    mode = os.stat(probe).st_mode & 0o777
    os.remove(probe)

    def flush():
        nonlocal current, size
        if current:
            name = f"shard-{len(shards):05d}.tmp"
            meta = {"format": "pt", **(metadata(list(current)) if metadata else {})}
            save_file(current, os.path.join(directory, name), metadata=meta)
            _sort_metadata(os.path.join(directory, name))
            os.chmod(os.path.join(directory, name), mode)
            shards.append((name, list(current)))
            current, size = {}, 0

    total = 0
    for name, value in tensors:
        arr = np.ascontiguousarray(value).reshape(np.shape(value))  # a scalar stays 0-d
        if size and size + arr.nbytes > max_shard_bytes:
            flush()
        current[name] = arr
        size += arr.nbytes
        total += arr.nbytes
    flush()
    if len(shards) == 1:
        os.rename(os.path.join(directory, shards[0][0]), os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    for k, (tmp, keys) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(os.path.join(directory, tmp), os.path.join(directory, final))
        weight_map.update({key: final for key in keys})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def export_hf(params, config: Dict[str, Any], directory: str, *, names: HFNames, fmt: str = "bf16",
              layout: str = "compressed-tensors", input_amax: Optional[Dict[str, Any]] = None,
              files: Optional[Dict[str, Any]] = None, max_shard_bytes: int = 5 << 30) -> str:
    """Write a Hugging Face checkpoint of ``params`` into ``directory``.

    Args:
      config: the ``config.json`` (the training stack's Llama: ``train.model.hf_config``).
      names: the params' Hugging Face names (:class:`HFNames`; ``train.model.HF_NAMES``).
      fmt: ``"bf16"``: dequantized bf16 weights (``transformers`` loads them as they are).
        ``"nvfp4"``: NVFP4 kernels in the ``layout`` (lossless: the same codes, scales and
        amax), the quantization config in ``config.json``; leaves that are not NVFP4
        (embeddings, norms, kept layers, the head) stay bf16, their Linear modules listed in
        ``ignore`` (``exclude_modules``), and so is :data:`TIED_HEAD` where ``config`` has
        ``tie_word_embeddings``.
      layout: with ``fmt="nvfp4"``, ``"compressed-tensors"`` (``nvfp4-pack-quantized``,
        :func:`nvfp4_to_compressed_tensors`; :data:`NVFP4A16_QUANTIZATION_CONFIG`) or
        ``"modelopt"`` (:func:`nvfp4_to_modelopt`, plus ``hf_quant_config.json``:
        :func:`modelopt_quant_config`; read back with :func:`read_modelopt`).
      input_amax: with ``fmt="nvfp4"``, the calibrated input amax of every NVFP4 kernel
        (``{param path: [*batch] float32}``, :func:`jax_nvfp4.calibrate.input_amax`): the checkpoint is
        then W4A4 (:data:`NVFP4_QUANTIZATION_CONFIG` with ``input_global_scale``, or ModelOpt
        ``NVFP4`` with ``input_scale``); without it, weight-only.
      files: more files of the checkpoint (e.g. its tokenizer's), ``{name: path}`` copied as
        they are or ``{name: bytes}`` written; they land with the weights, atomically.

    ``fmt="nvfp4"`` also records each NVFP4 kernel's exact float32 amax (and input amax) in the
    safetensors header (:data:`AMAX_METADATA`), which readers ignore: the global scale
    ``448 * 6 / amax`` alone does not always give the amax back, and a checkpoint read back by
    :func:`jax_nvfp4.hf.load_hf` (compressed-tensors, weight-only) or :func:`read_modelopt` is then
    bit-identical to the exported params. An NVFP4 leaf that is not a Linear kernel (an NVFP4
    embedding, as the default :class:`~jax_nvfp4.Policy` stores ``nn.Embed``'s) has no NVFP4 form
    in these formats: it is written as bf16 dequantized values and reads back re-quantized from
    them (within bf16 rounding, not bit-identical); keep embeddings out of the policy
    (``keep=("embed",)``) for a lossless round trip.

    Call it on every process; process 0 writes. Returns ``directory``.

    Raises:
      FileExistsError: ``directory`` exists and is not empty (nothing is written).
      ExportError: a parameter ``names`` does not name, a kernel ``fmt`` cannot hold
        (:func:`check_hf`), or non-finite NVFP4 amax; nothing is written.
    """
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise FileExistsError(f"export_hf: {directory} exists and is not empty")
    from jax_nvfp4.sharding import logical

    params = logical(params)
    check_hf(params, names, fmt=fmt, layout=layout)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_nvfp4)[0]:
        if is_nvfp4(leaf) and not bool(jnp.all(leaf.isfinite())):
            raise ExportError(f"export_hf: leaf {path_str(path)!r} has a non-finite amax (NaN or Inf); nothing written")
    amax: Dict[str, int] = {}
    tensors, ignore = hf_tensors(params, names, fmt=fmt, amax=amax, layout=layout, input_amax=input_amax)
    if jax.process_index() != 0:
        for _ in tensors:  # the other processes take part in the gathers
            pass
        return directory
    parent = os.path.dirname(directory) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
        def metadata(keys):
            mine = {k: f"{amax[k]:08x}" for k in keys if k in amax}
            return {AMAX_METADATA: json.dumps(mine, sort_keys=True)} if mine else {}

        _write_safetensors(tensors, tmp, max_shard_bytes, metadata)
        cfg = dict(config)
        if fmt == "nvfp4" and config.get("tie_word_embeddings"):
            # transformers' head of a tied model, lm_head, is a Linear with no weights of its own: quantization
            # formats' Linear targets would make it an NVFP4 module with nothing to load.
            ignore.append(TIED_HEAD)
        if fmt == "nvfp4" and layout == "modelopt":
            hf_quant, cfg["quantization_config"] = modelopt_quant_config(ignore, activations=input_amax is not None)
            with open(os.path.join(tmp, MODELOPT_QUANT_CONFIG_FILE), "w") as f:
                json.dump(hf_quant, f, indent=2)
        elif fmt == "nvfp4":
            base = NVFP4_QUANTIZATION_CONFIG if input_amax is not None else NVFP4A16_QUANTIZATION_CONFIG
            cfg["quantization_config"] = dict(base, ignore=sorted(set(ignore)))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        for name, source in (files or {}).items():
            if isinstance(source, bytes):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(source)
            else:
                shutil.copyfile(source, os.path.join(tmp, name))
        os.chmod(tmp, 0o755)
        if os.path.isdir(directory):
            os.rmdir(directory)  # empty, checked above
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# ----------------------------------------------------------------------------- reading safetensors

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


_MAPPED = ("F8_E4M3",)


@dataclasses.dataclass(frozen=True)
class Read:
    """One slice of one stored tensor: ``tensor[index]`` (a ``slice`` per axis, in bounds),
    ``nbytes`` long (:meth:`Safetensors.request`)."""

    tensor: str
    index: Tuple[slice, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a :class:`Safetensors` folder: its file's name there, safetensors dtype
    (``BF16``, ``F8_E4M3``...), shape and the offset of its first byte in the file."""

    file: str
    dtype: str
    shape: Tuple[int, ...]
    offset: Optional[int]


class Safetensors:
    """The tensors of a Hugging Face checkpoint folder (``model.safetensors``, else the shards of
    ``model.safetensors.index.json``: transformers' order) read by slices (:meth:`array`: only the touched pages).
    ``entries``: ``{tensor: SafetensorsEntry}``; ``amax``: ``{HF name of a global scale: float32
    bits of the exact amax}``, every shard's :data:`AMAX_METADATA`; ``reads``: every
    :class:`Read` served by :meth:`read`, in order.

    Raises:
      ExportError: ``"{directory}: ..."``: no safetensors file, an unreadable index or one naming
        a file outside the folder, unreadable :data:`AMAX_METADATA`, a file safetensors' own reader refuses (truncated or corrupt), a
        tensor in two files or not in the one the index names.
    """

    def __init__(self, directory: str):
        import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy, for safetensors' NumPy reader
        from safetensors import safe_open

        self.directory, self.entries, self.amax, self.reads = directory, {}, {}, []
        index, weight_map = os.path.join(directory, "model.safetensors.index.json"), {}
        if os.path.isfile(os.path.join(directory, "model.safetensors")):  # first, as transformers reads them
            files = ["model.safetensors"]
        elif os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
                raise ExportError(f"{directory}: cannot read model.safetensors.index.json: {e}") from None
            if outside := [n for n in files if not isinstance(n, str) or os.path.isabs(n) or ".." in n.split("/")]:
                raise ExportError(f"{directory}: model.safetensors.index.json names {outside[0]!r}, not a file of "
                                  "this folder")
        else:
            raise ExportError(f"{directory}: no model.safetensors (nor model.safetensors.index.json)")
        self._files = {}  # file name -> its safetensors.safe_open
        for name in files:
            path = os.path.join(directory, name)
            try:  # its checks: the header, and tensors back to back up to the file's end
                f = self._files[name] = safe_open(path, framework="numpy")
            except OSError as e:
                raise ExportError(f"{directory}: cannot open {name}: {e.strerror or e}") from None
            except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError
                raise ExportError(f"{directory}: {name} is not a complete safetensors file (truncated or corrupt?): "
                                  f"{e}") from None
            meta = f.metadata() or {}
            try:
                self.amax.update({k: int(v, 16) for k, v in json.loads(meta.get(AMAX_METADATA, "{}")).items()})
            except (ValueError, AttributeError, TypeError) as e:
                raise ExportError(f"{directory}: {name}: unreadable {AMAX_METADATA} metadata: {e}") from None
            # safe_open checked that the tensors lie back to back in offset_keys() order and end the
            # file, so each one's offset follows from the sizes (for the memory map of the dtypes
            # safetensors' NumPy reader cannot build).
            shapes = [(t, sl.get_dtype(), tuple(sl.get_shape())) for t, sl in ((t, f.get_slice(t)) for t in f.offset_keys())]
            sizes = [(jnp.dtype(_ST_DTYPES[d]).itemsize if d in _ST_DTYPES else math.nan) * math.prod(sh)
                     for _, d, sh in shapes]
            offset = os.path.getsize(path) - sum(sizes)
            for (t, dtype, shape), size in zip(shapes, sizes):
                if t in self.entries:
                    raise ExportError(f"{directory}: {t} is in both {self.entries[t].file} and {name}")
                self.entries[t] = SafetensorsEntry(name, dtype, shape, None if math.isnan(offset) else int(offset))
                offset += size
        for t, name in weight_map.items():
            if t not in self.entries or self.entries[t].file != name:
                raise ExportError(f"{directory}: model.safetensors.index.json maps {t} to {name}, which does not "
                                  "hold it")

    def __contains__(self, tensor: str) -> bool:
        return tensor in self.entries

    def numpy_dtype(self, tensor: str) -> np.dtype:
        dtype = self.entries[tensor].dtype
        if dtype not in _ST_DTYPES:
            raise ExportError(f"{self.directory}: {tensor} is {dtype}, a safetensors dtype not read here")
        return jnp.dtype(_ST_DTYPES[dtype])

    def expect(self, tensor: str, dtypes: Optional[Tuple[str, ...]], shape) -> None:
        """Raise ExportError unless ``tensor`` is here, of ``shape`` and (``dtypes`` given) one of ``dtypes``."""
        e = self.entries.get(tensor)
        if e is None or e.shape != tuple(shape) or (dtypes and e.dtype not in dtypes):
            got = f"{e.dtype}{list(e.shape)}" if e else "missing"
            raise ExportError(f"{self.directory}: tensor {tensor} is {got}, expected "
                              f"{' or '.join(dtypes or ())}{list(shape)}")

    def request(self, tensor: str, *index: slice) -> Read:
        """The :class:`Read` of ``tensor[index]`` (a slice per leading axis; the rest whole).
        Nothing is read."""
        shape = self.entries[tensor].shape
        index = tuple(slice(*s.indices(d)) for s, d in zip(index + (slice(None),) * (len(shape) - len(index)), shape))
        n = math.prod(len(range(s.start, s.stop, s.step)) for s in index)
        return Read(tensor, index, n * self.numpy_dtype(tensor).itemsize)

    def read(self, r: Read) -> np.ndarray:
        """``r.tensor[r.index]`` in its stored dtype (:meth:`array` with ``finite``), recorded in
        ``reads``. Raises ExportError: a NaN or Inf in it (or a NaN E4M3 byte)."""
        out = self.array(r.tensor, r.index, finite=True)
        self.reads.append(r)
        return out

    def array(self, tensor: str, index: Tuple[slice, ...] = (), *, finite: bool = False) -> np.ndarray:
        """``tensor[index]`` (a slice per axis) as a NumPy array of its stored dtype, bfloat16 and float8 too.
        Raises ExportError with ``finite``: a NaN or Inf in it (naming the first one's position)."""
        e, dtype = self.entries[tensor], self.numpy_dtype(tensor)
        index = tuple(index) + (slice(None),) * (len(e.shape) - len(index))
        index = tuple(slice(*s.indices(d)) for s, d in zip(index, e.shape))  # in bounds, as safetensors needs
        if not all(e.shape):  # nothing to map
            return np.zeros(e.shape, dtype)[index]
        if e.dtype in _MAPPED:  # dtypes safetensors' NumPy reader has no type for
            if e.offset is None:
                raise ExportError(f"{self.directory}: {tensor}: {e.file} holds a tensor of a dtype of unknown size "
                                  "before it")
            out = np.array(np.memmap(os.path.join(self.directory, e.file), dtype, mode="r", offset=e.offset,
                                     shape=e.shape)[index])
        else:
            sl = self._files[e.file].get_slice(tensor)
            out = np.asarray(sl[index] if index else sl[...], dtype)
        bad = ~np.isfinite(out) if finite and jnp.issubdtype(dtype, jnp.floating) else None
        if bad is not None and bad.any():
            at = [int(i) + s.indices(n)[0] for i, s, n in zip(np.argwhere(bad)[0], index, e.shape)]
            what = "a NaN E4M3 scale byte" if e.dtype == "F8_E4M3" else "a non-finite value (NaN or Inf)"
            raise ExportError(f"{self.directory}: {tensor} holds {what} at {at}")
        return out


def read_modelopt(directory: str, like, *, names: HFNames) -> Tuple[Any, Dict[str, np.ndarray]]:
    """Read a ModelOpt NVFP4 checkpoint (``export_hf(..., fmt="nvfp4", layout="modelopt")``)
    back into params: ``(params, input_amax)``.

    ``params`` has the logical structure of ``like`` (logical or stored params, or their
    ``jax.eval_shape``): each Linear stored in NVFP4 (a ``weight_scale_2``) comes back as an
    :class:`NVFP4Array` with the block of ``like``'s leaf (``(16, 1)`` where ``like``'s leaf is
    not NVFP4; 16x16 tiles when its scales repeat over each 16 output rows) and every other
    leaf as the checkpoint's array (Linear weights transposed back to ``[in, out]``), stacked
    layers restacked. The amax of each NVFP4 kernel is read from the header
    (:data:`AMAX_METADATA`), so an export of this library reads back bit for bit (codes,
    scales, amax); a checkpoint without it gets ``weight_scale_2 * 448 * 6``, whose decode
    scale may be one ulp from ``weight_scale_2``. ``input_amax``: ``{param path: [*batch]
    float32}`` of the NVFP4 kernels with an ``input_scale`` (W4A4 exports), from the header
    likewise (else ``input_scale * 448 * 6``).

    Raises:
      ExportError: no safetensors file, a tensor missing or of the wrong dtype or shape, or
        scales that do not fit the requested 16x16 tiles.
    """
    from jax_nvfp4.array import transpose
    from jax_nvfp4.sharding import logical

    directory = os.path.abspath(os.fspath(directory))
    files = Safetensors(directory)
    like = jax.eval_shape(logical, like)
    flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_param)

    def tensor(name, dtype, shape):
        files.expect(name, (dtype,), shape)
        return files.array(name)

    def amax_bits(name, value) -> np.uint32:
        if name in files.amax:
            return np.uint32(files.amax[name])
        return (np.float32(value) * np.float32(448 * 6)).view(np.uint32)

    values, input_amax = {}, {}
    for path, leaf, modules in hf_modules(like, names):
        batch = (len(modules),) if modules[0][1] else ()  # stacked layers: one leading axis
        if is_linear(path) and f"{modules[0][0]}.weight_scale_2" in files:
            n_in, n_out = leaf.shape[-2:]
            data, scale, bits, a_in = [], [], [], []
            for module, _ in modules:
                data.append(tensor(f"{module}.weight", "U8", (n_out, (n_in + 1) // 2)))
                scale.append(tensor(f"{module}.weight_scale", "F8_E4M3", (n_out, -(-n_in // 16))))
                s2 = tensor(f"{module}.weight_scale_2", "F32", ())
                bits.append(amax_bits(f"{module}.weight_scale_2", s2))
                if f"{module}.input_scale" in files:
                    s_in = tensor(f"{module}.input_scale", "F32", ())
                    a_in.append(amax_bits(f"{module}.input_scale", s_in).view(np.float32))
            data = np.stack(data).reshape(*batch, *data[0].shape)
            scale = np.stack(scale).reshape(*batch, *scale[0].shape)
            bits = np.asarray(bits, np.uint32).reshape(batch)
            block = leaf.block if is_nvfp4(leaf) else BLOCK_COLUMN
            if block == BLOCK_2D:
                tiles = scales_per_tile(scale)
                if tiles is None:
                    raise ExportError(f"{directory}: {path}: the scales are not constant over 16 output rows; "
                                      "read it with (16, 1) blocks (a `like` leaf that is not 16x16-tiled)")
                t_block, scale = BLOCK_2D, tiles
            elif block == BLOCK_COLUMN:
                t_block = BLOCK_1D
            else:
                raise ExportError(f"{directory}: {path}: `like` has {tuple(block)} blocks; ModelOpt NVFP4 holds "
                                  "groups of 16 inputs ((16, 1) blocks or 16x16 tiles)")
            t = NVFP4Array(as_array(data), as_array(scale.view(np.uint8)), as_array(bits), (n_out, n_in), t_block)
            values[path] = transpose(t)  # [..., in, out]: codes and scales transposed, no re-quantization
            if a_in:
                input_amax[path] = np.asarray(a_in, np.float32).reshape(batch)
        else:
            shape = leaf.shape[-2:][::-1] if is_linear(path) else leaf.shape[len(batch):]
            parts = []
            for module, _ in modules:
                files.expect(f"{module}.weight", None, shape)
                a = files.array(f"{module}.weight")
                parts.append(np.swapaxes(a, -1, -2) if is_linear(path) else a)
            values[path] = as_array(np.stack(parts).reshape(*batch, *parts[0].shape))
    return jax.tree_util.tree_unflatten(treedef, [values[path_str(p)] for p, _ in flat]), input_amax
