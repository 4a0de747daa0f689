"""Hugging Face checkpoints read straight into the sharded training state: the inverse of
:func:`jax_nvfp4.export.export_hf`, for any params tree that an
:class:`~jax_nvfp4.export.HFNames` names.

:func:`load_hf` reads plain safetensors (bf16, f16, f32) or compressed-tensors'
``nvfp4-pack-quantized`` ones, one ``model.safetensors`` or shards with
``model.safetensors.index.json``, into params stored as :func:`jax_nvfp4.shard_params` stores
them and a fresh optimizer state of :func:`jax_nvfp4.master_weights`:

- NVFP4 Linear weights into NVFP4 params losslessly: codes and E4M3 scale bytes as they are
  (groups of 16 inputs are ``(16, 1)`` blocks; 16x16 tiles need scales that repeat over each
  tile, as the export writes them), the global scale becomes the amax (exactly the exported
  one where the header records it, :data:`~jax_nvfp4.export.AMAX_METADATA`); their float32
  masters are the dequantized values;
- plain weights are the masters, quantized (round to nearest, with the policy's shared amax
  groups) or cast to the params' dtype as the state stores them.

Each process reads only the slices its own devices store (a device's tiles of a matrix are at
most three rectangles of the ``[out, in]`` tensor), one device's block at a time, straight into
the target shardings; :func:`plan_hf` lists those reads from the headers and the abstract state
alone. Every check runs before anything compiles; a refusal is one
:class:`~jax_nvfp4.export.ExportError` line that starts with the folder (``"DIR: ..."``).
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_nvfp4 import numerics as nx
from jax_nvfp4.export import (ExportError, HFNames, Read, Safetensors, amax_from_global_scale, hf_modules, is_linear,
                              nvfp4_layout_refusal, scales_per_tile)
from jax_nvfp4.layout import TILE, Layout, Tiled, TiledNVFP4, is_tiled
from jax_nvfp4.optim import find_state
from jax_nvfp4.params import Policy, path_str, shared_amaxes
from jax_nvfp4.sharding import global_amax, requantize

__all__ = ["MixedLayersError", "TileScalesError", "load_hf", "plan_hf"]

# _Target kind -> (its tensor, logical rows (inputs) per entry: 2 codes a byte, 16 a scale; 0: all, per layer).
_READS = {"whole": ("weight", 0), "amax": ("weight_global_scale", 0), "values": ("weight", 1),
          "codes": ("weight_packed", 2), "scales": ("weight_scale", 16)}
# Tensors that are not weights, skipped: buffers of older transformers exports (config.json defines the positions;
# transformers skips them too) and a W4A4 checkpoint's activation scales (the model computes its own).
_SKIPPED = re.compile(r"\.rotary_emb\.inv_freq$|\.input_global_scale$")


class TileScalesError(ExportError):
    """A compressed-tensors NVFP4 weight whose scales (one per 16 inputs of each output) differ
    inside a 16x16 tile, read into a param of 16x16 tiles; ``(16, 1)`` blocks read it.
    ``module``: its Hugging Face module."""

    def __init__(self, directory: str, module: str):
        super().__init__(f"{directory}: {module}'s NVFP4 scales (one per 16 inputs of each output) differ inside a "
                         "16x16 tile; read it with (16, 1) blocks")
        self.module = module


class MixedLayersError(ExportError):
    """A stacked param whose layers the checkpoint stores partly NVFP4, partly plain (a quantizer that left some
    layers out); ``plain``: the plain layers' Hugging Face modules, ``param``: the param's path."""

    def __init__(self, directory: str, param: str, plain: Sequence[str], layers: int):
        shown = ", ".join(plain[:3]) + (f" and {len(plain) - 3} more" if len(plain) > 3 else "")
        super().__init__(f"{directory}: {param}: {len(plain)} of its {layers} layers are plain ({shown}), the others "
                         "NVFP4; read as one parameter, they must agree")
        self.param, self.plain = param, tuple(plain)


def _refuse(files: Safetensors, text: str):
    raise ExportError(f"{files.directory}: {text}")


class _Param:
    """The checkpoint tensors of one param (all its stacked layers, compressed-tensors' read into NVFP4 ``block``),
    checked, addressed in the params' orientation (a Flax ``[in, out]`` kernel is the ``[out, in]`` weight)."""

    def __init__(self, files: Safetensors, path: str, modules, shape: Tuple[int, ...], linear: bool, block):
        self.files, self.path, self.linear = files, path, linear
        self.module, self.layer_axes = {idx: m for m, idx in modules}, len(modules[0][1])
        self.layer_shape = tuple(shape[self.layer_axes:])
        for m, _ in modules:
            if f"{m}.weight" not in files.entries and f"{m}.weight_packed" not in files.entries:
                _refuse(files, f"the checkpoint has no {m}.weight (nor {m}.weight_packed) for the parameter {path}")
        plain = [m for m, _ in modules if f"{m}.weight" in files.entries]
        if 0 < len(plain) < len(modules):
            raise MixedLayersError(files.directory, path, plain, len(modules))
        self.kind = "plain" if plain else "nvfp4"
        if self.kind == "plain":
            want = {"weight": (("BF16", "F16", "F32"), self.layer_shape[::-1] if linear else self.layer_shape)}
        elif not linear or len(self.layer_shape) != 2:
            _refuse(files, f"{path}: compressed-tensors NVFP4 tensors for a parameter that is not a Linear weight")
        else:
            rows, cols = self.layer_shape
            why = nvfp4_layout_refusal(block, rows)
            if why:
                _refuse(files, f"{path}: {why}")
            want = {"weight_packed": (("U8",), (cols, rows // 2)), "weight_scale": (("F8_E4M3",), (cols, rows // 16)),
                    "weight_global_scale": (("F32",), (1,))}
        self.tensors = [f"{m}.{suffix}" for m, _ in modules for suffix in want]
        for t in self.tensors:
            files.expect(t, *want[t.rpartition(".")[2]])

    def request(self, layer, suffix: str, *band: slice) -> Read:
        """``layer``'s ``suffix`` tensor's :class:`Read`: ``band`` (logical rows, cols in its units) or all of it."""
        return self.files.request(f"{self.module[layer]}.{suffix}", *(band[::-1] if self.linear else band))

    def values(self, a: np.ndarray) -> np.ndarray:
        return a.astype(np.float32).T if self.linear and a.ndim == 2 else a.astype(np.float32)

    def amax_bits(self, a: np.ndarray, tensor: str) -> np.uint32:
        """The float32 bits of the amax behind the global scale ``a`` (the export's own where it recorded it)."""
        try:
            return np.float32(amax_from_global_scale(a.reshape(-1)[0], self.files.amax.get(tensor))).view(np.uint32)
        except ValueError as e:
            _refuse(self.files, f"{tensor}: {e}")


def _rectangles(lay: Layout, ti: int, tiles: range) -> List[Tuple[int, slice, slice]]:
    """The stored tiles ``tiles`` of tensor shard ``ti`` of ``lay`` (row-major in the shard's grid, as Layout stores
    them; padding dropped) as at most three rectangles of whole tiles: ``[(first position in tiles, rows, cols)]``."""
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
    packed in :func:`load_hf`'s program), ``amax`` (per layer) or ``whole`` (a replicated leaf)."""

    def __init__(self, shape, dtype, sharding, param: _Param, kind: str, layout=None, block=None):
        self.shape, self.dtype, self.sharding, self.param, self.kind, self.layout, self.block = \
            tuple(shape), dtype, sharding, param, kind, layout, block

    def parts(self, index) -> List[Tuple[Any, Read, Any]]:
        """``[(where in the block at index, Read, convert)]``: ``convert(the array read)`` is that part."""
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

    def _tiles(self, rect: Layout, a: np.ndarray, layer) -> np.ndarray:
        """The tiles of ``rect`` from ``a``, its band of the checkpoint's tensor."""
        if self.kind == "values":
            return rect.to_tiles(self.param.values(a))[0]
        if self.kind == "codes":
            return rect.to_tiles(a.T, 16, 8)[0]
        if tuple(self.block) == (16, 1):
            return rect.scales_to_tiles(a.view(np.uint8).T, (16, 1))[0]
        tiles = scales_per_tile(a)  # 16x16 tiles: one scale each, so the checkpoint's must repeat over the tile
        if tiles is None:
            raise TileScalesError(self.param.files.directory, self.param.module[layer])
        return rect.scales_to_tiles(tiles.view(np.uint8).T, (16, 16))[0]

    def fill(self, index) -> np.ndarray:
        """The block at ``index``, read from the checkpoint."""
        block = np.zeros([len(range(*s.indices(n))) for s, n in zip(index, self.shape)], self.dtype)
        for where, read, convert in self.parts(index):
            block[where] = convert(self.param.files.read(read))
        return block


def _is_target(x) -> bool:
    return isinstance(x, _Target)


def _targets(files: Safetensors, names: HFNames, abstract_params, abstract_state, mesh, *,
             tied: Optional[Tuple[str, str]], model: str, read_values: bool) -> List[Tuple[_Param, Any, Any, Any]]:
    """``[(param, abstract param, abstract master, its tree of _Target)]`` of the state; ``files`` checked."""
    sh = lambda spec: NamedSharding(mesh, spec)
    masters = find_state(abstract_state).master
    by_path = {path_str(p): m for p, m in jax.tree_util.tree_flatten_with_path(masters, is_leaf=is_tiled)[0]}
    leaves = []
    for path, a_p, modules in hf_modules(abstract_params, names):
        a_m, stored = by_path[path], isinstance(a_p, TiledNVFP4)
        block = tuple(a_p.block) if stored else (16, 1)
        param = _Param(files, path, modules, a_p.shape, is_linear(path), block)
        if param.kind == "nvfp4":  # into bf16 params: read in the master's tiles (or one tile list), dequantized
            lay = a_p.layout if stored else (a_m.layout if isinstance(a_m, Tiled) else Layout(tuple(a_p.shape[-2:])))
            batch, tail = tuple(a_p.shape[:-2]), () if block == (16, 16) else (16,)
            source = TiledNVFP4(
                _Target(lay.shape(batch, (8, 16)), np.uint8, sh(lay.spec(len(batch))), param, "codes", lay, block),
                _Target(lay.shape(batch, tail), np.uint8, sh(lay.spec(len(batch), len(tail))), param, "scales", lay,
                        block),
                _Target(batch, np.uint32, sh(P()), param, "amax"), lay, block)
        elif isinstance(a_m, Tiled):
            source = Tiled(_Target(a_m.value.shape, np.float32, sh(a_m.spec()), param, "values", a_m.layout),
                           a_m.layout)
        else:
            source = _Target(tuple(a_m.shape), np.float32, sh(P()), param, "whole")
        leaves.append((param, a_p, a_m, source))
    _check_tensors(files, [p for p, *_ in leaves], names, tied=tied, model=model, read_values=read_values)
    return leaves


def _check_tensors(files: Safetensors, params: List[_Param], names: HFNames, *, tied: Optional[Tuple[str, str]],
                   model: str, read_values: bool) -> None:
    """Refuse tensors of ``files`` the params would not read: layers past theirs, a head of its own under ``tied``
    unless it equals the embedding (compared only with ``read_values``), any other."""

    def same_values(a: str, b: str) -> bool:  # read in bands of 16 MB of float32
        ea, eb = files.entries[a], files.entries[b]
        if ea.shape != eb.shape or not {ea.dtype, eb.dtype} <= {"BF16", "F16", "F32", "F64"}:
            return False
        step = max(1, (1 << 24) // max(1, math.prod(ea.shape[1:]) * 4))
        bands = ([files.read(files.request(t, slice(i, i + step))).astype(np.float32) for t in (a, b)]
                 for i in range(0, ea.shape[0] if ea.shape else 1, step))
        return all(np.array_equal(*band) for band in bands)

    prefix = re.compile(re.escape(names.layer_prefix) + r"\.(\d+)\.")
    layers = 1 + max((int(m.group(1)) for p in params for module in p.module.values()
                      if (m := prefix.match(module + "."))), default=-1)
    extra = sorted(t for t in files.entries if (m := prefix.match(t)) and int(m.group(1)) >= layers)
    if extra:
        numbers = sorted({int(prefix.match(t).group(1)) for t in extra})
        shown = f"{numbers[0]}" if len(numbers) == 1 else f"{numbers[0]}..{numbers[-1]}"
        _refuse(files, f"the checkpoint has tensors for layer{'s' if len(numbers) > 1 else ''} {shown} ({extra[0]}, "
                       f"...) but config.json num_hidden_layers={layers}; this model would not read them")
    read = {t for p in params for t in p.tensors}
    unread = [t for t in files.entries if t not in read and not _SKIPPED.search(t)]
    if tied is not None:
        head, embed = tied
        own_head = [t for t in unread if t.startswith(head + ".")]
        if own_head:
            plain = own_head == [f"{head}.weight"]
            if not plain or (read_values and not same_values(f"{head}.weight", f"{embed}.weight")):
                what = f"{own_head[0]}, different from {embed}.weight" if plain else own_head[0]
                _refuse(files, f"config.json tie_word_embeddings=true, but the checkpoint has its own {what}: this "
                               "model's head would be the embedding; set tie_word_embeddings to false to read that "
                               "head")
            unread = [t for t in unread if t not in own_head]  # the embedding again
    if unread:
        more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
        _refuse(files, f"the checkpoint has {len(unread)} tensor{'s' if len(unread) > 1 else ''} {model} does not "
                       f"read: {', '.join(unread[:3])}{more} (another architecture's, e.g. biases?); refused")


def plan_hf(source: Union[str, Safetensors], *, names: HFNames, abstract_params, abstract_state, mesh,
            tied: Optional[Tuple[str, str]] = None, model: str = "this model",
            devices: Optional[Sequence] = None) -> Dict[Any, List[Read]]:
    """What each device reads to build the state from a checkpoint, from the headers and the
    abstract state alone: nothing is read, nothing model-sized is allocated.

    Args:
      source: the checkpoint folder, or its :class:`~jax_nvfp4.export.Safetensors`.
      names, abstract_params, abstract_state, mesh, tied, model: as :func:`load_hf`.
      devices: whose reads (default: this process's devices of ``mesh``, in
        ``jax.local_devices()`` order); a process reads their union, each distinct slice once.

    Returns:
      ``{device: [Read]}``, one :class:`~jax_nvfp4.export.Read` per slice of a stored tensor
      that the device's blocks of the state are built from.

    Raises:
      ExportError: as :func:`load_hf`'s checks (those that need no tensor data).
    """
    files = source if isinstance(source, Safetensors) else Safetensors(source)
    leaves = _targets(files, names, abstract_params, abstract_state, mesh, tied=tied, model=model, read_values=False)
    if devices is None:
        mine = set(mesh.devices.flat)
        devices = [d for d in jax.local_devices() if d in mine]
    out: Dict[Any, List[Read]] = {d: [] for d in devices}
    for *_, targets in leaves:
        for t in jax.tree.leaves(targets, is_leaf=_is_target):
            idx = t.sharding.devices_indices_map(t.shape)
            for d in out:
                out[d] += [read for _, read, _ in t.parts(idx[d])]
    return out


def load_hf(source: Union[str, Safetensors], *, names: HFNames, abstract_params, abstract_state, param_shardings,
            state_shardings, mesh, policy: Policy, init: Callable[[Any], Any],
            tied: Optional[Tuple[str, str]] = None, model: str = "this model",
            on_checked: Optional[Callable[[], None]] = None) -> Tuple[Any, Any]:
    """Read a Hugging Face checkpoint into the sharded state ``(params, opt_state)``.

    Call it on every process: each reads only the slices its own devices store
    (:func:`plan_hf`), one device's block at a time, and puts them straight into their
    shardings.

    Args:
      source: the checkpoint folder, or its :class:`~jax_nvfp4.export.Safetensors` (whose
        ``reads`` then lists every slice read).
      names: the params' Hugging Face names (:class:`~jax_nvfp4.export.HFNames`), as
        ``export_hf`` was given them.
      abstract_params: the stored params (:func:`jax_nvfp4.shard_params`), abstract
        (``jax.eval_shape``) or concrete: only shapes, layouts and blocks are read.
      abstract_state: likewise the optimizer state of :func:`jax_nvfp4.master_weights`: its
        masters say how each leaf's float32 master is laid out.
      param_shardings, state_shardings: the shardings of the params and the optimizer state
        (:func:`jax_nvfp4.shardings`).
      mesh: the mesh they live on.
      policy: the :class:`~jax_nvfp4.Policy` of the params: float weights quantized here take
        its shared amax groups, as every later re-quantization does.
      init: the optimizer's ``init``; it is given the float32 masters (the params' tree
        structure, :class:`~jax_nvfp4.Tiled` where the masters are tiled) and returns the
        fresh ``opt_state``.
      tied: ``(head, embedding)`` Hugging Face modules when the model ties its head to the
        embedding (``config.json`` ``tie_word_embeddings``): a ``{head}.weight`` in the
        checkpoint is then read only if it equals ``{embedding}.weight``.
      model: how refusals name the model.
      on_checked: called once every check has passed, before any weight is read (e.g. to
        print what the import ignores).

    Returns:
      ``(params, opt_state)`` in ``param_shardings`` and ``state_shardings``. NVFP4 params read
      from compressed-tensors NVFP4 tensors are bit for bit the checkpoint's codes, scales and
      (recorded) amax; the masters are their dequantized values, or the plain weights' float32
      values; the optimizer state is ``init``'s.

    Raises:
      ExportError: ``"DIR: ..."``, one line naming the tensor or parameter: no or a corrupt
        safetensors file, a missing tensor or one of another dtype or shape, NVFP4 tensors the
        params' blocks cannot hold, a NaN or Inf (or NaN E4M3 scale byte), tensors of layers
        past the params' (``config.json num_hidden_layers``), a head of its own under ``tied``
        that differs from the embedding, any tensor the params would not read (transformers'
        ``rotary_emb.inv_freq`` buffers aside).
      TileScalesError: NVFP4 scales that differ inside a 16x16 tile, read into 16x16 tiles.
      MixedLayersError: a stacked param's layers stored partly NVFP4, partly plain.
    """
    files = source if isinstance(source, Safetensors) else Safetensors(source)

    def device_array(t: _Target):  # this process's blocks, each read once and put on its devices before the next
        indices, first, arrays = t.sharding.addressable_devices_indices_map(t.shape), {}, {}
        for d, index in indices.items():
            src = first.setdefault(tuple(tuple(s.indices(n)) for s, n in zip(index, t.shape)), d)
            arrays[d] = jax.device_put(t.fill(index) if src == d else arrays[src], d)
        return jax.make_array_from_single_device_arrays(t.shape, t.sharding, [arrays[d] for d in indices])

    leaves = _targets(files, names, abstract_params, abstract_state, mesh, tied=tied, model=model, read_values=True)
    if on_checked is not None:
        on_checked()
    sources = [jax.tree.map(device_array, s, is_leaf=_is_target) for *_, s in leaves]
    params_def = jax.tree.structure(abstract_params, is_leaf=is_tiled)

    def assemble(sources):
        # The checkpoint's code tiles [..., 8, 16] (bytes of 2 inputs of 16 outputs) as the kernel's [..., 16, 8].
        codes = lambda raw: nx.pack_codes(jnp.swapaxes(nx.unpack_codes(jnp.swapaxes(raw, -1, -2)), -1, -2))
        sources = [s.replace(codes(s.data), s.scale_bits) if isinstance(s, TiledNVFP4) else s for s in sources]
        # Float weights quantized here take the policy's shared amax, as every later re-quantization does; stored
        # NVFP4 bits are kept as they are.
        amaxes = {p.path: global_amax(s, mesh) for (p, a_p, _, _), s in zip(leaves, sources)
                  if isinstance(a_p, TiledNVFP4) and not isinstance(s, TiledNVFP4) and policy.amax_group(p.path)}
        shared = shared_amaxes(amaxes, policy)

        def one(param, a_p, a_m, s):  # (stored param, float32 master)
            m = s
            if isinstance(s, TiledNVFP4):
                m = Tiled(s.dequantize_tiles(jnp.float32), s.layout) if isinstance(a_m, Tiled) else \
                    s.dequantize(jnp.float32)
            if isinstance(a_p, TiledNVFP4):
                return (s if isinstance(s, TiledNVFP4) else
                        requantize(m, mesh, block=a_p.block, amax=shared.get(param.path),
                                   four_over_six=policy.four_over_six)), m
            if isinstance(a_p, Tiled):
                return Tiled(m.value.astype(a_p.value.dtype), a_p.layout), m
            return m.astype(a_p.dtype), m

        params, masters = zip(*(one(*leaf[:3], s) for leaf, s in zip(leaves, sources)))
        return jax.tree.unflatten(params_def, params), init(jax.tree.unflatten(params_def, masters))

    with jax.set_mesh(mesh):
        return jax.jit(assemble, out_shardings=(param_shardings, state_shardings))(sources)
