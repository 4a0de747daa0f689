"""jax_nvfp4: model weights that live in NVFP4 during data-parallel training in JAX.

Core format (``quantize``, ``dequantize``, ``NVFP4Array``), parameter policies
(``quantize_params``, ``dequantize_params``), the one sharded layout (``Layout``,
``TiledNVFP4``, ``Tiled``, ``shard_params``, ``shardings``), per-layer gathers and ordered
reductions (``gather_weight``, ``ordered_reduce_scatter``), the master-weight optimizer wrapper
(``master_weights``) and HLO accounting (``collective_bytes``).
"""

from jax_nvfp4.array import (
    BLOCK_1D,
    BLOCK_COLUMN,
    BLOCK_2D,
    NVFP4Array,
    codes,
    dequantize,
    from_codes,
    is_nvfp4,
    isfinite,
    packed_shapes,
    quantize,
    transpose,
)
from jax_nvfp4.comm import collective_bytes, total_bytes
from jax_nvfp4.export import ExportError, export_hf, export_nvfp4, load_nvfp4
from jax_nvfp4.gemm import BackendUnavailableError, cuda_target, dot, last_backend, resolve_backend
from jax_nvfp4.nn import NVFP4Dense
from jax_nvfp4.numerics import hadamard_matrix, hadamard_transform
from jax_nvfp4.collectives import all_gather_bits, ordered_mean, ordered_reduce_scatter, ordered_sum, ordered_sum_scatter
from jax_nvfp4.fetch import GatherConfig, Shard, gather_weight
from jax_nvfp4.step import make_eval, make_step, tensor_parallel, tensor_rules_from_logical
from jax_nvfp4.tensor_parallel import TensorParallel
from jax_nvfp4.layout import Layout, Tiled, TiledNVFP4, is_tiled
from jax_nvfp4.optim import (
    MasterWeightsState,
    apply_updates,
    clip_by_global_norm,
    find_state,
    master_weights,
    raise_if_skipped,
)
from jax_nvfp4.rules import Rules, layout_for
from jax_nvfp4.params import DEFAULT_POLICY, Policy, dequantize_params, path_str, quantize_params
from jax_nvfp4.sharding import (
    gather,
    gather_dequantized,
    global_norm,
    logical,
    partition_specs,
    requantize,
    shard_params,
    shardings,
)

__version__ = "0.1.0"

__all__ = [
    "BLOCK_1D",
    "BLOCK_COLUMN",
    "BLOCK_2D",
    "BackendUnavailableError",
    "NVFP4Dense",
    "dot",
    "ExportError",
    "export_hf",
    "export_nvfp4",
    "load_nvfp4",
    "cuda_target",
    "last_backend",
    "resolve_backend",
    "DEFAULT_POLICY",
    "GatherConfig",
    "Shard",
    "make_eval",
    "make_step",
    "tensor_parallel",
    "tensor_rules_from_logical",
    "Layout",
    "Tiled",
    "TiledNVFP4",
    "clip_by_global_norm",
    "gather_weight",
    "global_norm",
    "is_tiled",
    "layout_for",
    "logical",
    "ordered_mean",
    "ordered_reduce_scatter",
    "ordered_sum",
    "ordered_sum_scatter",
    "all_gather_bits",
    "TensorParallel",
    "shard_params",
    "MasterWeightsState",
    "NVFP4Array",
    "Policy",
    "Rules",
    "apply_updates",
    "codes",
    "collective_bytes",
    "dequantize",
    "dequantize_params",
    "from_codes",
    "gather",
    "gather_dequantized",
    "hadamard_matrix",
    "hadamard_transform",
    "is_nvfp4",
    "isfinite",
    "master_weights",
    "raise_if_skipped",
    "find_state",
    "packed_shapes",
    "partition_specs",
    "path_str",
    "quantize",
    "quantize_params",
    "requantize",
    "shardings",
    "total_bytes",
    "transpose",
]
