"""What a GPU would run, checked on a host without one: the training stack's step and
evaluation lowered for CUDA (``trace(...).lower(lowering_platforms=("cuda",))``) from their
public entry points (``train.programs.build``, ``abstract_step_args``, ``step_fn``, ``eval_fn``).

- The recipe's GEMMs (``nvfp4.compute=nvfp4``) are block-scaled dots of E2M1 codes with E4M3
  scales in every NVFP4 layer (fprop, dgrad and wgrad in the step; fprop in evaluation), and
  the weights-only recipe has none.
- No collective moves floats: NVFP4 weights are all-gathered as u8 (codes and scale bytes),
  other values as their bits; with a tensor axis each layer's gather crosses the data axis
  only, and the activations cross the tensor axis as bits.
- Attention: JAX traces cuDNN's fused attention only where cuDNN is present, so a program
  lowered for CUDA on a host without a GPU carries the blockwise attention
  (``train.attention``); on a GPU host ``model.attention=auto`` traces the cuDNN branch.
"""

import jax
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import comm, gemm
from conftest import job, mesh_of

FLOATS = ("f16", "bf16", "f32", "f64", "f8e4m3fn", "f8e5m2", "f4e2m1fn")
# Collectives of values computed inside the model (activation amax, tensor-parallel sums) or of
# the loss: may move floats, but never anything the size of a weight.
ACTIVATIONS = ("tensor parallel", "loss / metrics", "other")


def lower_for_cuda(fn, *args) -> str:
    """HLO of ``fn`` lowered for CUDA, with the name scopes and call stacks that give each
    collective its purpose (:func:`jax_nvfp4.comm.parse`)."""
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo", debug_info=True)


def nvfp4_layers(trainer):
    """The stored NVFP4 leaves: one per NVFP4 linear layer of a block (stacked over the blocks)."""
    return [p for p in jax.tree.leaves(trainer.abstract_params, is_leaf=nv.layout.is_tiled) if isinstance(p, nv.TiledNVFP4)]


def assert_packed_gathers(text: str, layers, mesh) -> None:
    """Weights, gradients and masters move as bits: no float collective for them, and every
    NVFP4 layer's codes and scale bytes all-gathered as u8 over the data axis, one layer's
    tensor shard at a time."""
    program = comm.parse(text, mesh)
    smallest = min(p.data.size // p.data.shape[0] for p in layers)
    floats = [c for c in program.collectives if c.dtype in FLOATS]
    assert all(c.purpose in ACTIVATIONS and c.bytes < smallest for c in floats), program.by("op", "dtype", "purpose")
    assert {c.dtype for c in program.select(op="all-gather", purpose="weight gather")} <= {"u8", "u16"}
    packed = program.select(op="all-gather", dtype="u8", purpose="weight gather")
    assert {c.axes for c in packed} == {("data",)}
    gathered = {c.shape for c in packed}
    t = mesh.shape["tensor"]
    for p in layers:
        for leaf in (p.data, p.scale_bits):  # [layers, t, T, ...]: one layer's tensor shard, whole over data
            assert (1, *leaf.shape[2:]) in gathered, (leaf.shape, sorted(gathered))
            assert leaf.shape[1] == t
    assert not any("cudnn" in k for k in comm.custom_calls(text))


@pytest.mark.parametrize("compute,tensor", [pytest.param("dequant", 1, marks=pytest.mark.slow), ("nvfp4", 1),
                                            pytest.param("nvfp4", 2, marks=pytest.mark.slow)])
def test_step_and_evaluation_lowered_for_cuda(compute, tensor, monkeypatch):
    if jax.default_backend() == "gpu":
        pytest.skip("lowers for CUDA from a host without a GPU")
    monkeypatch.delenv(gemm.CUDA_CAPABILITY_ENV, raising=False)  # the CUDA target: a Blackwell
    from train import programs
    from train import accounting as accounting_lib

    cfg = job(f"nvfp4.compute={compute}", f"mesh.tensor={tensor}")
    trainer, _, _ = programs.build(cfg, mesh_of(cfg, 2 * tensor), init=False)
    args = accounting_lib.abstract_step_args(trainer)
    layers = nvfp4_layers(trainer)
    assert len(layers) == 7  # q, k, v, out, gate, up, down (the embeddings and head stay bf16)
    step = lower_for_cuda(trainer.step_fn, *args)
    evaluate = lower_for_cuda(trainer.eval_fn, args[0], args[2])

    for text, per_layer in ((step, 3), (evaluate, 1)):  # fprop, dgrad, wgrad; fprop
        gemms = comm.native_gemms(text)
        if compute == "dequant":
            assert gemms == []
            continue
        assert {(g.backend, g.operands) for g in gemms} == {("scaled_matmul", comm.BLOCK_SCALED_OPERANDS)}
        # The scan over layers counts once here (its trip count is set at compile time).
        assert sum(g.times for g in gemms) >= per_layer * len(layers), gemms
    if compute == "nvfp4":
        assert gemm.last_backend("cuda") == "scaled_matmul" and gemm.last_backend() == "emulate"

    assert_packed_gathers(step, layers, trainer.mesh)
    assert_packed_gathers(evaluate, layers, trainer.mesh)
