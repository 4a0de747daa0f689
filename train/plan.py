"""Which params are NVFP4 and where the run's state lives, from its config: the library's policy
and sharding rules."""

from __future__ import annotations

import jax.numpy as jnp

import jax_nvfp4 as nv
from train.config import Config
from train.model import KEPT_SEGMENTS, tensor_rules

# nvfp4.block: one scale per 16x16 tile, or per 16 consecutive inputs of an [in, out] kernel.
BLOCKS = {"2d": nv.BLOCK_2D, "1d": nv.array.BLOCK_COLUMN}
# nvfp4.fused_amax: the projections a serving engine fuses into one GEMM with one global scale.
FUSED_AMAX = (r"attn/(q|k|v)/kernel$", r"mlp/(gate|up)/kernel$")


def policy_for(cfg: Config) -> nv.Policy:
    """Which params are NVFP4: everything the default policy takes, except the kept parts."""
    if cfg.nvfp4.weights == "bf16":
        return nv.Policy(keep=(".*",), keep_dtype=jnp.bfloat16)
    keep = tuple(cfg.nvfp4.keep_bf16) + tuple(f"^{seg}/" for seg in KEPT_SEGMENTS)
    shared = FUSED_AMAX if cfg.nvfp4.fused_amax else ()
    return nv.Policy(keep=keep, keep_dtype=jnp.bfloat16, block=BLOCKS[cfg.nvfp4.resolved_block()], shared_amax=shared,
                     four_over_six=cfg.nvfp4.four_over_six)


def rules_for(cfg: Config, tensor: int = 1) -> nv.Rules:
    """Where the state lives; scanned segments stack layers on axis 0, and large bf16 leaves are
    sharded and gathered like NVFP4 ones (a like-for-like comparison). ``mesh.layout: gb200``:
    ``fsdp`` shards over ``("data", "rack")`` (racks minor), ``hsdp`` over ``data`` and replicates
    across racks. ``tensor``: the tensor axis's size (:func:`train.model.tensor_rules`)."""
    common = dict(tensor_axis="tensor", tensor=tensor_rules(cfg.model.n_kv_heads, tensor), stacked=(r"^blocks",))
    if cfg.mesh.layout != "gb200":
        return nv.Rules(data_axis="data", **common)
    if cfg.mesh.sharding == "hsdp":
        return nv.Rules(data_axis="data", replica_axis="rack", **common)
    return nv.Rules(data_axis=("data", "rack"), **common)
