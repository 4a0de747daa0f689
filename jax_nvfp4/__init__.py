"""jax_nvfp4: model weights that live in NVFP4 during data-parallel training in JAX.

The core API, by kind (everything else lives in the submodule that owns it):

The array format
  :class:`NVFP4Array` (packed E2M1 codes, E4M3 block scales, a float32 global amax),
  :func:`quantize`, :func:`dequantize`, the block shapes :data:`BLOCK_1D` (1x16) and
  :data:`BLOCK_2D` (16x16 tiles).
Policies and rules
  :class:`Policy` (which leaves are NVFP4), :class:`Rules` (where state lives on the mesh:
  data, replica and tensor axes, stacked layers), :func:`quantize_params`,
  :func:`dequantize_params`.
The sharded layout
  :class:`Layout` (the one tile-major layout of a param and its master), :class:`TiledNVFP4`,
  :class:`Tiled`, :func:`shard_params`, :func:`shardings`, :func:`gather` (the whole-model
  gather, packed bytes only).
The optimizer wrapper
  :func:`master_weights` (float32 masters sharded like the params, any optax transform
  inside), its state :class:`MasterWeightsState`, :func:`find_state`, :func:`sharded_state`
  (the stored params and the optimizer state built where they live, in one program).
The sharded step
  :func:`make_step`, :func:`make_eval` (FSDP one layer at a time, times tensor parallelism,
  for any Flax model), :class:`Shard` (a parameter as a layer reads it inside the step),
  :class:`TensorParallel`, :func:`tensor_rules_from_logical`.
The GEMM
  :func:`dot` (the NVFP4 recipe's quantized GEMMs), :class:`Recipe`,
  :func:`intercept_dense` (the recipe on stock ``nn.Dense`` layers), :class:`NVFP4Dense`.

Submodules outside the core, imported on first use (``nv.export``, ...):
:mod:`jax_nvfp4.export` (native, Hugging Face / compressed-tensors and ModelOpt files),
:mod:`jax_nvfp4.hf` (a Hugging Face checkpoint read into a sharded training state),
:mod:`jax_nvfp4.checkpoint` (its ``Checkpointer``: atomic, hash-verified orbax checkpoints of a
state, restored onto any mesh),
:mod:`jax_nvfp4.calibrate` (W4A4 activation calibration), :mod:`jax_nvfp4.mesh` (device meshes,
GB200 racks), :mod:`jax_nvfp4.xla_flags` (XLA:GPU flags that overlap the weight gathers) and
:mod:`jax_nvfp4.comm` (collective accounting of compiled HLO).
"""

import importlib

from jax_nvfp4.array import BLOCK_1D, BLOCK_2D, NVFP4Array, dequantize, quantize
from jax_nvfp4.gemm import dot
from jax_nvfp4.layout import Layout, Tiled, TiledNVFP4
from jax_nvfp4.nn import NVFP4Dense, Recipe, intercept_dense
from jax_nvfp4.optim import MasterWeightsState, find_state, master_weights, sharded_state
from jax_nvfp4.params import Policy, dequantize_params, quantize_params
from jax_nvfp4.rules import Rules
from jax_nvfp4.sharding import gather, shard_params, shardings
from jax_nvfp4.fetch import Shard
from jax_nvfp4.step import make_eval, make_step, tensor_rules_from_logical
from jax_nvfp4.tensor_parallel import TensorParallel

# The core's own submodules are loaded by the imports above; these are loaded on first use.
_LAZY = ("calibrate", "checkpoint", "comm", "export", "hf", "mesh", "xla_flags")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"jax_nvfp4.{name}")
    raise AttributeError(f"module 'jax_nvfp4' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    # the array format
    "BLOCK_1D",
    "BLOCK_2D",
    "NVFP4Array",
    "dequantize",
    "quantize",
    # policies and rules
    "Policy",
    "Rules",
    "dequantize_params",
    "quantize_params",
    # the sharded layout
    "Layout",
    "Tiled",
    "TiledNVFP4",
    "gather",
    "shard_params",
    "shardings",
    # the optimizer wrapper
    "MasterWeightsState",
    "find_state",
    "master_weights",
    "sharded_state",
    # the sharded step
    "Shard",
    "TensorParallel",
    "make_eval",
    "make_step",
    "tensor_rules_from_logical",
    # the GEMM
    "NVFP4Dense",
    "Recipe",
    "dot",
    "intercept_dense",
]
