"""Compile the NVFP4 training step for large models on simulated multi-rack meshes; report
per-device memory and collective traffic.

Nothing is allocated: the model is built with ``jax.eval_shape``, params and optimizer state
are ``jax.ShapeDtypeStruct`` with their shardings (``jax_nvfp4.shardings``), and the full step
of ``train.step.make_step`` (packed gather, dequantize, forward/backward, gradient reduction,
``master_weights`` update, sharded re-quantization) is lowered and compiled ahead of time for
a mesh of simulated CPU devices. Figures come from the compiled program:

- per-device state bytes from the shard shapes of the sharded ``ShapeDtypeStruct``\\ s;
- argument / output / temporary bytes from ``compiled.memory_analysis()``;
- bytes per collective from the compiled HLO (``jax_nvfp4.comm.parse`` per instruction,
  times the trip count of the ``while`` loops around it: the per-layer gathers and gradient
  reductions sit inside the scanned forward and backward loops), with the mesh axes and NVLink
  domains each collective's replica groups span, and its purpose (weight gather, gradient
  reduction, ...) read from the Python stack that XLA keeps in the HLO metadata.

Collective times are a MODEL, not a measurement: ring algorithms, no latency term, no overlap
with compute, the slowest link of a group deciding ("flat"), and a two-level variant
(inside the NVLink domain, then across domains).

Run (the device count is fixed when JAX starts, so run it in a fresh process)::

    python -m benchmarks.scale --model 8b --mesh gb200:2             # 2 NVL72 racks, 144 devices
    python -m benchmarks.scale --model 8b --mesh gb200:2 --tensor 4  # tensor axis inside a rack
    python -m benchmarks.scale --model 1b --mesh data:16 --weights nvfp4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
from typing import Any, Dict, List

import numpy as np

# Llama 3's exact shapes (grouped-query attention with 8 key/value heads, untied head):
# 8.03B and 70.6B parameters. "1b" is a multi-head (no GQA) Llama-style model kept for the
# committed scaling results; "8b"/"70b" are aliases of the Llama 3 presets.
LLAMA3_8B = dict(d_model=4096, layers=32, heads=32, kv_heads=8, mlp_hidden=14336, vocab=128256,
                 rope_theta=500000.0)
LLAMA3_70B = dict(d_model=8192, layers=80, heads=64, kv_heads=8, mlp_hidden=28672, vocab=128256,
                  rope_theta=500000.0)
# Llama 3.1: the same shapes with its published rotary scaling (config.json rope_scaling,
# rope_type llama3) for 128K positions; 405B: 405.9B parameters.
LLAMA31_ROPE_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
LLAMA31_8B = dict(LLAMA3_8B, rope_scaling=LLAMA31_ROPE_SCALING)
LLAMA31_70B = dict(LLAMA3_70B, rope_scaling=LLAMA31_ROPE_SCALING)
LLAMA31_405B = dict(d_model=16384, layers=126, heads=128, kv_heads=8, mlp_hidden=53248, vocab=128256,
                    rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING)
PRESETS: Dict[str, Dict[str, Any]] = {
    "1b": dict(d_model=2048, layers=16, heads=32, mlp_hidden=8192, vocab=128256),
    "llama3_8b": LLAMA3_8B,
    "llama3_70b": LLAMA3_70B,
    "llama31_8b": LLAMA31_8B,
    "llama31_70b": LLAMA31_70B,
    "llama31_405b": LLAMA31_405B,
    "8b": LLAMA3_8B,
    "70b": LLAMA3_70B,
    "405b": LLAMA31_405B,
}
NVLINK_GBPS = 900.0  # NVLink 5, per GPU per direction, inside one NVL72 rack
IB_GBPS = 50.0  # 400 Gb/s InfiniBand per GPU, across racks
# A GB200's dense (no sparsity) bf16 tensor-core peak: 180 PFLOP/s per NVL72 rack of 72 GPUs
# (NVIDIA's datasheet gives 360 PFLOP/s with 2:4 sparsity). A peak, not a measured rate.
GB200_BF16_DENSE_TFLOPS = 2500.0
SEQ_LEN = 8192
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ----------------------------------------------------------------------------- the mesh spec
MESH_FORMS = "expected gb200:RACKS or data:N (RACKS, N >= 1), e.g. gb200:2 or data:16"


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """``gb200:R`` = R NVLink racks of ``nvl_domain`` devices (tensor inside one); ``data:N`` =
    a plain mesh with N data shards (``N x tensor`` devices).

    ``sharding`` (gb200 only): ``fsdp`` (mesh ``rack x data x tensor``, state sharded over
    racks and the in-rack data axis, gathers and reductions one level at a time), ``hsdp``
    (state sharded inside a rack, replicated across racks) or ``flat`` (one data axis over
    every rack: ``mesh.layout: auto``)."""

    kind: str
    count: int
    tensor: int = 1
    nvl_domain: int = 72
    sharding: str = "fsdp"

    @classmethod
    def parse(cls, text: str, tensor: int = 1, nvl_domain: int = 72, sharding: str = "fsdp") -> "MeshSpec":
        m = re.fullmatch(r"(gb200|data):(\d+)", text)
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"--mesh {text!r}: {MESH_FORMS}")
        if sharding not in ("fsdp", "hsdp", "flat"):
            raise ValueError(f"--sharding {sharding!r}: expected fsdp, hsdp or flat")
        return cls(m.group(1), int(m.group(2)), tensor, nvl_domain, sharding if m.group(1) == "gb200" else "flat")

    @property
    def devices(self) -> int:
        return self.count * self.nvl_domain if self.kind == "gb200" else self.count * self.tensor

    @property
    def label(self) -> str:
        dom = f"-nvl{self.nvl_domain}" if self.kind == "gb200" and self.nvl_domain != 72 else ""
        mode = f"-{self.sharding}" if self.kind == "gb200" and self.sharding != "fsdp" else ""
        return f"{self.kind}-{self.count}{dom}" + (f"-t{self.tensor}" if self.tensor > 1 else "") + mode


# ----------------------------------------------------------------------------- link model
def collective_time(op: str, nbytes: float, n: int, k: int, nvlink_gbps: float, ib_gbps: float):
    """Modelled seconds of one collective moving ``nbytes`` per device (its per-device result
    size, as ``jax_nvfp4.comm.parse`` counts it) over a group of ``n`` devices spread
    over ``k`` NVLink domains (``m = n / k`` per domain). Returns ``(flat, two_level)``.

    flat (ring, slowest link decides; bw = IB if k > 1 else NVLink):
      all-gather B:       B (n-1)/n / bw
      reduce-scatter S:   S (n-1) / bw            (S = the shard; the input is n S)
      all-reduce B:       2 B (n-1)/n / bw
      collective-permute: B / bw;  all-to-all B (its per-device result): B (n-1)/n / bw
    two-level (k > 1; inside the domain over NVLink, across domains over IB):
      all-gather:     B (k-1)/n / ib  +  B (m-1)/m / nvl
      reduce-scatter: S k (m-1) / nvl +  S (k-1) / ib
      all-reduce:     2 B (m-1)/m / nvl + 2 (B/m) (k-1)/k / ib
      all-to-all:     B (m-1)/n / nvl + B (n-m)/n / ib
    """
    if n <= 1 or nbytes == 0:
        return 0.0, 0.0
    nvl, ib = nvlink_gbps * 1e9, ib_gbps * 1e9
    bw = ib if k > 1 else nvl
    m = n / k
    if op == "all-gather":
        flat = nbytes * (n - 1) / n / bw
        two = nbytes * (k - 1) / n / ib + nbytes * (m - 1) / m / nvl
    elif op == "reduce-scatter":
        flat = nbytes * (n - 1) / bw
        two = nbytes * k * (m - 1) / nvl + nbytes * (k - 1) / ib
    elif op == "all-reduce":
        flat = 2 * nbytes * (n - 1) / n / bw
        two = 2 * nbytes * (m - 1) / m / nvl + 2 * (nbytes / m) * (k - 1) / k / ib
    elif op == "all-to-all":
        flat = nbytes * (n - 1) / n / bw
        two = nbytes * (m - 1) / n / nvl + nbytes * (n - m) / n / ib
    else:
        flat = two = nbytes / bw
    return flat, (two if k > 1 else flat)


def ib_bytes(op: str, nbytes: float, n: int, k: int) -> float:
    """Bytes one device receives across racks (InfiniBand) in the two-level algorithm of
    :func:`collective_time` (0 inside one domain): all-gather B(k-1)/n; reduce-scatter
    S(k-1); all-reduce 2(B/m)(k-1)/k; all-to-all B(n-m)/n; collective-permute B."""
    if n <= 1 or k <= 1:
        return 0.0
    m = n / k
    return {"all-gather": nbytes * (k - 1) / n, "reduce-scatter": nbytes * (k - 1),
            "all-reduce": 2 * (nbytes / m) * (k - 1) / k, "all-to-all": nbytes * (n - m) / n}.get(op, nbytes)


def ring_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes one device sends in a ring collective (``nbytes`` counted as in
    :func:`collective_time`): all-gather B(n-1)/n, reduce-scatter S(n-1), all-reduce 2B(n-1)/n,
    collective-permute B, all-to-all B(n-1)/n."""
    if n <= 1:
        return 0.0
    return {"all-gather": nbytes * (n - 1) / n, "reduce-scatter": nbytes * (n - 1),
            "all-reduce": 2 * nbytes * (n - 1) / n}.get(op, nbytes * (n - 1) / n if op == "all-to-all" else nbytes)


def analyze_hlo(program, mesh, nvl_domain: int, nvlink_gbps: float = NVLINK_GBPS, ib_gbps: float = IB_GBPS):
    """Every collective of a compiled step (``program``: its HLO read by
    ``jax_nvfp4.comm.parse`` with ``mesh``), grouped by purpose, op, dtype, mesh axes, group
    size and NVLink domains spanned: per-device bytes per step (loop trip counts included),
    ring bytes on the wire and modelled time."""
    from jax_nvfp4.mesh import device_domains

    domains = np.array(device_domains(list(mesh.devices.flat), nvl_domain))
    n_dev = domains.size
    rows, seen = {}, set()
    for c in program.collectives:
        groups = [np.asarray(g) for g in c.groups] or [np.arange(n_dev)]
        if c.op == "collective-permute":
            n, k = 2, 2 if any(domains[g[0]] != domains[g[1]] for g in groups) else 1
        else:
            n = max(len(g) for g in groups)
            k = max(len(set(domains[g].tolist())) for g in groups)
        axis = "+".join(c.axes) or "-"
        key = (c.purpose, c.op, c.dtype, axis, n, k)
        r = rows.setdefault(key, dict(purpose=c.purpose, op=c.op, dtype=c.dtype, axis=axis, group=n, domains=k,
                                      instances=0, bytes=0, wire=0.0, ib=0.0, time_flat_s=0.0, time_2level_s=0.0))
        flat, two = collective_time(c.op, c.bytes, n, k, nvlink_gbps, ib_gbps)
        if (c.computation, c.instruction, key) not in seen:  # one instance per instruction
            seen.add((c.computation, c.instruction, key))
            r["instances"] += c.times
        r["bytes"] += int(c.per_call)
        r["wire"] += ring_bytes(c.op, c.bytes, n) * c.times
        r["ib"] += ib_bytes(c.op, c.bytes, n, k) * c.times
        r["time_flat_s"] += flat * c.times
        r["time_2level_s"] += two * c.times
    return sorted(rows.values(), key=lambda r: (r["purpose"], r["op"], r["axis"], r["dtype"])), list(program.warnings)


# ----------------------------------------------------------------------------- building the step
def make_config(preset: Dict[str, int], spec: MeshSpec, weights: str, seq_len: int, micro_batch: int):
    from train.config import from_dict

    n_data = spec.devices // spec.tensor
    two_level = spec.kind == "gb200" and spec.sharding != "flat"
    return from_dict({
        "model": dict(preset, seq_len=seq_len),
        "mesh": dict(data=-1, tensor=spec.tensor, layout="gb200" if two_level else "auto",
                     sharding=spec.sharding if two_level else "fsdp",
                     nvl_domain=spec.nvl_domain, simulate_devices=0),
        "data": dict(batch_size=n_data * micro_batch, markov_states=2),
        "nvfp4": dict(weights=weights),
    })


def _nbytes(x) -> int:
    """Per-device bytes of one sharded ``ShapeDtypeStruct``."""
    import jax

    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    itemsize = 8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.dtype(x.dtype).itemsize
    return math.prod(shape) * itemsize


def _tree_bytes(tree) -> int:
    import jax

    return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def analytic(params, rules, policy, n_data: int, n_tensor: int, racks: int,
             nvlink_gbps: float, ib_gbps: float, hsdp: bool = False, tokens: int = 0, d_model: int = 0,
             layers: int = 0) -> Dict[str, Any]:
    """The figures the layout should give, from logical shapes alone (no padding, every large
    leaf divisible). ``N_data`` = ``n_data``, the devices the state is sharded over (every data
    device; with ``hsdp`` the devices of one rack), ``racks`` = the NVLink domains the batch
    spans, ``t`` = the tensor split of a leaf (``n_tensor`` where a tensor rule matches, else 1):

    - NVFP4 matrix stack of ``numel`` elements (``L x rows x cols``):
      packed gather bytes/device = passes (numel/2 + s numel/256) / t (codes + E4M3 scales, s per
      16x16 tile: 1 for 2D tiles, 16 for 1D blocks; amax
      stays), passes = 2 for scanned (rematerialised) layers, 1 otherwise;
      params/device = (numel/2 + s numel/256) / (N_data t) + 4 L (amax, replicated);
    - large plain leaf (>= ``rules.min_shard_size`` and a matrix per layer, stored sharded, e.g.
      bf16 embed/head): gather = passes itemsize numel / t; params = itemsize numel / (N_data t);
    - small plain leaf (norm scales): params itemsize numel, replicated, not gathered;
    - master = 4 numel' / (N_data t) (small leaves: 4 numel); Adam m+v = 8 numel' / (N_data t),
      where numel' counts the tile padding: per matrix (per tensor shard) ceil(r/16) ceil(c/16)
      tiles rounded up to a multiple of N_data, times 256;
    - ideal gradient reduction = a reduce-scatter of the bf16 gradients over the data axis,
      result 2 numel / (N_data t) per device (all-reduce of 2 numel for small leaves); with
      ``hsdp`` followed by an all-reduce of that shard across the racks.

    Times: the ideal two-level algorithms of :func:`collective_time` over the N_data devices
    spanning ``racks`` domains (``hsdp``: gathers and reduce-scatters inside a rack, the
    shard's all-reduce across racks); ``ib_bytes`` = their InfiniBand bytes per device.

    Tensor and sequence parallelism (``n_tensor = t > 1``; ``tokens`` per data shard, a bf16
    residual stream of ``d_model``): each collective all-gathers or reduce-scatters the
    activations ``A = tokens x d_model x 2`` bytes over the t devices of the tensor group
    (NVLink), ``A (t-1)/t`` on the wire. Per layer: 4 in the forward pass (gather before
    attention and before the MLP, reduce-scatter after each), 4 in the backward pass (their
    transposes) and 3 more where the layer is recomputed (the last reduce-scatter only
    feeds the next layer); outside the layers 4 (embedding and final norm, forward and
    backward): ``tp_bytes = (11 L + 4) A``.
    """
    import jax
    import jax_nvfp4 as nv

    out = dict(params=0.0, master=0.0, master_unpadded=0.0, opt_state=0.0, gather_packed=0.0, gather_plain=0.0,
               grad_reduce_scatter=0.0, grad_all_reduce=0.0, numel=0, numel_nvfp4=0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=nv.layout.is_tiled)[0]:
        p = nv.params.path_str(path)
        nvfp4 = isinstance(leaf, nv.TiledNVFP4)
        shape = tuple(leaf.shape)
        numel = math.prod(shape)
        stacked = rules.stacked_axes(p)
        sharded = nvfp4 or (len(shape) - stacked >= 2 and numel >= rules.min_shard_size)
        t = n_tensor if (n_tensor > 1 and rules.tensor_dim(p) is not None and sharded) else 1
        if sharded:
            # Tile-major storage: each matrix (per tensor shard) as whole 16x16 tiles, the tile
            # count rounded up to a multiple of N_data.
            *batch, r, c = shape
            tdim = rules.tensor_dim(p) if t > 1 else None
            sr, sc = (r // t, c) if tdim == -2 else ((r, c // t) if tdim == -1 else (r, c))
            tiles = -(-sr // 16) * -(-sc // 16)
            padded = math.prod(batch) * t * (-(-tiles // n_data) * n_data) * 256
        else:
            padded = numel
        # Scanned layers are rematerialised: gathered in the forward and again in the backward
        # pass; the embedding and head once.
        passes = 2 if stacked else 1
        if nvfp4:
            batch = math.prod(shape[:-2])
            packed = numel / 2 + math.prod(nv.layout.tile_scales(leaf.block)) * numel / 256
            out["gather_packed"] += passes * packed / t
            out["params"] += packed / (n_data * t) + 4 * batch
            out["numel_nvfp4"] += numel
        else:
            item = np.dtype(leaf.dtype).itemsize
            if sharded:
                out["gather_plain"] += passes * item * numel / t
                out["params"] += item * numel / (n_data * t)
            else:
                out["params"] += item * numel
        out["numel"] += numel
        shards = n_data * t if sharded else 1
        out["master"] += 4 * padded / shards
        out["master_unpadded"] += 4 * numel / shards
        out["opt_state"] += 8 * padded / shards
        if sharded:
            out["grad_reduce_scatter"] += 2 * numel / (n_data * t)
        else:
            out["grad_all_reduce"] += 2 * numel
    n = n_data
    k = 1 if hsdp else racks  # NVLink domains a storage (gather, reduce-scatter) group spans
    gathered = out["gather_packed"] + out["gather_plain"]
    out["wire_gather"] = ring_bytes("all-gather", gathered, n)
    out["wire_gather_packed"] = ring_bytes("all-gather", out["gather_packed"], n)
    out["wire_reduce"] = (ring_bytes("reduce-scatter", out["grad_reduce_scatter"], n)
                          + ring_bytes("all-reduce", out["grad_all_reduce"], n * (racks if hsdp else 1)))
    ag = collective_time("all-gather", gathered, n, k, nvlink_gbps, ib_gbps)
    rs = collective_time("reduce-scatter", out["grad_reduce_scatter"], n, k, nvlink_gbps, ib_gbps)
    ar = collective_time("all-reduce", out["grad_all_reduce"], n * (racks if hsdp else 1), racks, nvlink_gbps, ib_gbps)
    out["ib_bytes"] = (ib_bytes("all-gather", gathered, n, k) + ib_bytes("reduce-scatter", out["grad_reduce_scatter"], n, k)
                       + ib_bytes("all-reduce", out["grad_all_reduce"], n * (racks if hsdp else 1), racks))
    if hsdp and racks > 1:  # the rack's reduced shard, all-reduced across the racks
        x = collective_time("all-reduce", out["grad_reduce_scatter"], racks, racks, nvlink_gbps, ib_gbps)
        rs = (rs[0] + x[0], rs[1] + x[1])
        out["wire_reduce"] += ring_bytes("all-reduce", out["grad_reduce_scatter"], racks)
        out["ib_bytes"] += ib_bytes("all-reduce", out["grad_reduce_scatter"], racks, racks)
    out["time_gather_flat_s"], out["time_gather_2level_s"] = ag
    out["time_grad_rs_flat_s"], out["time_grad_rs_2level_s"] = rs
    out["tp_bytes"] = (11 * layers + 4) * tokens * d_model * 2 if n_tensor > 1 else 0
    out["time_tp_s"] = collective_time("all-gather", out["tp_bytes"], n_tensor, 1, nvlink_gbps, ib_gbps)[0]
    out["time_flat_s"] = ag[0] + rs[0] + ar[0] + out["time_tp_s"]
    out["time_2level_s"] = ag[1] + rs[1] + ar[1] + out["time_tp_s"]
    return out


def unsharded_large_leaves(params, specs, rules, n_data: int) -> List[str]:
    """Large leaves stored without a data-axis split, so every data shard holds a full copy
    (NVFP4 leaves, and plain leaves of at least ``rules.min_shard_size`` elements with a
    matrix per layer)."""
    import jax
    import jax_nvfp4 as nv

    out = []
    if n_data == 1:
        return out
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=nv.layout.is_tiled)[0]
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=nv.layout.is_tiled)):
        p = nv.params.path_str(path)
        big = (isinstance(leaf, nv.TiledNVFP4) or nv.array.is_nvfp4(leaf)
               or (len(leaf.shape) - rules.stacked_axes(p) >= 2 and math.prod(leaf.shape) >= rules.min_shard_size))
        s = spec.data if isinstance(spec, nv.TiledNVFP4) else (spec.value if isinstance(spec, nv.Tiled) else spec)
        used = set()
        for e in tuple(s):
            used.update(e if isinstance(e, tuple) else (e,))
        if big and not (set(rules.data_axes) & used):
            out.append(f"{p} {tuple(leaf.shape)}")
    return out


def compile_step(cfg, spec: MeshSpec, nvlink_gbps: float = NVLINK_GBPS, ib_gbps: float = IB_GBPS) -> Dict[str, Any]:
    """Lower and compile the training step a run of ``cfg`` uses (``train.programs.build``) on
    ``spec``'s simulated mesh."""
    import jax

    import jax_nvfp4 as nv
    from jax_nvfp4 import mesh as nv_mesh
    from train import programs
    from train import accounting as accounting_lib
    from train import mesh as mesh_lib
    from train.config import validate_for_devices

    axes = validate_for_devices(cfg, spec.devices)
    mesh = mesh_lib.build_mesh(cfg.mesh, jax.devices()[: spec.devices])

    t0 = time.perf_counter()
    # The run's own programs (train.programs.build), planned only: eval_shape of the init, then the
    # library's shardings; nothing is allocated.
    trainer = programs.build(cfg, mesh, init=False)[0]
    rules, policy, a_params = trainer.rules, trainer.policy, trainer.abstract_params
    args = accounting_lib.abstract_step_args(trainer)
    params, state, batch = args[:3]
    t_abstract = time.perf_counter() - t0
    t0 = time.perf_counter()
    # The program the training loop runs and the CLI accounts, lowered, compiled and read once.
    step = accounting_lib.compiled_step(trainer)
    t_compile = time.perf_counter() - t0
    mem = step["memory"]
    # Evaluation: its own program, the same per-layer gathers, forward only.
    t0 = time.perf_counter()
    eval_mem = trainer.eval_fn.lower(params, batch).compile().memory_analysis()
    t_eval = time.perf_counter() - t0

    mw = nv.find_state(state)
    nvfp4_params = [x for x in jax.tree.leaves(params, is_leaf=nv.layout.is_tiled) if isinstance(x, nv.TiledNVFP4)]
    measured = {
        "params": _tree_bytes(params),
        "params_nvfp4": _tree_bytes(nvfp4_params),
        "master": _tree_bytes(mw.master),
        "opt_state": _tree_bytes(mw.inner_state),
        "other_state": _tree_bytes(state) - _tree_bytes(mw.master) - _tree_bytes(mw.inner_state),
        "batch": _nbytes(batch),
    }
    for name in ("argument", "output", "alias", "temp"):
        measured[f"xla_{name}"] = mem[name]
    if None not in mem.values():
        measured["xla_peak"] = measured["xla_argument"] + measured["xla_temp"] + measured["xla_output"] - measured["xla_alias"]
    if eval_mem is not None:
        measured["eval_xla_temp"] = eval_mem.temp_size_in_bytes
        measured["eval_xla_peak"] = (eval_mem.argument_size_in_bytes + eval_mem.temp_size_in_bytes
                                     + eval_mem.output_size_in_bytes - eval_mem.alias_size_in_bytes)
    colls, warnings = analyze_hlo(step["program"], mesh, spec.nvl_domain, nvlink_gbps, ib_gbps)
    flops, flop_warnings = nv.comm.dot_flops(step["program"])
    measured["flops"] = flops
    measured["compute_s"] = flops / (GB200_BF16_DENSE_TFLOPS * 1e12)
    def sel(op=None, dtypes=None, purpose=None, f="bytes"):
        return sum(r[f] for r in colls if (op is None or r["op"] == op) and (dtypes is None or r["dtype"] in dtypes)
                   and (purpose is None or r["purpose"] == purpose))

    gather = dict(op="all-gather", purpose="weight gather")
    # Packed bytes are gathered at the start of the step (gather) or, where the params layout
    # is not data-sharded, at the end (re-quantized shards gathered into replicated params).
    packed_late = sel("all-gather", ("u8",), "re-quantize")
    measured.update(
        gather_packed=sel(dtypes=("u8",), **gather) + packed_late,
        gather_plain=sel(dtypes=("u16", "bf16", "f32"), **gather),
        all_gather=sel("all-gather"),
        all_reduce=sel("all-reduce"),
        reduce_scatter=sel("reduce-scatter"),
        all_to_all=sel("all-to-all"),
        collective_permute=sel("collective-permute"),
        grad_reduce=sel(purpose="grad reduce"),
        # Re-quantized bytes moved from the master's padded layout to the params layout.
        relayout=sel("collective-permute", None, "re-quantize") + sel("collective-permute", None, "optimizer"),
        wire_gather=sel(f="wire", **gather) + sel("all-gather", ("u8",), "re-quantize", "wire"),
        wire_gather_packed=sel(dtypes=("u8",), f="wire", **gather),
        tp_bytes=sel(purpose="tensor parallel"),
        time_tp_s=sel(purpose="tensor parallel", f="time_2level_s"),
        wire_reduce=sel(purpose="grad reduce", f="wire"),
        time_flat_s=sum(r["time_flat_s"] for r in colls),
        time_2level_s=sum(r["time_2level_s"] for r in colls),
    )
    # The batch groups of the mesh (one per tensor index): how many NVLink domains one spans.
    domains = np.array(nv_mesh.device_domains(list(mesh.devices.flat), spec.nvl_domain)).reshape(mesh.devices.shape)
    t_dim = mesh.axis_names.index("tensor")
    k_data = max(len(set(np.take(domains, j, axis=t_dim).ravel().tolist())) for j in range(domains.shape[t_dim]))
    n_store = nv.rules.axis_size(mesh, rules.data_axis)
    axes = dict(axes, storage=n_store, racks=k_data)
    ana = analytic(a_params, rules, policy, n_store, axes["tensor"], k_data, nvlink_gbps, ib_gbps,
                   hsdp=rules.replica_axis is not None, tokens=batch.shape[0] // axes["data"] * cfg.model.seq_len,
                   d_model=cfg.model.d_model, layers=cfg.model.layers)
    measured["ib_bytes"] = sum(r["ib"] for r in colls)
    specs = nv.sharding.partition_specs(a_params)
    return {
        "weights": cfg.nvfp4.weights,
        # The NVFP4 block of the stored weights (rows, cols of one scale's block), what the
        # analytic packed bytes count; None for the bf16 run.
        "block": list(nvfp4_params[0].block) if nvfp4_params else None,
        "mesh": nv_mesh.describe(mesh, spec.nvl_domain),
        "axes": axes,
        "data_group_domains": k_data,
        "seconds": {"abstract": t_abstract, "compile": t_compile, "compile_eval": t_eval},
        "measured": measured,
        "analytic": ana,
        "collectives": colls,
        "warnings": warnings + flop_warnings,
        "sharding": spec.sharding,
        "unsharded_large_leaves": unsharded_large_leaves(a_params, specs, rules, n_store),
    }


# ----------------------------------------------------------------------------- the report
def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    b = float(b)
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= div:
            return f"{b / div:.3f} {unit}"
    return f"{b:.0f} B"


def _fmt_flops(f) -> str:
    return "-" if f is None else f"{f / 1e12:.1f} TFLOP"


def _fmt_s(s) -> str:
    return "-" if s is None else (f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s")


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


ROWS = (
    # key, label, analytic key (or None), kind
    ("params", "params (stored: NVFP4 packed + plain leaves)", "params", "b"),
    ("master", "float32 master (Tiled, padded)", "master", "b"),
    ("opt_state", "optimizer state (Adam m, v + scalars)", "opt_state", "b"),
    ("other_state", "other state (skip count, PRNG key)", None, "b"),
    ("xla_argument", "XLA arguments (state + batch)", None, "b"),
    ("xla_temp", "XLA temporaries", None, "b"),
    ("xla_peak", "XLA arguments + temporaries + outputs - aliased", None, "b"),
    ("eval_xla_peak", "evaluation program: arguments + temporaries + outputs - aliased", None, "b"),
    # Collective results: a gather in two stages (across racks, then inside the rack) counts both, so its
    # measured side exceeds the analytic final gather by 1 + 1/I (I data devices per rack); the ring-bytes rows
    # below compare like with like.
    ("gather_packed", "weight all-gather: packed NVFP4 bytes (u8, incl. re-quantized; results, a two-level "
                      "gather's stages summed)", "gather_packed", "b"),
    ("gather_plain", "weight all-gather: plain weights (bf16 bits; results, stages summed)", "gather_plain", "b"),
    ("grad_reduce", "gradient reduction: collective results", None, "b"),
    ("relayout", "re-quantized bytes / masters moved between layouts", None, "b"),
    ("all_gather", "all-gather: total", None, "b"),
    ("all_to_all", "all-to-all: total", None, "b"),
    ("reduce_scatter", "reduce-scatter: total", None, "b"),
    ("all_reduce", "all-reduce: total", None, "b"),
    ("collective_permute", "collective-permute: total", None, "b"),
    ("wire_gather", "weight all-gathers, ring bytes sent", "wire_gather", "b"),
    ("wire_gather_packed", "... of which packed NVFP4 bytes (u8)", "wire_gather_packed", "b"),
    ("tp_bytes", "tensor-parallel activation collectives (bf16 bits; results)", "tp_bytes", "b"),
    ("wire_reduce", "gradient reduction, ring bytes sent (analytic: bf16 reduce-scatter)", "wire_reduce", "b"),
    ("ib_bytes", "InfiniBand bytes received per device (two-level model)", "ib_bytes", "b"),
    ("time_flat_s", "modelled time of all collectives, flat ring (measured: each compiled collective at its own "
                    "group's slowest link; analytic: one ring over all N state devices, InfiniBand where they span "
                    "racks; no ratio where the step gathers in stages, rack then in-rack)", "time_flat_s", "s"),
    ("time_2level_s", "modelled time of all collectives, two-level", "time_2level_s", "s"),
    ("time_tp_s", "... of which tensor-parallel activations (NVLink)", "time_tp_s", "s"),
    ("flops", "FLOPs of the step (every dot, loop trip counts applied)", None, "f"),
    ("compute_s", f"compute time at a GB200's dense bf16 peak ({GB200_BF16_DENSE_TFLOPS:g} TFLOP/s)", None, "s"),
)


SHARDING_TEXT = {
    "fsdp": "fsdp (mesh.layout gb200: axes rack x data x tensor; the state is sharded over (data, rack), "
            "racks minor: each layer's gather crosses racks first on 1/I of the bytes, then gathers inside "
            "the rack; each gradient is summed inside the rack first, then only the rack's 1/I shard crosses "
            "InfiniBand; I = data devices per rack)",
    "hsdp": "hsdp (mesh.layout gb200, mesh.sharding hsdp: the state is sharded over the in-rack data axis and "
            "replicated across racks; weight gathers never leave a rack; gradients are reduce-scattered inside "
            "the rack, then the rack's shard is summed across racks)",
    "flat": "flat (one data axis over every device: gathers and reductions span racks as one group)",
}


def block_formula(runs: List[Dict[str, Any]]) -> tuple:
    """``(scale bytes, words)`` of the packed formula for the runs' NVFP4 block (``run["block"]``,
    rows x cols of the inputs one E4M3 scale covers, as :func:`analytic` counts them: a scale byte
    per ``rows x cols`` values)."""
    blocks = {tuple(r["block"]) for r in runs if r.get("block")}
    if len(blocks) != 1:
        return "numel/256 x s", "s = scale bytes per 16x16 tile: 1 for 16x16-tile blocks, 16 for 1d blocks of 16"
    br, bc = blocks.pop()
    per = br * bc
    what = "16x16 tile" if (br, bc) == (16, 16) else f"block of {per} inputs, {br} x {bc}"
    return f"numel/{per}", f"4-bit codes + one E4M3 scale byte per {what}"


def markdown(report: Dict[str, Any]) -> str:
    runs = report["runs"]
    cfg = report["config"]
    packed_scales, block_words = block_formula(runs)
    lines = [
        f"# Scale: {report['model']} on {report['mesh_spec']}",
        "",
        *([f"Reproduce: `{report['command']}`" + (f" ({report['command_note']})" if report.get("command_note") else "")
           + ".", ""] if report.get("command") else []),
        f"- model: d_model={cfg['d_model']}, layers={cfg['layers']}, heads={cfg['heads']}, "
        f"kv_heads={cfg.get('kv_heads') or cfg['heads']}"
        f"{' (full MHA, no GQA)' if not cfg.get('kv_heads') or cfg['kv_heads'] == cfg['heads'] else ''}, "
        f"mlp_hidden={cfg['mlp_hidden']}, vocab={cfg['vocab']}; {report['numel'] / 1e9:.3f} B parameters"
        + (f" (layers/vocab overridden from the preset: {report['overrides']})" if report["overrides"] else ""),
        f"- compiled with all {cfg['layers']} layers (blocks under nn.scan: compile cost does not grow with depth), "
        "so no per-layer figure is extrapolated",
        f"- {runs[0]['mesh']}",
        *([f"- code: commit {str(report['code'].get('git_commit'))[:10]}"
           f"{' with uncommitted changes' if report['code'].get('dirty') else ''}, jax {report['code'].get('jax')}"]
          if report.get("code") else []),
        f"- sharding: {SHARDING_TEXT[runs[0].get('sharding', 'flat')]}",
        f"- batch: {report['micro_batch']} sequence(s) of {report['seq_len']} tokens per data shard (temporaries are "
        "for this micro-batch)",
        "- step: train.step.make_step (FSDP x tensor parallel, one shard_map over every mesh axis): inside the "
        "scan over layers, each layer all-gathers its packed weight bytes over the data axes (a tensor-split "
        "weight: this rank's 1/t), dequantizes, runs forward (remat: again in backward) with Megatron "
        "tensor and sequence parallelism as explicit collectives over the tensor axis, and reduce-scatters "
        "its weight gradient into the master shards in a fixed order; then master_weights(AdamW) and "
        "sharded re-quantization of the tiles each device owns; attention blockwise (O(sequence) memory, "
        "as cuDNN's fused kernel on a GPU); AOT-compiled for simulated CPU devices. Evaluation: its own "
        "program with the same per-layer gathers, forward only",
        "- wall time: " + ", ".join(f"{r['weights']}: lower and compile {r['seconds']['compile']:.1f} s (evaluation "
                                    f"{r['seconds'].get('compile_eval', 0):.1f} s)" for r in runs)
        + f"; whole run {report['wall_s']:.1f} s",
        "",
        "Per device, per step. 'analytic' = formula from logical shapes (see below); ratio = measured / analytic.",
        "",
    ]
    for r in runs:
        a = r["analytic"]
        if a["master_unpadded"] and a["master"] > a["master_unpadded"] * 1.0005:
            lines += [f"- {r['weights']}: the tile padding of the NVFP4 masters adds "
                      f"{100 * (a['master'] / a['master_unpadded'] - 1):.1f}% to master and Adam state "
                      f"(each matrix's 16x16 tiles rounded up to a multiple of {r['axes']['storage']})."]
        if r["unsharded_large_leaves"]:
            lines += [f"- **layout warning ({r['weights']})**: {len(r['unsharded_large_leaves'])} large leaves are "
                      f"stored replicated across the data axis ({r['axes']['data']} does not divide their "
                      "dimensions; listed below), so measured memory exceeds the analytic figure."]
    if lines[-1].startswith("- "):
        lines.append("")
    head = "| quantity |"
    sep = "|---|"
    for r in runs:
        head += f" {r['weights']} measured | {r['weights']} analytic | ratio |"
        sep += "---:|---:|---:|"
    if len(runs) == 2:
        head += " nvfp4 / bf16 |"
        sep += "---:|"
    lines += [head, sep]
    for key, label, akey, kind in ROWS:
        fmt = {"b": _fmt_bytes, "s": _fmt_s, "f": _fmt_flops}[kind]
        row = f"| {label} |"
        for r in runs:
            m = r["measured"].get(key)
            a = r["analytic"].get(akey) if akey else None
            # A staged (rack, then in-rack) step's flat figure runs its in-rack stages on NVLink; the
            # analytic flat ring puts every byte on InfiniBand: not the same algorithm, no ratio.
            staged = key == "time_flat_s" and r.get("sharding") == "fsdp" and r["data_group_domains"] > 1
            row += f" {fmt(m)} | {fmt(a) if akey else ''} | {'-' if staged else (_ratio(m, a) if akey else '')} |"
        if len(runs) == 2:
            row += f" {_ratio(runs[0]['measured'].get(key), runs[1]['measured'].get(key))} |"
        lines.append(row)
    lines.append("")
    for r in runs:
        a = r["analytic"]
        lines += [
            f"Analytic collective time ({r['weights']}, {r.get('sharding', 'flat')}: state sharded over "
            f"{r['axes']['storage']} devices, batch over {r['axes']['data']} spanning "
            f"{r['data_group_domains']} NVLink domain(s)): weight all-gather {_fmt_s(a['time_gather_flat_s'])} flat / "
            f"{_fmt_s(a['time_gather_2level_s'])} two-level; bf16 gradient reduce-scatter "
            f"{_fmt_s(a['time_grad_rs_flat_s'])} flat / {_fmt_s(a['time_grad_rs_2level_s'])} two-level.",
            "",
        ]
    for r in runs:
        lines += [
            f"## Collectives in the compiled step ({r['weights']})",
            "",
            "| purpose | op | dtype | mesh axes | group n | NVLink domains k | instances/step | bytes/device/step | ring bytes sent | flat time | two-level time |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in r["collectives"]:
            lines.append(f"| {c['purpose']} | {c['op']} | {c['dtype']} | {c['axis']} | {c['group']} | {c['domains']} | {c['instances']} | "
                         f"{_fmt_bytes(c['bytes'])} | {_fmt_bytes(c['wire'])} | {_fmt_s(c['time_flat_s'])} | {_fmt_s(c['time_2level_s'])} |")
        by = {}
        for c in r["collectives"]:
            t = by.setdefault(c["purpose"], [0.0, 0.0])
            t[0] += c["time_flat_s"]
            t[1] += c["time_2level_s"]
        lines += ["", "Modelled time by purpose (flat / two-level): " + "; ".join(
            f"{p} {_fmt_s(f)} / {_fmt_s(t)}" for p, (f, t) in sorted(by.items(), key=lambda kv: -kv[1][0])) + ".", ""]
        if r["unsharded_large_leaves"]:
            lines += [f"Large leaves stored WITHOUT a data-axis split ({r['weights']}; the data axis "
                      f"({r['axes']['data']}) does not divide their dimension, so each data shard holds a full copy "
                      "and measured params exceed the analytic figure):", ""]
            lines += [f"- `{x}`" for x in r["unsharded_large_leaves"]] + [""]
        for w in r["warnings"]:
            lines += [f"Warning: {w}", ""]
    lines += [
        "## Formulas",
        "",
        "Analytic, per device (N = data-axis size, t = tensor split of the leaf, L = stacked layers, "
        "passes = 2 for the scanned (rematerialised) layers, gathered in the forward and again in the "
        "backward pass, 1 for the embedding and head):",
        "",
        f"- packed gather bytes = sum over NVFP4 weights of passes x (numel/2 + {packed_scales}) / t "
        f"({block_words}), plus passes x 2 bytes x numel / t for bf16 leaves stored sharded (embed, head; "
        "all weights in the bf16 run)",
        f"- params = (numel/2 + {packed_scales})/(N t) + 4 L (amax) per NVFP4 weight; itemsize x numel / (N t) "
        "for large plain leaves; itemsize x numel for small ones (norm scales, replicated)",
        "- master = 4 x numel' / (N t), Adam state (m, v) = 8 x numel' / (N t); numel' includes the zero padding "
        "of NVFP4 masters to whole 16 x 16 tiles per data shard (the data-split dim rounded up to a multiple of "
        "16 N, the other to 16); small leaves (< min_shard_size) replicated: 4 numel and 8 numel",
        "- ideal gradient reduction = reduce-scatter of bf16 gradients, result 2 x numel / (N t) per device",
        "- tensor + sequence parallel activations (t > 1) = (11 L + 4) all-gathers / reduce-scatters of the bf16 "
        "residual stream A = tokens x d_model x 2 bytes over the tensor group (NVLink), each A (t-1)/t on the "
        "wire: per layer 4 forward, 4 backward, 3 in the recomputed forward; 4 for the embedding and final norm",
        "- compute = FLOPs of every dot in the compiled step (forward, recomputed forward, backward; loop trip "
        f"counts applied; attention blocks above the causal diagonal counted though skipped at run time) / a "
        f"GB200's dense bf16 peak ({GB200_BF16_DENSE_TFLOPS:g} TFLOP/s): a lower bound on step time, to read "
        "the communication time against",
        "",
        f"Collective time model (labelled a model: ring algorithms, no latency, no overlap with compute), "
        f"NVLink 5 = {report['nvlink_gbps']:g} GB/s per GPU per direction inside a rack, InfiniBand = "
        f"{report['ib_gbps']:g} GB/s per GPU (400 Gb/s) across racks; B = bytes per device as counted "
        "(all-gather: gathered result; reduce-scatter: the shard S; all-reduce: the array), n = group size, "
        "k = NVLink domains the group spans, m = n/k:",
        "",
        "- flat (slowest link decides: IB if k > 1): all-gather B(n-1)/n/bw; reduce-scatter S(n-1)/bw; "
        "all-reduce 2B(n-1)/n/bw; collective-permute B/bw",
        "- two-level: all-gather B(k-1)/n/IB + B(m-1)/m/NVL; reduce-scatter S k(m-1)/NVL + S(k-1)/IB; "
        "all-reduce 2B(m-1)/m/NVL + 2(B/m)(k-1)/k/IB",
        "- a collective inside a while loop (the scanned backward pass) counts trip-count times",
        "",
        "## Caveats",
        "",
        "- Figures come from an XLA:CPU compile. The gradient sum is an explicit all-to-all of bf16 bits into "
        "the master tiles plus a local f32 fold in shard order: the same bytes on the wire as a bf16 "
        "reduce-scatter, on any backend.",
        "- Layers are rematerialised: each layer's weights are gathered twice per step (forward, and again in "
        "the backward pass); the analytic gather figures count both passes (passes = 2 above). XLA "
        "temporaries hold one layer's gathered weights and gradients, the embedding and head, and the "
        "activations saved per layer.",
        "- 'analytic' counts the tile padding of the masters and the Adam state (numel' above: each matrix's "
        "tiles rounded up to a multiple of N); the packed params and gathers are counted unpadded.",
        "",
    ]
    return "\n".join(lines)


def command_of(report: Dict[str, Any]) -> str:
    """The ``python -m benchmarks scale`` command that reproduces ``report`` (a scale JSON
    record), from its recorded configuration: model, mesh, tensor axis, NVLink domain,
    sharding, weights, overrides, sequence, micro-batch and link speeds (defaults left out)."""
    m = re.fullmatch(r"(gb200|data)-(\d+)(?:-nvl(\d+))?(?:-t(\d+))?(?:-(hsdp|flat))?", report["mesh_spec"])
    kind, count, nvl, t, sharding = m.groups()
    weights = [r["weights"] for r in report["runs"]]
    args = ["--model", report["model"], "--mesh", f"{kind}:{count}"]
    args += ["--tensor", t] if t else []
    args += ["--nvl-domain", nvl] if nvl else []
    args += ["--sharding", sharding] if sharding else []
    args += [] if sorted(weights) == ["bf16", "nvfp4"] else ["--weights", weights[0]]
    for k, v in (report.get("overrides") or {}).items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    for flag, key, default in (("--seq-len", "seq_len", SEQ_LEN), ("--micro-batch", "micro_batch", 1),
                               ("--nvlink-gbps", "nvlink_gbps", NVLINK_GBPS), ("--ib-gbps", "ib_gbps", IB_GBPS)):
        if report.get(key, default) != default:
            args += [flag, f"{report[key]:g}" if isinstance(report[key], float) else str(report[key])]
    return " ".join(["python -m benchmarks scale", *args])


def rerender(results_dir: str = RESULTS) -> List[str]:
    """Re-render every ``scale_*.md`` in ``results_dir`` from its ``.json`` (no compile)."""
    done = []
    for name in sorted(os.listdir(results_dir)):
        if name.startswith("scale_") and name.endswith(".json"):
            with open(os.path.join(results_dir, name)) as f:
                report = json.load(f)
            with open(os.path.join(results_dir, name[:-5] + ".md"), "w") as f:
                f.write(markdown(report))
            done.append(name[:-5] + ".md")
    return done


# ----------------------------------------------------------------------------- FSDP vs HSDP vs flat
def sharding_table(results_dir: str = RESULTS) -> str:
    """Markdown table of the NVFP4 runs on GB200 racks in ``results_dir`` (files
    ``scale_<model>_gb200-<R>[-t<T>][-hsdp|-flat].json``, default preset shapes): per device
    memory of the step and of evaluation, and modelled communication per step against its
    analytic figure and against the compute time, for each sharding and tensor-axis size."""
    rows, tokens = [], set()
    for path in sorted(os.listdir(results_dir)):
        m = re.fullmatch(r"scale_(\w+?)_gb200-(\d+)(?:-t(\d+))?(?:-(hsdp|flat))?\.json", path)
        if not m:
            continue
        with open(os.path.join(results_dir, path)) as f:
            rep = json.load(f)
        run = next((r for r in rep["runs"] if r["weights"] == "nvfp4"), None)
        if run is None or rep.get("overrides"):
            continue
        tokens.add(rep.get("seq_len", 0) * rep.get("micro_batch", 1))
        me, an = run["measured"], run["analytic"]
        state = me["params"] + me["master"] + me["opt_state"]
        model, racks, t, sharding = m.group(1), int(m.group(2)), int(m.group(3) or 1), m.group(4) or "fsdp"
        order = {"fsdp": 0, "hsdp": 1, "flat": 2}[sharding]
        rows.append(((PRESETS[model]["d_model"], racks, order, t), [
            model, str(racks), str(t), sharding, _fmt_bytes(state), _fmt_bytes(me["xla_peak"]),
            _fmt_bytes(me.get("eval_xla_peak")), _fmt_bytes(me["ib_bytes"]), _fmt_s(me["time_2level_s"]),
            _fmt_s(an["time_2level_s"]), _ratio(me["time_2level_s"], an["time_2level_s"]),
            _fmt_s(me.get("compute_s"))]))
    per_device = " / ".join(str(t) for t in sorted(tokens)) or "-"
    lines = [
        "# FSDP x tensor parallel, HSDP and one flat data axis on GB200 NVL72 racks",
        "",
        "NVFP4 weights, `python -m benchmarks scale --model M --mesh gb200:R --tensor T --weights nvfp4 "
        f"--sharding S` (per device, per step, {per_device} tokens per data shard; table: "
        "`python -m benchmarks scale --table`). fsdp: state sharded over racks x in-rack data, gathers and "
        "gradient sums one level at a time; hsdp: sharded inside a rack, replicated across racks; flat: one "
        "data axis over every rack (`mesh.layout: auto`); tensor T: Megatron tensor + sequence parallelism "
        "inside the rack, each weight's tensor shard gathered over the data axes only. Peak: XLA arguments + "
        "temporaries + outputs - aliased of the train step and of the evaluation program. Modelled time: the "
        "two-level link model of each collective as compiled; analytic: the ideal two-level (in-rack, "
        "then across racks) algorithms for the state's sharding (gathers and reduce-scatters of the state's "
        "data group + the tensor-parallel activation collectives; see `scale_*.md`): for fsdp and flat "
        "rows the same figure, the hierarchical ideal of a state sharded over every data device, so a flat "
        "row's ratio is what one flat data axis costs against it; for hsdp rows gathers and reduce-scatters "
        "inside a rack, then the rack's shard all-reduced across racks; compute: the step's dot FLOPs at a GB200's dense bf16 peak "
        f"({GB200_BF16_DENSE_TFLOPS:g} TFLOP/s), a lower bound.",
        "",
        "| model | racks | tensor | sharding | state (params + master + Adam) | step peak | eval peak | "
        "InfiniBand bytes | modelled comm time | ... analytic | ratio | compute time |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += ["| " + " | ".join(r) + " |" for _, r in sorted(rows)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI
def mesh_text(text: str) -> str:
    """``--mesh``'s ``type=``: a spec :meth:`MeshSpec.parse` reads (returned as given)."""
    from benchmarks import arguments as A

    try:
        MeshSpec.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{A.show(text)}: {MESH_FORMS}") from None
    return text


# Which argument a config error of the compiled model comes from (the mesh's and the model's
# rules of train.config): the key it names.
_KEY_FLAGS = {"mesh.tensor": "tensor", "mesh.nvl_domain": "nvl_domain", "model.layers": "layers",
              "model.vocab": "vocab", "model.seq_len": "seq_len", "data.batch_size": "micro_batch"}


def parse_args(argv=None):
    """The arguments, checked together before JAX starts: the mesh spec, and the model on it
    by the training stack's own rules (``train.config.validate_for_devices``: heads, widths,
    vocabulary and sequence split over the tensor axis, the tensor axis inside one NVLink
    domain). A bad one is one line on stderr and exit 2 (:mod:`benchmarks.arguments`)."""
    from benchmarks import arguments as A

    p = A.Parser(prog="python -m benchmarks.scale", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", choices=sorted(PRESETS), default="8b")
    p.add_argument("--mesh", default="gb200:2", type=mesh_text,
                   help="gb200:RACKS (RACKS x nvl-domain devices) or data:N")
    p.add_argument("--tensor", type=A.positive_int, default=1, help="tensor-axis size (inside one NVLink domain)")
    p.add_argument("--nvl-domain", type=A.positive_int, default=72, help="devices per NVLink domain (72 = NVL72)")
    p.add_argument("--sharding", choices=("fsdp", "hsdp", "flat"), default="fsdp",
                   help="gb200 meshes: fsdp (rack x data axes, state sharded over both), hsdp (sharded "
                        "inside a rack, replicated across racks) or flat (one data axis over all racks)")
    p.add_argument("--weights", choices=("nvfp4", "bf16", "both"), default="both")
    p.add_argument("--layers", type=A.positive_int, help="override the preset's layer count (e.g. for a fast test)")
    p.add_argument("--vocab", type=A.positive_int, help="override the preset's vocabulary size")
    p.add_argument("--seq-len", type=A.positive_int, default=SEQ_LEN, help="tokens per sequence (and per data shard "
                   "with --micro-batch 1)")
    p.add_argument("--micro-batch", type=A.positive_int, default=1, help="sequences per data shard")
    p.add_argument("--nvlink-gbps", type=A.positive_float, default=NVLINK_GBPS)
    p.add_argument("--ib-gbps", type=A.positive_float, default=IB_GBPS)
    p.add_argument("--out", default=RESULTS, type=A.output_dir,
                   help="directory for scale_<model>_<mesh>.json/.md ('' = none)")
    p.add_argument("--table", action="store_true",
                   help="only write the FSDP / HSDP / flat table of the results in --out (SHARDING.md)")
    p.add_argument("--render", action="store_true",
                   help="only re-render every scale_*.md in --out from its .json (no compile), then SHARDING.md")
    args = p.parse_args(argv)
    if not (args.table or args.render):
        from train.config import ConfigError, validate_for_devices

        spec = MeshSpec.parse(args.mesh, args.tensor, args.nvl_domain, args.sharding)
        preset = dict(PRESETS[args.model], **{k: v for k, v in (("layers", args.layers), ("vocab", args.vocab))
                                              if v is not None})
        try:
            validate_for_devices(make_config(preset, spec, "nvfp4", args.seq_len, args.micro_batch), spec.devices)
        except ConfigError as e:
            why = str(e)
            key = next((k for k in _KEY_FLAGS if why.startswith(k)), None)
            dest = "tensor" if "tensor axis" in why else _KEY_FLAGS.get(key, "model")
            p.error(f"--{dest.replace('_', '-')} {getattr(args, dest)}: {why}")
    return args


def _request_devices(n: int) -> None:
    """Simulated CPU devices: must be set before the JAX backend starts. The simulated mesh is
    what this benchmark measures, so a device count in XLA_FLAGS (e.g. inherited from a test
    run) is overridden."""
    import jax

    from jax_nvfp4.mesh import simulate_cpu_devices

    simulate_cpu_devices(n, override=True)
    if len(jax.devices()) < n:
        raise SystemExit(f"benchmarks.scale: needs {n} simulated CPU devices but JAX already started with "
                         f"{len(jax.devices())}; run it in a fresh process (python -m benchmarks.scale ...)")


def main(argv=None) -> Dict[str, Any]:
    from benchmarks import arguments as A

    args = parse_args(argv)
    if args.out:
        A.make_output_dir(args.out)
    if args.render:
        for name in rerender(args.out):
            print(f"[scale] rendered {name}", file=sys.stderr)
    if args.table or args.render:
        text = sharding_table(args.out)
        with open(os.path.join(args.out, "SHARDING.md"), "w") as f:
            f.write(text)
        print(text)
        return {"table": text}
    import jax

    from benchmarks.common import source_state

    spec = MeshSpec.parse(args.mesh, args.tensor, args.nvl_domain, args.sharding)
    preset = dict(PRESETS[args.model])
    overrides = {k: v for k, v in (("layers", args.layers), ("vocab", args.vocab)) if v is not None}
    preset.update(overrides)
    weights = ("nvfp4", "bf16") if args.weights == "both" else (args.weights,)
    t_start = time.perf_counter()
    _request_devices(spec.devices)

    runs = []
    for w in weights:
        cfg = make_config(preset, spec, w, args.seq_len, args.micro_batch)
        runs.append(compile_step(cfg, spec, args.nvlink_gbps, args.ib_gbps))
        print(f"[scale] {args.model} {spec.label} {w}: compiled in {runs[-1]['seconds']['compile']:.1f} s",
              file=sys.stderr, flush=True)
    report = {
        "command": " ".join(["python -m benchmarks scale", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "model": args.model,
        "mesh_spec": spec.label,
        "devices": spec.devices,
        "config": preset,
        "overrides": overrides,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "nvlink_gbps": args.nvlink_gbps,
        "ib_gbps": args.ib_gbps,
        "numel": runs[0]["analytic"]["numel"],
        "code": {**source_state(), "jax": jax.__version__},
        "runs": runs,
        "wall_s": time.perf_counter() - t_start,
    }
    text = markdown(report)
    print(text)
    if args.out:
        suffix = "".join(f"_{k[0]}{v}" for k, v in overrides.items())
        base = os.path.join(args.out, f"scale_{args.model}{suffix}_{spec.label}")
        with open(base + ".json", "w") as f:
            json.dump(report, f, indent=2)
        with open(base + ".md", "w") as f:
            f.write(text)
        print(f"[scale] wrote {base}.json and .md", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
