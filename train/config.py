"""Experiment configuration: frozen pydantic dataclasses, the one source of every key (docs/TRAINING.md).

Each key is declared once with :func:`setting`; ``configs/default.yaml`` and ``default.gin``, ``--help``, the keys a
resume compares and the program key derive from :func:`config_keys`. Dataclasses rather than ``BaseModel``: frozen and
hashable (a config is part of the programs' cache key), and ``dataclasses.replace`` validates. YAML and gin files and
``section.key=value`` overrides merge as plain dicts before validation, so an override may fix a file invalid on its
own. Every failure is a one-line :class:`ConfigError` naming the key. No jax here: the CLI checks a config before JAX.
"""

import dataclasses
import functools
import itertools
import os
import pathlib
import re
import sys
import textwrap
import typing
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Sequence, Tuple

import pydantic
import yaml
from pydantic import Field, Strict
from pydantic_core import to_jsonable_python

from train.config_errors import ConfigError, one_line, short, suggest

__all__ = ["AFFECTS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "Key", "MeshConfig", "ModelConfig",
           "NVFP4Config", "OptimConfig", "ROPE_SCALING_KEYS", "RopeScaling", "SECTIONS", "TrainConfig",
           "apply_overrides", "config_keys", "default_gin", "default_yaml", "from_dict", "load_config", "load_section",
           "mesh_error", "resolve_mesh_axes", "save_config", "setting", "to_dict", "to_yaml",
           "trajectory_keys", "validate_for_devices"]

# Strict types (`layers: true` is not 1, `1` is not true); an int widens to a float (past float's range: not finite).
Int, Str, Bool = Annotated[int, Strict()], Annotated[str, Strict()], Annotated[bool, Strict()]
Float = Annotated[float, Strict(), pydantic.AllowInfNan(False)]
# Counts and sizes: past 2^31 - 1 no array dimension or step count is meaningful (JAX's are C longs).
Pos, NonNeg = Annotated[Int, Field(gt=0, lt=2**31)], Annotated[Int, Field(ge=0, lt=2**31)]
PosFloat, NonNegFloat = Annotated[Float, Field(gt=0)], Annotated[Float, Field(ge=0)]
Fraction = Annotated[Float, Field(ge=0, lt=1)]

# What a change of a key affects, on a resume and in the programs a process compiles.
AFFECTS = {
    "trajectory": "changes the training trajectory: a resume refuses a change unless checkpoint.allow_change "
                  "names the key",
    "program": "changes only the compiled programs (a resume reshards or recompiles and continues)",
    "host": "neither: what the host does around the steps (logging, output, evaluation cadence, checkpoints)",
}


def setting(affects: str, description: str, *, program_key: Optional[bool] = None) -> Any:
    """A key's declaration, ``Annotated`` metadata next to its type. ``affects``: one of :data:`AFFECTS` (a new
    trajectory key needs the value older checkpoints had in ``train.checkpoint._BEFORE_RECORDED``). ``program_key``:
    whether the compiled programs depend on it; default: every non-host key; ``False`` for a trajectory key only the
    host reads (the data stream, the starting weights) or a program key acting on the process (XLA flags)."""
    if affects not in AFFECTS:
        raise ValueError(f"affects={affects!r}: must be one of {', '.join(AFFECTS)}")
    keyed = affects != "host" if program_key is None else bool(program_key)
    if affects == "host" and keyed:
        raise ValueError("a host key changes no program: it cannot be part of the program key")
    extra = {"affects": affects, "program_key": keyed}
    return Field(description=" ".join(description.split()), json_schema_extra=extra)


def _section(cls):
    """``cls`` as a frozen pydantic dataclass refusing unknown keys, each declared with :func:`setting`, whose
    construction (``cls(...)``, ``dataclasses.replace``) raises a one-line :class:`ConfigError`."""
    cls = pydantic.dataclasses.dataclass(frozen=True, config=pydantic.ConfigDict(extra="forbid"))(cls)
    for name, info in cls.__pydantic_fields__.items():
        extra = info.json_schema_extra
        if cls.section and (not info.description or not isinstance(extra, dict) or extra.get("affects") not in AFFECTS):
            raise TypeError(f"{cls.section}.{name}: declare it with Annotated[type, setting(affects, description)] "
                            "(train.config.setting)")
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except pydantic.ValidationError as e:  # a section's (or model.rope_scaling's) keys are named section.key
            raise one_line(e, {cls.section: cls} if cls.section else SECTIONS, cls.section) from None
    cls.__init__ = __init__
    return cls


@_section
class RopeScaling:
    """Llama 3.x rotary scaling (transformers' ``rope_type: llama3``); Llama 3.1's: factor 8, low 1, high 4, 8192."""

    section: ClassVar[str] = "model.rope_scaling"
    rope_type: Annotated[Literal["llama3"], setting("trajectory", "The scaling's kind; only llama3.")] = "llama3"
    factor: Annotated[Float, Field(ge=1), setting(
        "trajectory", "Divides the frequency of the long wavelengths: see low_freq_factor.")] = 8.0
    low_freq_factor: Annotated[PosFloat, setting(
        "trajectory", "Wavelengths over original_max_position_embeddings / low_freq_factor: divided by factor.")] = 1.0
    high_freq_factor: Annotated[PosFloat, setting(
        "trajectory", "Wavelengths shorter than original_max_position_embeddings / high_freq_factor keep their "
        "frequency, those between interpolate smoothly; > low_freq_factor.")] = 4.0
    original_max_position_embeddings: Annotated[Pos, setting("trajectory", "The pretraining context length.")] = 8192

    def __post_init__(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor}: must be > "
                              f"model.rope_scaling.low_freq_factor={self.low_freq_factor}")


# The numeric keys of a llama3 rotary scaling, as transformers' config.json names them (train.model writes them,
# train.hf_import reads them).
ROPE_SCALING_KEYS = tuple(f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type")


def _rope_scaling(value):
    """``model.rope_scaling``: null, or a mapping of :class:`RopeScaling`'s keys (with its own errors)."""
    if value is None or isinstance(value, RopeScaling):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.rope_scaling: expected a mapping (rope_type: llama3, factor, low_freq_factor, "
                          f"high_freq_factor, original_max_position_embeddings) or null, got {short(value)}")
    return _validated(value, RopeScaling)


@_section
class ModelConfig:
    """A decoder-only Llama transformer (pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP)."""

    section: ClassVar[str] = "model"
    vocab: Annotated[Pos, setting(
        "trajectory", "Vocabulary size: token ids 0..vocab-1 (bytes: 256; Markov: 0..data.markov_states-1).")] = 256
    d_model: Annotated[Pos, setting("trajectory", "Hidden size (residual width); divisible by model.heads.")] = 64
    layers: Annotated[Pos, setting("trajectory", "Transformer blocks.")] = 2
    heads: Annotated[Pos, setting(
        "trajectory", "Query heads; head size d_model / heads is even (rotary embeddings rotate channel pairs).")] = 2
    kv_heads: Annotated[NonNeg, setting(
        "trajectory", "Key/value heads (grouped-query attention), dividing model.heads; 0 = model.heads (MHA).")] = 0
    mlp_hidden: Annotated[Pos, setting(
        "trajectory", "SwiGLU width; with a tensor axis T, divisible by 16 x T (whole NVFP4 blocks per shard).")] = 192
    seq_len: Annotated[Pos, setting("trajectory", "Tokens per training sequence (the context length).")] = 64
    rope_theta: Annotated[PosFloat, setting("trajectory", "Base of the rotary position frequencies.")] = 10000.0
    rope_scaling: Annotated[Optional[RopeScaling], pydantic.BeforeValidator(_rope_scaling), setting(
        "trajectory", "null: plain rotary positions; a mapping: Llama 3.x scaling (HF rope_type llama3).")] = None
    norm_eps: Annotated[PosFloat, setting("trajectory", "Epsilon of the RMSNorms.")] = 1e-5
    tie_embeddings: Annotated[Bool, setting("trajectory", "true: head = embedding^T (no head/kernel).")] = False
    attention: Annotated[Literal["auto", "blockwise", "xla", "cudnn"], setting(
        "program", "The attention kernel: auto (cuDNN's fused attention on a CUDA GPU, else blockwise) | blockwise "
        "(O(sequence) memory) | xla (O(sequence^2) scores) | cudnn; each the same attention up to rounding.")] = "auto"
    init_std: Annotated[PosFloat, setting(
        "trajectory", "Standard deviation of the random normal init of the embedding and the kernels.")] = 0.02

    def __post_init__(self):  # cross-field rules, run by pydantic after the fields validate
        if self.d_model % self.heads:
            raise ConfigError(f"model.d_model={self.d_model}: must be divisible by model.heads={self.heads}")
        if self.heads % self.n_kv_heads:
            raise ConfigError(f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model.heads={self.heads}: head size model.d_model/model.heads={self.head_dim} "
                              "must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads


@_section
class DataConfig:
    """Where tokens come from; ``batch_size`` is global."""

    section: ClassVar[str] = "data"
    source: Annotated[Literal["markov", "file", "tokens"], setting(
        "trajectory", "Where tokens come from: markov (the embedded Markov corpus) | file (any file, its bytes are the "
        "tokens) | tokens (a token file written by python -m train.prepare).", program_key=False)] = "markov"
    path: Annotated[Optional[Str], setting(
        "trajectory", "The file to train on: with data.source file any file, its bytes are the tokens; with tokens "
        "python -m train.prepare's output. Its content is recorded in checkpoints too.", program_key=False)] = None
    val_path: Annotated[Optional[Str], setting(
        "trajectory", "A held-out file of the same kind (tokens: the same tokenizer), for the validation "
        "loss.", program_key=False)] = None
    val_fraction: Annotated[Fraction, setting(
        "trajectory", "Or hold out the last fraction of data.path (not trained on). data.source markov takes neither: "
        "it draws validation rows from its own stream.", program_key=False)] = 0.0
    batch_size: Annotated[Pos, setting(
        "trajectory", "Global sequences per step (all processes); divisible by the data axis x optim.grad_accum.")] = 16
    markov_states: Annotated[Int, Field(ge=2, le=4096), setting(
        "trajectory", "Markov chain alphabet size: tokens 0..states-1; at most model.vocab, and 4096 (its transition "
        "matrix is dense, its stationary distribution a linear solve: 7 s at 4096).", program_key=False)] = 32
    seed: Annotated[Int, Field(ge=0, lt=2**31), setting(
        "trajectory", "Seed of the data stream (the Markov chain, the token files' shuffle); < 2^31, as the shuffle "
        "takes a 31-bit seed.", program_key=False)] = 0

    def __post_init__(self):
        reads_file = self.source in ("file", "tokens")
        if reads_file and not self.path:
            raise ConfigError(f"data.path: required when data.source={self.source!r}")
        if not reads_file and self.path:
            raise ConfigError(f"data.path={self.path!r}: data.source={self.source!r} does not read a file; "
                              "set data.source=file or tokens to train on it (or data.path=null)")
        if self.val_path and self.val_fraction:
            raise ConfigError("data.val_fraction: set either data.val_path or data.val_fraction, not both")
        if self.val_path and self.path and _same_file(self.val_path, self.path):
            raise ConfigError(f"data.val_path={self.val_path!r}: is data.path, so validation would run on the "
                              "training data; give a held-out file or use data.val_fraction")
        if self.source == "markov" and (self.val_path or self.val_fraction):
            key = "data.val_path" if self.val_path else "data.val_fraction"
            raise ConfigError(f"{key}={self.val_path or self.val_fraction!r}: data.source='markov' draws validation "
                              "rows from its own stream and would ignore it; set data.source=file or tokens")

    @property
    def held_out(self) -> bool:
        """Whether there are held-out rows: data.val_path or data.val_fraction, or the Markov stream's own."""
        return self.source == "markov" or bool(self.val_path or self.val_fraction)


def _same_file(a: str, b: str) -> bool:
    """``a`` and ``b`` name one file (through a link too)."""
    same_path = os.path.realpath(a) == os.path.realpath(b)
    return same_path or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


# Simulated CPU devices that still run a step (256 run a tiny one in ~50 s on 2 cores; 1024 abort in XLA:CPU's
# collective rendezvous).
MAX_SIMULATED_DEVICES = 256


@_section
class MeshConfig:
    """Device mesh ``(data, tensor)``; -1 on one axis means "all remaining devices"."""

    section: ClassVar[str] = "mesh"
    data: Annotated[Int, Field(ge=-1), setting("program", "Devices on the data (FSDP) axis; -1: the rest.")] = -1
    tensor: Annotated[Int, Field(ge=-1), setting(
        "program", "Devices on the tensor axis (tensor and sequence parallelism in each layer); -1: the rest.")] = 1
    layout: Annotated[Literal["auto", "gb200"], setting(
        "program", "auto (one data axis) | gb200 (rack x data x tensor; tensor groups in one NVLink domain).")] = "auto"
    nvl_domain: Annotated[Pos, setting("program", "GPUs per NVLink domain (mesh.layout gb200): one GB200 NVL72.")] = 72
    racks: Annotated[NonNeg, setting(
        "program", "mesh.layout gb200: the expected number of racks (NVLink domains); 0 = what the devices span.")] = 0
    sharding: Annotated[Literal["fsdp", "hsdp"], setting(
        "program", "mesh.layout gb200: fsdp shards the state over racks and the data axis; hsdp shards it inside a "
        "rack and replicates it across racks (weight gathers never leave a rack; R x the state).")] = "fsdp"
    simulate_devices: Annotated[NonNeg, setting(
        "program", f"Simulated CPU devices, on CPU only and when XLA_FLAGS does not set a host device count; 0 = none; "
        f"at most {MAX_SIMULATED_DEVICES}.")] = 8

    def __post_init__(self):
        if self.simulate_devices > MAX_SIMULATED_DEVICES:
            raise ConfigError(f"mesh.simulate_devices={self.simulate_devices}: at most {MAX_SIMULATED_DEVICES} "
                              "simulated CPU devices can run a step (XLA:CPU's collectives time out past that); "
                              "to see larger meshes compiled without running, use python -m benchmarks scale")
        for name in ("data", "tensor"):
            if getattr(self, name) == 0:
                raise ConfigError(f"mesh.{name}=0: must be a positive size or -1 (the rest)")
        for name, default in (("racks", 0), ("sharding", "fsdp")):
            if self.layout != "gb200" and getattr(self, name) != default:
                raise ConfigError(f"mesh.{name}={getattr(self, name)!r}: only mesh.layout=gb200 has racks; "
                                  f"set mesh.layout=gb200 (or leave mesh.{name} at {default!r})")
        if self.data == -1 and self.tensor == -1:
            raise ConfigError("mesh.data=-1 and mesh.tensor=-1: at most one axis may be -1")


@_section
class OptimConfig:
    """The inner optax optimizer applied to the float32 master weights."""

    section: ClassVar[str] = "optim"
    name: Annotated[Literal["adamw", "adam", "sgd", "lion"], setting(
        "trajectory", "The optax optimizer: adamw | adam | sgd (momentum optim.b1) | lion.")] = "adamw"
    lr: Annotated[PosFloat, setting("trajectory", "Peak learning rate.")] = 3e-3
    schedule: Annotated[Literal["cosine", "constant", "linear"], setting(
        "trajectory", "LR after warmup: cosine (to 0.1 x optim.lr) | constant | linear (to 0).")] = "cosine"
    warmup_steps: Annotated[NonNeg, setting(
        "trajectory", "Steps of linear warmup from 0 to optim.lr. One longer than the schedule is an error; the "
        "default is cut to a shorter schedule.")] = 20
    weight_decay: Annotated[NonNegFloat, setting("trajectory", "Decoupled weight decay (adamw, lion).")] = 0.01
    b1: Annotated[Fraction, setting("trajectory", "First-moment decay (adam, adamw, lion); sgd's momentum.")] = 0.9
    b2: Annotated[Fraction, setting("trajectory", "Second-moment decay (adam, adamw, lion).")] = 0.95
    clip_norm: Annotated[NonNegFloat, setting(
        "trajectory", "Global-norm gradient clipping (the norm summed in a fixed order); 0 = off.")] = 1.0
    grad_accum: Annotated[Int, Field(ge=1), setting(
        "trajectory", "Micro-batches per optimizer step: data.batch_size is split in N, their gradients summed.")] = 1
    schedule_steps: Annotated[NonNeg, setting(
        "trajectory", "Learning-rate schedule length; 0 = train.steps. Stored in checkpoints: to extend a finished "
        "run, raise train.steps and set this to the checkpoint's length.")] = 0


@_section
class NVFP4Config:
    """Which weights live in NVFP4 and how they move and compute."""

    section: ClassVar[str] = "nvfp4"
    weights: Annotated[Literal["nvfp4", "bf16"], setting(
        "trajectory", "nvfp4 (the stored weights are NVFP4) | bf16 (the baseline).")] = "nvfp4"
    param_gather: Annotated[Literal["packed", "dequantized"], setting(
        "program", "What crosses the data axis each forward: packed (the NVFP4 bytes, dequantized after the gather) | "
        "dequantized (bf16, the reference: the same bits).")] = "packed"
    compute: Annotated[Literal["dequant", "nvfp4"], setting(
        "trajectory", "dequant (bf16 GEMMs) | nvfp4 (the recipe: block-scaled GEMMs, native where "
        "supported).")] = "dequant"
    keep_bf16: Annotated[Tuple[Str, ...], setting(
        "trajectory", "Regexes searched in parameter paths; matches stay bf16. Kept layers (these, the first/last "
        "blocks) run bf16 GEMMs under compute nvfp4, like the recipe's last layers.")] = ("embed", "head", "norm")
    keep_first_blocks: Annotated[NonNeg, setting(
        "trajectory", "The first N transformer blocks stay bf16 (kept layers, as nvfp4.keep_bf16's).")] = 0
    keep_last_blocks: Annotated[NonNeg, setting(
        "trajectory", "The last N transformer blocks stay bf16 (kept layers, as nvfp4.keep_bf16's).")] = 0
    stochastic_rounding: Annotated[Bool, setting(
        "trajectory", "Re-quantize the stored weights from the float32 masters with stochastic rounding after each "
        "update (its key carried in the optimizer state).")] = False
    cast_master_bf16: Annotated[Bool, setting("trajectory", "Cast the fp32 master to bf16 before quantizing.")] = False
    four_over_six: Annotated[Bool, setting(
        "trajectory", "Each block of the stored weights takes the scale mapping its amax to 6 or to 4, whichever "
        "has the smaller squared error (still plain NVFP4; off: Transformer Engine's bits).")] = False
    nonfinite: Annotated[Literal["skip", "error"], setting(
        "host", "What the host does after a step with non-finite gradients (the device skips its update either way): "
        "skip (go on) | error (stop, exit 3).")] = "skip"
    max_skipped_in_a_row: Annotated[NonNeg, setting(
        "host", "With nvfp4.nonfinite skip: stop (exit 3) after N skipped steps in a row (diverged); 0 = never.")] = 10
    grad_reduce_dtype: Annotated[Literal["grad", "float32"], setting(
        "trajectory", "Dtype of the weight-gradient sum over the data axis: grad (theirs, bf16) | float32.")] = "grad"
    block: Annotated[Literal["auto", "1d", "2d"], setting(
        "trajectory", "Stored weights' scales: auto (2d under compute nvfp4, else 1d) | 1d (an E4M3 scale per 16 "
        "inputs: the lower error) | 2d (per 16x16 tile: compute nvfp4's backward GEMM reads it transposed).")] = "auto"
    grad_rounding: Annotated[Literal["stochastic", "nearest"], setting(
        "trajectory", "Recipe (nvfp4.compute nvfp4): stochastic | nearest rounding of the gradients.")] = "stochastic"
    wgrad_hadamard: Annotated[Bool, setting(
        "trajectory", "Recipe (nvfp4.compute nvfp4): a random Hadamard transform on the wgrad GEMM's operands.")] = True
    activations: Annotated[Literal["nvfp4", "bf16"], setting(
        "trajectory", "Recipe (nvfp4.compute nvfp4): nvfp4 | bf16 activations in forward and wgrad GEMMs.")] = "nvfp4"
    fused_amax: Annotated[Bool, setting(
        "trajectory", "q/k/v of a layer share one global amax, and gate/up one: as the fused qkv and gate_up "
        "projections of serving engines read one global scale per module.")] = True

    def __post_init__(self):
        for i, pattern in enumerate(self.keep_bf16):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"nvfp4.keep_bf16[{i}]={pattern!r}: not a regex ({e})") from None

    def resolved_block(self) -> str:
        """``"1d"`` or ``"2d"``: the block the stored weights use (``auto`` resolved)."""
        return self.block if self.block != "auto" else ("2d" if self.compute == "nvfp4" else "1d")


@_section
class TrainConfig:
    section: ClassVar[str] = "train"
    steps: Annotated[Pos, setting(
        "host", "Optimizer steps to train to (a resume continues to it). The trajectory depends on it only through the "
        "learning-rate schedule's length (optim.schedule_steps 0 = this), which a resume compares.")] = 300
    log_every: Annotated[Pos, setting("host", "Log the step metrics every N steps (metrics.jsonl, progress bar).")] = 10
    eval_every: Annotated[NonNeg, setting("host", "Validation loss every N steps and at the end; 0 = none.")] = 0
    eval_batches: Annotated[Pos, setting("host", "Batches of data.batch_size per evaluation, the same each time.")] = 4
    out_dir: Annotated[Str, Field(min_length=1), setting(
        "host", "The run's output folder (metrics, plots, the resolved config); --out overrides it.")] = "runs/default"
    seed: Annotated[Int, Field(ge=0, lt=2**32 - 2), setting(
        "trajectory", "Seed of the run's 32-bit JAX keys: seed for the init, seed + 1 for the weights' stochastic "
        "rounding, seed + 2 for the steps'; < 2^32 - 2.")] = 0
    init_from: Annotated[Optional[Str], setting(
        "trajectory", "A Hugging Face Llama checkpoint folder to start from (its config.json sets the model's shape); "
        "null: train.seed's random init.", program_key=False)] = None
    remat: Annotated[Literal["nothing", "dots"], setting(
        "program", "What a scanned layer keeps for its backward besides its input (never its gathered weights): "
        "nothing (recompute it; memory flat in depth) | dots (matmul outputs: less recompute, more "
        "memory).")] = "nothing"
    gpu_xla_flags: Annotated[Bool, setting(
        "program", "On a GPU: XLA flags that overlap weight gathers with compute (jax_nvfp4/xla_flags.py); a flag "
        "already in XLA_FLAGS keeps its value.", program_key=False)] = True


@_section
class CheckpointConfig:
    section: ClassVar[str] = "checkpoint"
    dir: Annotated[Optional[Str], setting(
        "host", "Checkpoint folder; rerunning the same command resumes from its newest checkpoint. null = no "
        "checkpoints (then the other checkpoint keys must keep their defaults).")] = None
    every: Annotated[NonNeg, setting("host", "Save every N steps, and at the end; 0 = no periodic checkpoints.")] = 0
    keep: Annotated[Pos, setting("host", "How many of the newest checkpoints are kept.")] = 3
    async_save: Annotated[Bool, setting("host", "Write checkpoints in the background while training goes on.")] = False
    fallback: Annotated[Bool, setting(
        "host", "A corrupt newest checkpoint (content hash mismatch) is refused; true restores the newest intact one "
        "instead (the corrupt ones are moved aside, not deleted).")] = False
    allow_change: Annotated[Tuple[Str, ...], setting(
        "host", "Config keys (section.key) allowed to differ from a checkpoint's when resuming it; the run continues "
        "with the new values (train.checkpoint.check_resume).")] = ()

    def __post_init__(self):
        affects = {k.key: k.affects for k in config_keys()}
        for key in self.allow_change:
            if key not in affects:
                raise ConfigError(f"checkpoint.allow_change: {key!r} is not a config key (section.key)")
            if affects[key] != "trajectory":  # a resume never compares it: allowing it would say nothing
                raise ConfigError(f"checkpoint.allow_change: {key!r} is not compared on resume (a {affects[key]} key: "
                                  "it may change anyway); leave it out")
        for f in dataclasses.fields(self):  # without a directory, a setting of checkpoints would be ignored
            if not self.dir and f.name != "dir" and (value := getattr(self, f.name)) != f.default:
                shown = str(value).lower() if isinstance(value, bool) else short(
                    list(value) if isinstance(value, tuple) else value)
                raise ConfigError(f"checkpoint.{f.name}={shown}: no checkpoint.dir is set, so there are "
                                  "no checkpoints; set checkpoint.dir too")


@_section
class Config:
    section: ClassVar[str] = ""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    nvfp4: NVFP4Config = dataclasses.field(default_factory=NVFP4Config)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def schedule_steps(self) -> int:
        """The learning-rate schedule's length (``optim.schedule_steps`` or ``train.steps``)."""
        return self.optim.schedule_steps or self.train.steps

    def __post_init__(self):
        m, n, d = self.model, self.nvfp4, self.data
        if n.keep_first_blocks + n.keep_last_blocks > m.layers:
            raise ConfigError(f"nvfp4.keep_first_blocks={n.keep_first_blocks} + nvfp4.keep_last_blocks="
                              f"{n.keep_last_blocks}: exceeds model.layers={m.layers}")
        # A warmup chosen longer than the run is an error; the default one is cut to the run.
        default_warmup = OptimConfig.__dataclass_fields__["warmup_steps"].default
        if self.optim.warmup_steps > self.schedule_steps() and self.optim.warmup_steps != default_warmup:
            raise ConfigError(f"optim.warmup_steps={self.optim.warmup_steps}: longer than the "
                              f"{self.schedule_steps()}-step schedule (train.steps, or optim.schedule_steps)")
        if d.source == "markov" and d.markov_states > m.vocab:
            raise ConfigError(f"data.markov_states={d.markov_states}: exceeds model.vocab={m.vocab} "
                              "(Markov tokens are 0..states-1)")
        if self.train.eval_every and not d.held_out:
            raise ConfigError(f"train.eval_every={self.train.eval_every}: needs a held-out split "
                              "(data.val_path or data.val_fraction)")
        if d.source == "file" and m.vocab < 256:
            raise ConfigError(f"model.vocab={m.vocab}: data.source='file' yields byte tokens 0..255, "
                              "needs model.vocab >= 256")


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}  # in the order configs are printed
_GIN_SECTIONS = {cls.__name__: name for name, cls in SECTIONS.items()}  # gin: ModelConfig.layers = 2


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key as its class declares it (:func:`setting`); ``default`` as a config holds it (a tuple for a
    list), ``mapping`` the class of a mapping-valued key's value (model.rope_scaling)."""

    section: str
    name: str
    default: Any
    description: str
    affects: str
    program_key: bool
    mapping: Optional[type] = None

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    def explained(self) -> str:
        """The description, followed by a mapping's keys with their defaults and meanings."""
        if self.mapping is None:
            return self.description
        keys = ", ".join(f"{k.name}={_flow(k.default)} ({k.description[0].lower()}{k.description[1:].rstrip('.')})"
                         for k in _keys_of(self.mapping, self.key))
        return f"{self.description} Its keys, with their defaults: {keys}."


@functools.cache
def _keys_of(cls: type, section: str) -> tuple[Key, ...]:
    keys = []
    for name, info in cls.__pydantic_fields__.items():
        args = (info.annotation, *typing.get_args(info.annotation))
        mapping = next((a for a in args if dataclasses.is_dataclass(a)), None)
        keys.append(Key(section, name, info.get_default(call_default_factory=True), info.description, mapping=mapping,
                        **info.json_schema_extra))
    return tuple(keys)


def config_keys(config_cls: Optional[type] = None) -> tuple[Key, ...]:
    """Every key of ``config_cls`` (default :class:`Config`), in the order configs are printed: the one list the
    default files, ``--help``, the resume check and the program key derive from."""
    return tuple(k for f in dataclasses.fields(config_cls or Config) for k in _keys_of(f.type, f.name))


def trajectory_keys(config_cls: Optional[type] = None) -> tuple[str, ...]:
    """``section.key`` of every key a resume compares with its checkpoint's (not the mesh: a restore reshards
    bit-identically; not ``train.steps``: the schedule's length stands for it)."""
    return tuple(k.key for k in config_keys(config_cls) if k.affects == "trajectory")


def _flow(value: Any) -> str:
    """``value`` as one line of YAML: ``256``, ``null``, ``[embed, head, norm]``, ``{a: 1}``."""
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, sort_keys=False, width=sys.maxsize)
    return text.removesuffix("\n...\n").strip()


CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
_GENERATED = "python -m train.config --write-defaults"


def default_yaml(width: int = 100) -> str:
    """``configs/default.yaml``: every key of :class:`Config` with its default, after its description and what a
    change of it affects, as comments."""
    cfg = Config()
    wrap = functools.partial(textwrap.wrap, break_long_words=False, break_on_hyphens=False)
    intro = (f"The default experiment: a {cfg.model.layers}-layer, d_model={cfg.model.d_model} byte-level "
             "transformer on the embedded Markov corpus (entropy rate ~1.515 nats/token = the loss floor), "
             f"NVFP4 weights, {cfg.train.steps} steps on {cfg.mesh.simulate_devices} simulated CPU devices: under "
             "2 minutes on 2 CPU cores, compilation included.")
    legend = ("Every key, with its default and what it means; the tag in brackets says what a change affects: "
              + "; ".join(f"[{name}] {what}" for name, what in AFFECTS.items()) + ".")
    source = (f"Written from the classes of train/config.py, the one source of the keys, by {_GENERATED}; "
              "edit those, not this file (a test checks that it is current).")
    lines = []
    for para in (intro, legend, source):
        lines += ["#"] * bool(lines) + [f"# {line}" for line in wrap(para, width - 2)]
    for section, keys in itertools.groupby(config_keys(), key=lambda k: k.section):
        lines += ["", f"{section}:"]
        for k in keys:
            lines += [f"  # {line}" for line in wrap(f"{k.explained()} [{k.affects}]", width - 4)]
            lines.append(f"  {k.name}: {_flow(k.default)}")
    return "\n".join(lines) + "\n"


def default_gin() -> str:
    """``configs/default.gin``: every key of :class:`Config` bound to its default."""
    lines = ["# The default experiment as gin bindings: every key, bound to its default. Each section is a",
             "# configurable named like its class in train/config.py; unbound keys keep their defaults.",
             "# Load with: python -m train --config train/configs/default.gin. What each key means:",
             f"# default.yaml, or python -m train --help. Written by {_GENERATED}."]
    for section, values in to_dict(Config()).items():
        lines += [""] + [f"{SECTIONS[section].__name__}.{name} = {value!r}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m train.config``: print the default config; ``--write-defaults`` writes ``configs/default.yaml`` and
    ``configs/default.gin`` from the classes, ``--check`` says whether they are current (exit 1 when not)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m train.config", description=main.__doc__.split(";")[0] + ".")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write-defaults", action="store_true",
                       help="write train/configs/default.yaml and default.gin from the classes")
    group.add_argument("--check", action="store_true", help="exit 1 if those files are not current")
    args = p.parse_args(argv)
    if not (args.write_defaults or args.check):
        sys.stdout.write(default_yaml())
        return 0
    stale = False
    for name, text in (("default.yaml", default_yaml()), ("default.gin", default_gin())):
        path = pathlib.Path(CONFIGS_DIR, name)
        if path.read_text() == text:
            continue
        if args.write_defaults:
            path.write_text(text)
            print(f"wrote {path}")
        else:
            stale = True
            print(f"{path} is not current: run {_GENERATED}", file=sys.stderr)
    return int(stale)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's core schema for scalars (PyYAML implements YAML 1.1: ``1e-3`` would be a string,
    ``010`` octal 8, ``1_000`` and ``1:30`` numbers, ``on``/``yes`` true) and refusing a key given twice in one
    mapping (PyYAML keeps the last silently); merge keys (``<<: *anchor``) merge, the mapping's own keys winning."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                dup = key in seen
            except TypeError:
                continue  # an unhashable key: construct_mapping reports it
            if dup:
                raise ConfigError(f"{self.name}: duplicate key {key!r} on line {line} (first on line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign, digits = (-1 if text[:1] == "-" else 1), text.lstrip("+-")
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        return sign * int(digits[2:] if base != 10 else digits, base)


_YAML = "tag:yaml.org,2002:"
_YAML_1_1 = tuple(_YAML + t for t in ("bool", "int", "float", "timestamp"))
_Loader.yaml_implicit_resolvers = {  # YAML 1.1's bool, int, float and timestamp resolvers out; 1.2's core ones in
    first: [(tag, regex) for tag, regex in resolvers if tag not in _YAML_1_1]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_YAML + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_YAML + "int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    _YAML + "float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))
_Loader.add_constructor(_YAML + "int", _Loader.construct_yaml_int)


def _yaml_load(text: str, where: str) -> Any:
    try:
        loader = _Loader(text)  # its reader refuses control characters (a NUL byte) at once
        loader.name = where
        return loader.get_single_data()
    except ConfigError:  # a key given twice, named as such
        raise
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {' '.join(str(e).split())}") from None
    except Exception as e:  # noqa: BLE001 - an explicit tag's constructor (!!int 0b11, !!bool x, !!float '')
        raise ConfigError(f"{where}: invalid YAML: a value its explicit tag (!!...) cannot construct "
                          f"({type(e).__name__}: {' '.join(str(e).split())})") from None


def _merge(base: Mapping[str, Any], top: Mapping[str, Any], depth: int = 3) -> dict[str, Any]:
    """Sections and mapping-valued keys (``model.rope_scaling``) merge key by key; other values are replaced."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for k, v in top.items():
        if depth == 3 and v is None and isinstance(out.get(k), Mapping):
            continue  # an empty section (``model:`` and no keys) changes nothing
        if depth > 1 and isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v, depth - 1)
        else:
            out[k] = dict(v) if isinstance(v, Mapping) else v
    return out


def _read_text(path: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None


def _read_yaml(path: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    if (real := os.path.realpath(path)) in chain:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    raw = _yaml_load(_read_text(path), path)
    if not isinstance(raw := {} if raw is None else raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    if (base := raw.pop("base", None)) is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: expected a file name, got {short(base)}")
    return _merge(_read_yaml(os.path.join(os.path.dirname(path), base), chain + (real,)), raw)


_GIN_COLLECTORS: dict[str, Any] = {}  # registered once per process: gin's registry is global and refuses duplicates


def _gin_text(path: str, chain: tuple = ()) -> tuple[str, dict]:
    """``(text, bound)``: the gin file ``path``'s text with each ``include`` replaced by the included file's (a name
    relative to ``path``'s folder, as YAML's ``base:``), and ``{key: (file, line)}`` of what it binds. Checked: a
    syntax error named in its own file, no imports (a config runs no code), no scoped bindings, configurables or
    ``%gin.REQUIRED`` (no section reads them), no key bound twice (gin would keep the last silently) but a file's own
    binding after the include it overrides, as a YAML file overrides its base."""
    from gin import config, config_parser
    real = os.path.realpath(path)
    if real in chain:
        raise ConfigError(f"gin include cycle: {' -> '.join(chain + (real,))}")
    text = _read_text(path)
    try:
        statements = list(config_parser.ConfigParser(text, config.ParserDelegate(skip_unknown=True)))
    except Exception as e:  # noqa: BLE001 - gin's syntax errors (SyntaxError, ValueError...)
        raise ConfigError(f"{path}: {_gin_error(e)}") from None
    lines, bound = text.splitlines(keepends=True), {}
    for st in statements:
        line = st.location.line_num
        where = f"{path}: line {line}"
        if isinstance(st, config_parser.ImportStatement):
            raise ConfigError(f"{where}: import {st.module}: a config file imports nothing (its bindings name the "
                              f"sections: {', '.join(_GIN_SECTIONS)})")
        if isinstance(st, config_parser.IncludeStatement):
            inc = os.path.join(os.path.dirname(path), st.filename)
            if not os.path.isfile(inc):
                raise ConfigError(f"{where}: include {st.filename!r}: no such file {inc}")
            inc_text, inc_bound = _gin_text(inc, chain + (real,))
            for key, there in inc_bound.items():
                if key in bound:
                    raise ConfigError(f"{where}: include {st.filename!r} binds {'.'.join(filter(None, key))} again "
                                      f"({there[0]}, line {there[1]}) after {bound[key][0]}, line {bound[key][1]}: the "
                                      "include would win; bind it once, after the includes")
            bound.update(inc_bound)
            lines[line - 1] = inc_text.rstrip("\n") + "\n"
        elif isinstance(st, config_parser.BindingStatement):
            name = f"{st.selector}.{st.arg_name}" if st.arg_name else st.selector
            if st.scope:
                raise ConfigError(f"{where}: {st.scope}/{name} is a scoped binding, which no section reads; bind "
                                  f"{name}")
            if refused := _references(st.value):
                raise ConfigError(f"{where}: {name} is bound to {refused}, which no section takes; give a value")
            key = (st.selector.rsplit(".", 1)[-1], st.arg_name)  # "train.config.ModelConfig" is "ModelConfig"
            if key in bound and bound[key][0] == path:  # not from an include: this file binds it twice
                raise ConfigError(f"{path}: {name} is bound twice, on line {bound[key][1]} and line {line}; keep one "
                                  "(gin would silently use the last)")
            bound[key] = (path, line)
    return "".join(lines), bound


def _references(value: Any) -> str:
    """What of a gin binding's ``value`` is no value (empty if nothing): a configurable (``@NAME``, in a list or dict
    too) or ``%gin.REQUIRED``; a macro (``%NAME``) is resolved by gin."""
    if isinstance(value, (list, tuple, dict)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return next(filter(None, map(_references, items)), "")
    if not type(value).__name__.endswith("ConfigurableReference"):
        return ""
    if repr(value).startswith("%"):
        return "%gin.REQUIRED" if repr(value) == "%gin.REQUIRED" else ""
    return "a configurable (@...)"


def _read_gin(path: str) -> dict[str, Any]:
    """``{section: bindings}`` from the gin file ``path`` (:func:`_gin_text`): one configurable per section, named
    like its class (``ModelConfig``, module ``train.config``), returning its ``**kwargs``, so unknown keys get the
    checks of YAML's."""
    import gin
    for name in _GIN_SECTIONS.keys() - _GIN_COLLECTORS.keys():
        _GIN_COLLECTORS[name] = gin.external_configurable(lambda **kwargs: kwargs, name=name, module="train.config")
    text = _gin_text(path)[0]
    gin.clear_config()  # bindings are global gin state: start clean and leave clean so loads do not leak
    try:
        gin.parse_config(text)
        return {section: dict(_GIN_COLLECTORS[name]()) for name, section in _GIN_SECTIONS.items()}
    except RecursionError:
        raise ConfigError(f"{path}: a macro (%NAME) that refers to itself, directly or through others") from None
    except Exception as e:  # gin raises ValueError / SyntaxError with multi-line messages
        raise ConfigError(f"{path}: {_gin_error(e)}") from None
    finally:
        gin.clear_config()


def _gin_error(e: Exception) -> str:
    """gin's error ``e`` in one line, in words where gin's are Python's internals."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if match := re.search(r"No configurable matching '([^']+)'", first):
        return (f"unknown gin configurable {match.group(1)!r}{suggest(match.group(1), list(_GIN_SECTIONS))}; "
                f"use one of {', '.join(_GIN_SECTIONS)}")
    if "macro()" in first:
        return "a macro (%NAME) that is not defined; define it first (NAME = value)"
    if "malformed node or string" in first:
        line = re.search(r" on line (\d+)", first)
        return ("a value that is not a Python literal (a number, 'string', True/False/None or a list of them)"
                + (f", line {line.group(1)}" if line else ""))
    if match := re.match(r"\('EOF in multi-line statement', \((\d+), \d+\)\)", first):
        return f"a bracket or quote left open at the end of the file (line {match.group(1)})"
    return first


def _overrides_to_dict(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    if isinstance(overrides, str):
        overrides = [overrides]  # a lone string would otherwise be split into characters
    out: dict[str, dict[str, Any]] = {}
    for text in overrides:
        key, sep, value = str(text).partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"override {text!r}: expected section.key=value (or section.key.field=value for a "
                              "mapping such as model.rope_scaling), e.g. model.layers=4")
        value, section = _yaml_load(value, f"override {key.strip()}"), out.setdefault(parts[0], {})
        if len(parts) == 2:
            section[parts[1]] = value
        else:  # one field of a mapping-valued key; the others keep what the config had
            mapping = section.get(parts[1])
            section[parts[1]] = {**(mapping if isinstance(mapping, Mapping) else {}), parts[2]: value}
    return out


def _read(path: str | os.PathLike | None, overrides: Sequence[str]) -> dict:
    """The YAML or gin file ``path`` (if any), then ``overrides``, merged section-wise."""
    raw = {}
    if path is not None:
        path = os.fspath(path)
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".yaml", ".yml", ".gin"):
            raise ConfigError(f"config file {path}: unknown extension {ext!r}; use .yaml, .yml or .gin")
        raw = _read_gin(path) if ext == ".gin" else _read_yaml(path)
    return _merge(raw, _overrides_to_dict(overrides))


def from_dict(raw: Mapping[str, Any] | None) -> Config:
    """A validated :class:`Config` from ``{section: {key: value}}``; missing keys take defaults."""
    return _validated(raw, Config)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict (tuples as lists), safe for YAML/JSON and for :func:`from_dict`."""
    return type(cfg).__pydantic_serializer__.to_python(cfg, mode="json")


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, loadable by :func:`load_config`; also the log format."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    pathlib.Path(path).write_text(to_yaml(cfg))


def load_section(path: str | os.PathLike | None, overrides: Sequence[str], section: str) -> Any:
    """``section`` of the config from defaults, ``path`` and ``overrides``, validated alone: what a tool that reads
    one section needs (no other section's rules, no checkpoint read)."""
    return _validated(_read(path, overrides).get(section), SECTIONS[section])


def _validated(raw: Any, cls: type) -> Any:
    """``raw`` (``None``: empty) validated as ``cls``: :class:`Config`, a section, or a mapping key's class."""
    if not isinstance(raw := {} if raw is None else raw, Mapping):
        what = f"{cls.section}: expected a mapping of keys" if cls.section else "config: expected a mapping of sections"
        raise ConfigError(f"{what}, got {type(raw).__name__}")
    if not cls.section:  # an empty section (``model:``) takes the defaults
        raw = {k: {} if v is None else v for k, v in raw.items()}
    try:
        return cls.__pydantic_validator__.validate_python(dict(raw))
    except pydantic.ValidationError as e:
        raise one_line(e, {cls.section: cls} if cls.section else SECTIONS, cls.section) from None


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                init_from: Optional[str] = None, checkpoint_model=None) -> Config:
    """The validated config from defaults, then ``path`` (YAML or gin), then ``overrides``; ``init_from`` sets
    ``train.init_from`` (``--init-from``). With ``train.init_from`` set, the model section is first validated alone,
    then ``checkpoint_model(folder, given)``'s ``{model key: value}`` (``given``: the model keys ``overrides`` set,
    which it checks against the checkpoint) replace its keys before the whole config is validated, so that the rules
    across sections see the imported model (``train.hf_import.load_config``)."""
    raw = _read(path, overrides)
    if init_from is not None:
        raw = _merge(raw, {"train": {"init_from": init_from}})
    folder = raw.get("train", {}).get("init_from") if isinstance(raw.get("train"), Mapping) else None
    if checkpoint_model is not None and isinstance(folder, str) and folder:
        _validated(raw.get("model"), SECTIONS["model"])  # the file's own model keys hold their types and rules
        raw = _merge(raw, {"model": checkpoint_model(folder, _overrides_to_dict(overrides).get("model") or {})})
    return from_dict(raw)


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with ``section.key=value`` overrides applied, validated as a whole."""
    return from_dict(_merge(to_dict(cfg), _overrides_to_dict(overrides)))


def mesh_error(e: Exception) -> ConfigError:
    """A :class:`jax_nvfp4.mesh.MeshError` as a ConfigError: the library's arguments it names are the ``mesh`` keys."""
    return ConfigError(re.sub(r"(?<![\w.])(data|tensor|racks|nvl_domain)=", r"mesh.\1=", str(e)))


def resolve_mesh_axes(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """``{"data": d, "tensor": t}`` with ``d * t == n_devices``; a -1 takes the rest
    (:func:`jax_nvfp4.mesh.axis_sizes`, the one check that imports JAX here: it needs the devices)."""
    from jax_nvfp4.mesh import MeshError, axis_sizes
    try:
        data, tensor = axis_sizes(mesh.data, mesh.tensor, n_devices, nvl_domain=mesh.nvl_domain,
                                  racked=mesh.layout == "gb200")
    except MeshError as e:
        raise mesh_error(e) from None
    return {"data": data, "tensor": tensor}


def validate_for_devices(cfg: Config, n_devices: int) -> dict[str, int]:
    """Checks the rules that need the device count; returns the resolved mesh axes."""
    axes = resolve_mesh_axes(cfg.mesh, n_devices)
    data, tensor, m = axes["data"], axes["tensor"], cfg.model
    if cfg.data.batch_size % (per := data * cfg.optim.grad_accum):
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: must be divisible by mesh data axis "
                          f"({data}) x optim.grad_accum ({cfg.optim.grad_accum}) = {per}")
    if tensor == 1:
        return axes
    # (key, value, block, why) in the order checked; 16 = the NVFP4 block: each tensor shard holds whole blocks.
    rules = [("model.d_model", m.d_model, 16, ""), ("model.mlp_hidden", m.mlp_hidden, 16, "")]
    if m.n_kv_heads % tensor == 0:  # split key/value heads (else replicated)
        rules.append(("model.kv_heads x head size", m.n_kv_heads * m.head_dim, 16, ""))
    rules.append(("model.heads", m.heads, 1, " to shard attention heads"))
    if tensor % m.n_kv_heads:  # nor can they be replicated
        rules.append(("model.kv_heads", m.n_kv_heads, 1, " to split key/value heads, or divide it to replicate them"))
    rules += [("model.vocab", m.vocab, 16, " to split the embedding and head over it"),
              ("model.seq_len", m.seq_len, 1, " to split the sequence between blocks")]
    for key, value, block, why in rules:
        if value % (block * tensor):
            by = (f"16 x mesh tensor axis ({tensor}) = {16 * tensor}" if block > 1
                  else f"the mesh tensor axis ({tensor})")
            raise ConfigError(f"{key}={value}: must be divisible by {by}{why}")
    return axes


if __name__ == "__main__":
    from train import config as _module  # this file's classes under their own name, not __main__'s

    sys.exit(_module.main())
