"""Figures 1-3 of one compiled training step, NVFP4 weights vs bf16 weights on the same mesh.

For a model size and a data-axis size, :func:`measure_pair` builds the trainer of ``train.step``
twice (``nvfp4.weights=nvfp4`` and ``=bf16``), compiles each step once, and reads:

1. traffic: bytes per device per step of every collective in the compiled HLO, loop trip
   counts applied, by purpose, and the weight gathers split into NVFP4 leaves and their bf16
   equivalent (:mod:`jax_nvfp4.comm`, the accounting ``python -m train`` prints);
2. memory: per-device bytes of params, float32 masters, the rest of the optimizer state (from
   the arrays' addressable shards), the float gradient tree (analytic: every device holds the
   whole gradient of its weights before the cross-device reduction), and the compiled step's
   temporaries (``compiled.memory_analysis()``);
3. speed: the median wall time of repeated steps after compilation.
"""

from __future__ import annotations

import collections
import math
import os
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv
from train import data as data_lib
from train import programs
from train import accounting as accounting_lib
from train import plan as plan_lib
from train import mesh as mesh_lib
from train.config import Config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "train", "configs")

# Model sizes: a config file under train/configs plus overrides (what `python -m train` takes).
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": {"config": "tiny.yaml", "overrides": []},  # d=64, 2 layers, seq 64, batch 16
    "small": {"config": "small.yaml", "overrides": []},  # d=128, 4 layers, seq 128, batch 32
    "medium": {"config": "small.yaml",
               "overrides": ["model.d_model=256", "model.heads=8", "model.mlp_hidden=704"]},
    # For GPUs (python -m benchmarks gpu): the default job's model, and a 1.1B-parameter Llama
    # (TinyLlama's shapes: grouped-query attention, 2048-token sequences).
    "default": {"config": "default.yaml", "overrides": []},
    "1b": {"config": "default.yaml",
           "overrides": ["model.d_model=2048", "model.layers=22", "model.heads=32", "model.kv_heads=4",
                         "model.mlp_hidden=5632", "model.vocab=32000", "model.seq_len=2048",
                         "data.batch_size=4"]},
}
# The physical limit of a packed gather with the default config's NVFP4 block: 4 bits per
# value plus the E4M3 scale bytes of each 16x16 tile, over 16 bits per bf16 value.
DEFAULT_BLOCK = plan_lib.policy_for(load_config(os.path.join(CONFIGS, "default.yaml"))).block
LEAF_LIMIT = nv.layout.packed_gather_ratio(DEFAULT_BLOCK)
LEAF_LIMIT_TEXT = nv.layout.packed_gather_text(DEFAULT_BLOCK)


def size_config(size: str, weights: str, extra: Sequence[str] = ()) -> Config:
    spec = SIZES[size]
    return load_config(os.path.join(CONFIGS, spec["config"]),
                       [*spec["overrides"], "mesh.data=-1", "mesh.tensor=1",
                        f"nvfp4.weights={weights}", *extra])


def model_summary(cfg: Config) -> Dict[str, Any]:
    m = cfg.model
    return {"d_model": m.d_model, "layers": m.layers, "heads": m.heads, "mlp_hidden": m.mlp_hidden,
            "vocab": m.vocab, "seq_len": m.seq_len, "batch_size": cfg.data.batch_size}


# ----------------------------------------------------------------------------- memory
def _per_device_bytes(tree) -> Dict[Any, int]:
    """Bytes each device holds of the arrays in ``tree``, from their addressable shards."""
    out: Dict[Any, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


def _max_bytes(tree) -> int:
    per = _per_device_bytes(tree)
    return max(per.values()) if per else 0


def grad_bytes_per_device(opt_state) -> int:
    """Bytes of the gradients a device holds after the backward pass: each layer's weight
    gradient is reduce-scattered inside the backward pass straight into the master layout,
    so it is this device's float32 shard of every master."""
    return _max_bytes(nv.find_state(opt_state).master)


def state_memory(trainer, params, opt_state) -> Dict[str, int]:
    mw = nv.find_state(opt_state)
    master = _max_bytes(mw.master)
    opt_all = _max_bytes(opt_state)
    out = {
        "params": _max_bytes(params),
        "master": master,
        "optimizer": opt_all - master,
        "grads": grad_bytes_per_device(opt_state),
    }
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- one point
def measure(cfg: Config, devices: Sequence[Any], *, time_steps: int = 3) -> Dict[str, Any]:
    """Figures 1-3 of ``cfg``'s compiled step on a data-parallel mesh of ``devices``."""
    t0 = time.perf_counter()
    mesh = mesh_lib.build_mesh(cfg.mesh, list(devices))
    trainer, params, opt_state = programs.build(cfg, mesh)
    source = data_lib.make_source(cfg.data, cfg.model)
    it = data_lib.make_data_iterator(cfg, process_index=jax.process_index(),
                                     process_count=jax.process_count(), source=source)
    batch = programs.global_batch(trainer, it.batch_at(0))
    # The compiled step the CLI reads its accounting from (train.accounting.compiled_step): the same
    # program, parsed once.
    step = accounting_lib.compiled_step(trainer)
    build_s = time.perf_counter() - t0
    program = step["program"]
    gathers = program.weight_gathers()
    memory = state_memory(trainer, params, opt_state)
    memory.update({f"compiled_{k}": v for k, v in step["memory"].items()})
    n_params = sum(math.prod(l.shape) for l in jax.tree.leaves(params, is_leaf=nv.layout.is_tiled))
    n_nvfp4 = sum(math.prod(l.shape) for l in jax.tree.leaves(params, is_leaf=nv.layout.is_tiled) if isinstance(l, nv.TiledNVFP4))

    times: List[float] = []
    loss = None
    if time_steps > 0:
        key = jax.random.key(cfg.train.seed + 2)
        for i in range(time_steps + 1):  # the first call after compilation is not timed
            t = time.perf_counter()
            params, opt_state, m = trainer.step_fn(params, opt_state, batch, jax.random.fold_in(key, i))
            loss = float(m["loss"])  # syncs the step
            if i:
                times.append(time.perf_counter() - t)
    out = {
        "weights": cfg.nvfp4.weights,
        "data": mesh.shape["data"],
        "n_params": n_params,
        "n_nvfp4_params": n_nvfp4,
        # Weight all-gathers of the compiled step (every layer's gathers, forward and
        # rematerialised backward) and their bf16 equivalents: the same figures python -m train
        # prints (jax_nvfp4.comm.Program.weight_gathers).
        "gather": {
            "param_gather_bytes": gathers["all_gather_bytes"],
            "nvfp4_gather_bytes": gathers["nvfp4_gather_bytes"],
            "bf16_gather_bytes": gathers["bf16_gather_bytes"],
            "nvfp4_bf16_gather_bytes": gathers["nvfp4_bf16_gather_bytes"],
        },
        "collectives_per_step": {f"{op}:{dt}": b for (op, dt), b in program.by("op", "dtype").items()},
        "collectives_by_purpose": program.by_purpose(),
        "grad_reduce_bytes": program.total(purpose="grad reduce"),
        "all_collective_bytes": program.total(),
        "memory": memory,
        "step_time_s": statistics.median(times) if times else None,
        "step_times_s": times,
        "loss_after_steps": loss,
        # Library calls of the compiled step by target (cuDNN attention, block-scaled GEMMs).
        "custom_calls": nv.comm.custom_calls(step["text"]),
        "build_compile_s": build_s,
        "hlo_warnings": list(program.warnings),
    }
    return out


def _ratio(a, b) -> Optional[float]:
    return (a / b) if (a is not None and b) else None


def packed_gather_measured(n: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """The packed gather ratio measured across the two runs of one point (``n``: NVFP4 weights,
    ``b``: bf16 weights, as :func:`measure` returns them), from their compiled collectives alone:
    the NVFP4 run's packed (u8) weight all-gathers over the bf16 run's weight all-gathers less
    those of the leaves both runs keep in bf16 (the NVFP4 run's other weight gathers). Unlike
    ``jax_nvfp4.comm``'s per-leaf figure (a bf16 gather of the same leaves counted as 4 x the
    NVFP4 run's own code bytes) this rises above the layout's ratio when codes are gathered more
    often than the bf16 weights are.

    ``comparable`` is False where the bf16 run keeps weights replicated (not gathered) that the
    NVFP4 run shards and gathers: its replicated-gradient all-gathers then exceed the NVFP4
    run's (NVFP4 leaves are always sharded; plain leaves under ``Rules.min_shard_size`` are not),
    so the denominator lacks those weights."""
    def purpose(run, name):
        return run["collectives_by_purpose"].get(name, {})

    wn, wb = purpose(n, "weight gather"), purpose(b, "weight gather")
    # Packed bytes gathered at the end of a step (re-quantized shards into replicated params) count too.
    packed = (sum(v for k, v in wn.items() if k.endswith(":u8"))
              + purpose(n, "re-quantize").get("all-gather:u8", 0))
    kept = sum(v for k, v in wn.items() if not k.endswith(":u8"))
    bf16_same = sum(wb.values()) - kept
    gn = purpose(n, "grad reduce").get("all-gather:u16", 0)
    gb = purpose(b, "grad reduce").get("all-gather:u16", 0)
    return {"packed_bytes": packed, "bf16_bytes": bf16_same, "kept_bf16_bytes": kept,
            "ratio": _ratio(packed, bf16_same) if packed else None,
            "comparable": gb <= gn, "bf16_replicated_grad_gather_bytes": gb - gn}


def ratios(n: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """NVFP4 / bf16 figures of one (size, data) point."""
    g = n["gather"]
    return {
        "leaf_gather": _ratio(g["nvfp4_gather_bytes"], g["nvfp4_bf16_gather_bytes"]),
        "leaf_gather_measured": packed_gather_measured(n, b)["ratio"],
        "leaf_gather_vs_limit": _ratio(_ratio(g["nvfp4_gather_bytes"], g["nvfp4_bf16_gather_bytes"]), LEAF_LIMIT),
        "model_gather": _ratio(g["param_gather_bytes"], b["gather"]["param_gather_bytes"]),
        "model_gather_vs_analytic_bf16": _ratio(g["param_gather_bytes"], g["bf16_gather_bytes"]),
        "grad_reduce": _ratio(n["grad_reduce_bytes"], b["grad_reduce_bytes"]),
        "all_collectives": _ratio(n["all_collective_bytes"], b["all_collective_bytes"]),
        "params_memory": _ratio(n["memory"]["params"], b["memory"]["params"]),
        "state_memory": _ratio(n["memory"]["total"], b["memory"]["total"]),
        "temp_memory": _ratio(n["memory"]["compiled_temp"], b["memory"]["compiled_temp"]),
        "step_time": _ratio(n["step_time_s"], b["step_time_s"]),
    }


def measure_pair(size: str, n_data: int, devices: Sequence[Any], *, time_steps: int = 3,
                 log=print, extra: Sequence[str] = ()) -> Dict[str, Any]:
    """NVFP4 and bf16 weights of model ``size`` (config overrides ``extra``) on the first
    ``n_data`` of ``devices``."""
    res: Dict[str, Any] = {"size": size, "data": n_data}
    for weights in ("nvfp4", "bf16"):
        cfg = size_config(size, weights, extra)
        res.setdefault("model", model_summary(cfg))
        r = measure(cfg, devices[:n_data], time_steps=time_steps)
        res[weights] = r
        st = f"{r['step_time_s'] * 1e3:.1f} ms/step" if r["step_time_s"] else "not timed"
        log(f"  {size:>6} data={n_data} {weights:>5}: param gather {r['gather']['param_gather_bytes']:>10,} B, "
            f"state {r['memory']['total']:>11,} B/device, {st} (build+compile {r['build_compile_s']:.1f} s)")
    res["ratios"] = ratios(res["nvfp4"], res["bf16"])
    return res


def data_sizes_for(devices: Sequence[Any], wanted: Sequence[int] = (1, 2, 4, 8)) -> List[int]:
    return [n for n in wanted if n <= len(devices)]
