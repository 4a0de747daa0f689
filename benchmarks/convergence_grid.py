"""The real-text convergence grid's definitions, shared by ``python -m benchmarks convergence
--text`` (:mod:`benchmarks.convergence_text`, which trains and reports them), its ``--recipe``
report (:mod:`benchmarks.convergence_recipe`) and ``python -m benchmarks serving``: the model
sizes and training lengths, the variants (config overrides) and which pairs are compared,
the targets, the run names and each run's config.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.common import ROOT

EVAL_BATCHES = 32
SEEDS = (0, 1, 2)
# The headline cell (the default model's longest runs: NVFP4, bf16 and the 2d-tile lever) runs
# seeds 0..7: one seed moves the gap by about 1% of the loss, so three cannot resolve the 0.5%
# target, nor the block lever.
HEADLINE_SEEDS = 8
HEADLINE_VARIANTS = ("nvfp4", "bf16", "block_2d")

# Model sizes (train/configs plus overrides). small.yaml (4 layers, d_model 128, 32 x 128
# tokens per step) costs ~1.6 s a step on one shared CPU core, 20x the tiny model, so the
# larger sizes here widen the default model and keep its depth, sequence length and batch:
# "wide" at small.yaml's width (d_model 128, 4 heads, MLP 352), "wider" at d_model 256 (8
# heads of 32, MLP 704 = 16 x 44): how the gap moves with width at one training length.
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": {"config": "tiny.yaml", "overrides": []},
    "default": {"config": "default.yaml", "overrides": []},
    "wide": {"config": "default.yaml",
             "overrides": ["model.d_model=128", "model.heads=4", "model.mlp_hidden=352"]},
    "wider": {"config": "default.yaml",
              "overrides": ["model.d_model=256", "model.heads=8", "model.mlp_hidden=704"]},
}
# The full recipe's width sweep (``--recipe``): the default model at 4 layers (so a bf16 last
# block is a quarter of the blocks' linear layers, the nearest 4 layers come to the published
# ~16%), widened as above with 32-wide heads; 2000 steps.
RECIPE_SIZES: Dict[str, Dict[str, Any]] = {
    f"l4-d{d}": {"config": "default.yaml",
                 "overrides": [f"model.d_model={d}", f"model.heads={d // 32}", f"model.mlp_hidden={h}", "model.layers=4"]}
    for d, h in ((64, 192), (128, 352), (256, 704), (512, 1408))
}
SIZES.update(RECIPE_SIZES)
RECIPE_STEPS = 2000
# Training lengths per size, shortest first; the longest of the smallest model >= 2000 steps.
LENGTHS: Dict[str, List[int]] = {"tiny": [500, 2000], "default": [500, 2000], "wide": [150, 600, 2000],
                                 "wider": [2000]}
LENGTHS.update({size: [RECIPE_STEPS] for size in RECIPE_SIZES})
WEIGHTS_SIZES = ("tiny", "default", "wide", "wider")
LEVER_SIZE = "default"

VARIANTS: Dict[str, List[str]] = {
    "bf16": ["nvfp4.weights=bf16"],
    "nvfp4": ["nvfp4.weights=nvfp4"],
    "block_2d": ["nvfp4.weights=nvfp4", "nvfp4.block=2d"],
    "stochastic_rounding": ["nvfp4.weights=nvfp4", "nvfp4.stochastic_rounding=true"],
    "keep_last_blocks_1": ["nvfp4.weights=nvfp4", "nvfp4.keep_last_blocks=1"],
    "cast_master_bf16": ["nvfp4.weights=nvfp4", "nvfp4.cast_master_bf16=true"],
    "four_over_six": ["nvfp4.weights=nvfp4", "nvfp4.four_over_six=true"],
    "compute_nvfp4": ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4"],
    # The published recipe keeps the last layers' GEMMs in high precision.
    "compute_nvfp4_keep_last_blocks_1": ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4", "nvfp4.keep_last_blocks=1"],
    "plain_bf16": [],  # no wrapper: plain optax on float32 params, bf16 forward
    # keep_last_blocks splits the scanned blocks into two segments, whose params are drawn
    # from other init keys: its bf16 baseline has the same split (the same init).
    "bf16_keep_last_blocks_1": ["nvfp4.weights=bf16", "nvfp4.keep_last_blocks=1"],
}
# The recipe sweep: the full recipe against bf16, with and without the bf16 last block (each
# against bf16 with the same split), in the order a seed's runs are trained.
RECIPE_VARIANTS = ("bf16_keep_last_blocks_1", "compute_nvfp4_keep_last_blocks_1", "bf16", "compute_nvfp4")
RECIPE_PAIRS = {"compute_nvfp4": "bf16", "compute_nvfp4_keep_last_blocks_1": "bf16_keep_last_blocks_1"}
# The ablation (at the sweep's widest width unless --ablation-at says otherwise): the full recipe with its last block in bf16, one
# element switched off at a time.
_RECIPE_KL = ["nvfp4.weights=nvfp4", "nvfp4.compute=nvfp4", "nvfp4.keep_last_blocks=1"]
ABLATIONS: Dict[str, List[str]] = {
    "recipe_1d_weights": [*_RECIPE_KL, "nvfp4.block=1d"],
    "recipe_nearest_grads": [*_RECIPE_KL, "nvfp4.grad_rounding=nearest"],
    "recipe_no_hadamard": [*_RECIPE_KL, "nvfp4.wgrad_hadamard=false"],
    "recipe_bf16_activations": [*_RECIPE_KL, "nvfp4.activations=bf16"],
}
VARIANTS.update(ABLATIONS)
# The learning-rate check: the last-block-bf16 pair again at half the default model's
# learning rate (optim.lr 3e-3 -> 1.5e-3), at every width: whether a gap is measured against a
# bf16 baseline the learning rate holds back (a wider model wants a smaller one).
LR_HALF = 1.5e-3
LR_CHECK: Dict[str, List[str]] = {
    f"{v}_lr_half": [*VARIANTS[v], f"optim.lr={LR_HALF}"]
    for v in ("bf16_keep_last_blocks_1", "compute_nvfp4_keep_last_blocks_1")}
VARIANTS.update(LR_CHECK)
ABLATION_NAMES = {
    "recipe_1d_weights": "2D weights -> 1D (`nvfp4.block=1d`)",
    "recipe_nearest_grads": "no stochastic rounding (`nvfp4.grad_rounding=nearest`)",
    "recipe_no_hadamard": "no Hadamard transform (`nvfp4.wgrad_hadamard=false`)",
    "recipe_bf16_activations": "activations in bf16 (`nvfp4.activations=bf16`)",
}
# The bf16 run a lever is compared with: the same model, init and batches.
LEVER_BASE = {"keep_last_blocks_1": "bf16_keep_last_blocks_1",
              "compute_nvfp4_keep_last_blocks_1": "bf16_keep_last_blocks_1"}
LEVERS = ("block_2d", "stochastic_rounding", "keep_last_blocks_1", "cast_master_bf16", "compute_nvfp4",
          "compute_nvfp4_keep_last_blocks_1")
# The levers that quantize activations and gradients too (judged by RECIPE_TARGET).
RECIPE_LEVERS = ("compute_nvfp4", "compute_nvfp4_keep_last_blocks_1")
LEVER_NAMES = {
    "nvfp4": "1d blocks, round to nearest (default weights-only)",
    "block_2d": "`nvfp4.block=2d` (16x16 tiles)",
    "stochastic_rounding": "`nvfp4.stochastic_rounding=true`",
    "keep_last_blocks_1": "`nvfp4.keep_last_blocks=1`",
    "cast_master_bf16": "`nvfp4.cast_master_bf16=true`",
    "four_over_six": "`nvfp4.four_over_six=true` (each block's scale to 6 or 4, the smaller error)",
    "compute_nvfp4": "`nvfp4.compute=nvfp4` (full recipe)",
    "compute_nvfp4_keep_last_blocks_1": "`nvfp4.compute=nvfp4 nvfp4.keep_last_blocks=1` (full recipe, last block bf16)",
}
WEIGHTS_ONLY_TARGET = 0.5  # % of the bf16 validation loss
RECIPE_TARGET = 1.5
# The recipe sweep at more seeds (``--seeds-at SIZE=FIRST-LAST``): its two pairs at one width for
# seeds FIRST..LAST, so that the 95% t-interval of the mean gap says whether the gap is below
# SEEDS_AT_BOUND (% of the bf16 validation loss): the upper end of the interval below it.
SEEDS_AT_BOUND = 1.0


def run_name(size: str, steps: int, seed: int, variant: str) -> str:
    """A run's name: its key in a results dict and the name of its result file."""
    return f"{size}-{steps}-s{seed}-{variant}"


def headline_seeds(seeds: Sequence[int], n: int = HEADLINE_SEEDS) -> List[int]:
    """The seeds of the headline cell: ``seeds`` and 0..n-1."""
    return sorted(set(seeds) | set(range(n)))


def grid(sizes: Sequence[str] = WEIGHTS_SIZES, seeds: Sequence[int] = SEEDS,
         lengths: Optional[Dict[str, List[int]]] = None, levers: bool = True, plain: bool = True,
         headline: Sequence[int] = ()) -> List[Dict[str, Any]]:
    """The runs, most important first: the default model's longest pairs, the plain baseline,
    the levers (seed by seed), the headline cell's further seeds (``headline``), then the other
    sizes and lengths (short runs first)."""
    lengths = lengths or LENGTHS
    specs: List[Dict[str, Any]] = []
    add = lambda size, steps, seed, v: specs.append(
        {"size": size, "steps": steps, "seed": seed, "variant": v, "name": run_name(size, steps, seed, v)})
    lever_size = LEVER_SIZE if LEVER_SIZE in sizes else sizes[0]
    top = max(lengths[lever_size])
    for seed in seeds:
        add(lever_size, top, seed, "nvfp4")
        add(lever_size, top, seed, "bf16")
    if plain:
        add(lever_size, top, seeds[0], "plain_bf16")
    if levers:
        for seed in seeds:
            add(lever_size, top, seed, LEVER_BASE["keep_last_blocks_1"])  # seed-major: a grid stopped early still has every lever on some seeds
        for seed in seeds:
            for lever in LEVERS:
                add(lever_size, top, seed, lever)
    for seed in headline:
        if seed not in seeds:
            for v in HEADLINE_VARIANTS:
                if levers or v != "block_2d":
                    add(lever_size, top, seed, v)
    for rank in range(max(len(v) for v in lengths.values())):
        for size in sizes:
            if rank < len(lengths[size]):
                steps = sorted(lengths[size])[rank]
                for seed in seeds:
                    for v in ("nvfp4", "bf16"):
                        if (size, steps) != (lever_size, top):
                            add(size, steps, seed, v)
    return specs


def by_width(sizes: Sequence[str]) -> List[str]:
    """Recipe sizes, narrowest first."""
    return sorted(sizes, key=lambda s: list(RECIPE_SIZES).index(s))


# The recipe grid's runs keep the settings its recorded runs trained with where a default has
# changed since: per-matrix global amax (nvfp4.fused_amax, default on since the grid was
# recorded), so that runs added later pair and pool with the recorded ones.
RECIPE_PINNED = ("nvfp4.fused_amax=false",)


def _recipe_spec(size: str, seed: int, variant: str) -> Dict[str, Any]:
    return {"size": size, "steps": RECIPE_STEPS, "seed": seed, "variant": variant,
            "name": run_name(size, RECIPE_STEPS, seed, variant), "extra": list(RECIPE_PINNED)}


def seeds_at_grid(seeds_at: Dict[str, Sequence[int]]) -> List[Dict[str, Any]]:
    """The runs of the sweep at more seeds: per size of ``seeds_at`` (narrowest first) and each
    of its seeds, :data:`RECIPE_VARIANTS` (the sweep's two pairs)."""
    return [_recipe_spec(size, seed, v) for size in by_width(seeds_at) for seed in seeds_at[size]
            for v in RECIPE_VARIANTS]


def recipe_grid(sizes: Sequence[str], seeds: Sequence[int] = SEEDS,
                ablation_sizes: Optional[Sequence[str]] = None, lr_seeds: Sequence[int] = (),
                seeds_at: Optional[Dict[str, Sequence[int]]] = None) -> List[Dict[str, Any]]:
    """The recipe sweep's runs: per size (narrowest first) and seed, :data:`RECIPE_VARIANTS`;
    per size, :data:`LR_CHECK` for each of ``lr_seeds``; then, at each of
    ``ablation_sizes`` (default: the widest size; ``()``: none), narrowest first, the
    :data:`ABLATIONS` seed by seed; last, the runs of :func:`seeds_at_grid` (``seeds_at``) that
    the sweep does not have already."""
    order = by_width(sizes)
    at = by_width(order[-1:] if ablation_sizes is None else ablation_sizes)
    specs = [_recipe_spec(size, seed, v) for size in order for seed in seeds for v in RECIPE_VARIANTS]
    specs += [_recipe_spec(size, seed, v) for size in order for seed in lr_seeds for v in LR_CHECK]
    specs += [_recipe_spec(size, seed, v) for size in at for seed in seeds for v in ABLATIONS]
    have = {s["name"] for s in specs}
    specs += [s for s in seeds_at_grid(seeds_at or {}) if s["name"] not in have]
    return specs


def run_config(size: str, steps: int, seed: int, variant: str, corpus: Dict[str, Any], extra: Sequence[str] = ()):
    """A run's config and its overrides: ``size``'s model on one device, ``variant``'s levers,
    the corpus of ``corpus`` (``convergence_text.build_corpus``), seed ``seed`` for the init and
    the data, ``steps`` steps evaluated every tenth of them; ``extra`` overrides last."""
    from train.config import load_config

    spec = SIZES[size]
    overrides = [*spec["overrides"], "mesh.data=1", "mesh.tensor=1", "mesh.simulate_devices=1",
                 *(VARIANTS[variant] or ["nvfp4.weights=bf16"]),
                 "data.source=file", f"data.path={corpus['train']['path']}",
                 f"data.val_path={corpus['val']['path']}", f"data.seed={seed}", f"train.seed={seed}",
                 f"train.steps={steps}", f"train.eval_every={max(1, steps // 10)}",
                 f"train.eval_batches={EVAL_BATCHES}", "train.log_every=50", *extra]
    return load_config(os.path.join(ROOT, "train", "configs", spec["config"]), overrides), overrides


# The length sweep (``--length-sweep``): one width, training budgets in tokens per non-embedding
# parameter (every parameter but the embedding and the head), the default cosine schedule (decay
# to 10% of the peak) over each run's whole length. Weights-only NVFP4 against bf16; the full
# recipe with its last block bf16 against bf16 with the same split (the split draws other init
# keys), in the order a seed's runs are trained.
LENGTH_SIZE = "l4-d64"
LENGTH_BUDGETS = (2, 10, 40)
LENGTH_VARIANTS = ("bf16", "nvfp4", "bf16_keep_last_blocks_1", "compute_nvfp4_keep_last_blocks_1")
LENGTH_PAIRS = {"nvfp4": "bf16", "compute_nvfp4_keep_last_blocks_1": "bf16_keep_last_blocks_1"}
# ``--levers``: at one budget (the longest unless ``--levers-at`` names another), weights-only NVFP4 with one lever each, against the bf16 run
# of the same model and init (the default weights-only run is the reference they are judged by).
LENGTH_LEVERS = {"keep_last_blocks_1": "bf16_keep_last_blocks_1", "block_2d": "bf16", "stochastic_rounding": "bf16",
                 "four_over_six": "bf16"}
# The runs the levers are judged against, at their budget: their bf16 bases and the default weights-only run.
LEVER_BASES = ("bf16", "nvfp4", "bf16_keep_last_blocks_1")
# The storage formats besides the default in which a diagnosed bf16 run's final weights are also
# quantized once (what 4-bit storage alone costs in each), as ``nvfp4`` settings: the levers that
# change how the weights are stored.
STORAGE_FORMATS = {"four_over_six": {"four_over_six": True}, "block_2d": {"block": "2d"}}
EMBEDDING_PARAMS = ("embed", "head")


def non_embedding_params(cfg) -> int:
    """The parameters of ``cfg``'s model less the embedding and the head (no init is run)."""
    import math

    import jax
    import jax.numpy as jnp

    from train.model import from_config

    model = from_config(cfg.model, cfg.nvfp4)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.model.seq_len), jnp.int32)))
    return sum(math.prod(x.shape) for k, sub in shapes["params"].items() if k not in EMBEDDING_PARAMS
               for x in jax.tree.leaves(sub))


def non_embedding_of(model: Dict[str, Any]) -> int:
    """:func:`non_embedding_params` of a report's model summary (``{"d_model": 64, "layers": 2, ...}``: model keys,
    and ``batch_size``)."""
    from train.config import load_config

    return non_embedding_params(load_config(None, [f"model.{k}={v}" for k, v in model.items() if k != "batch_size"]))


def budget_steps(budget: float, non_embedding: int, tokens_per_step: int) -> int:
    """Steps that train ``budget`` tokens per non-embedding parameter (rounded to the nearest)."""
    return max(1, int(round(budget * non_embedding / tokens_per_step)))


def size_shape(size: str) -> Dict[str, int]:
    """``size``'s non-embedding parameter count and tokens per step (its own config)."""
    dummy = {"train": {"path": "train.txt"}, "val": {"path": "val.txt"}}
    cfg, _ = run_config(size, 10, 0, "bf16", dummy)
    return {"non_embedding": non_embedding_params(cfg), "tokens_per_step": cfg.data.batch_size * cfg.model.seq_len}


def length_grid(shapes: Dict[str, Dict[str, int]], budgets: Sequence[float] = LENGTH_BUDGETS,
                seeds: Sequence[int] = SEEDS, levers: bool = False, levers_at: Optional[float] = None,
                lever_seeds: Sequence[int] = ()) -> List[Dict[str, Any]]:
    """The length sweep's runs: per budget (in the order given), size and seed,
    :data:`LENGTH_VARIANTS`; then with ``levers`` the :data:`LENGTH_LEVERS` runs at ``levers_at``
    (one of ``budgets``; default the longest), seed by seed; last, for each of ``lever_seeds`` not in
    ``seeds``, the levers with :data:`LEVER_BASES` at that budget. ``shapes`` maps each size to
    :func:`size_shape`'s dict."""
    def cell(budget, variants, seeds=seeds):
        for size, sh in shapes.items():
            steps = budget_steps(budget, sh["non_embedding"], sh["tokens_per_step"])
            for seed in seeds:
                for v in variants:
                    yield {"size": size, "steps": steps, "seed": seed, "variant": v, "budget": budget,
                           "name": run_name(size, steps, seed, v), "diagnose": True}

    specs = [s for budget in budgets for s in cell(budget, LENGTH_VARIANTS)]
    at = max(budgets) if levers_at is None else levers_at
    if levers:
        specs += cell(at, LENGTH_LEVERS)
    for seed in (s for s in lever_seeds if s not in seeds):
        specs += cell(at, (*LEVER_BASES, *LENGTH_LEVERS), seeds=[seed])
    return specs
