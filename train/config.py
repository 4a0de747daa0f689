"""Experiment configuration: frozen pydantic dataclasses, the one source of the defaults.

``configs/default.yaml`` lists every key with what it means (``default.gin`` the same as gin; a
test keeps both equal to the classes).

pydantic checks each field (type, choice, range, unknown keys), each class's ``__post_init__``
the rules that tie fields together, and :func:`validate_for_devices` those that need the device
count. Every failure is a :class:`ConfigError` of ONE line naming the key, so a typo in a
2000-GPU launch fails in the first second, in a line that fits a SLURM log.

Pydantic dataclasses rather than ``BaseModel``: frozen and hashable (a config is part of the
compiled program's cache key), and ``dataclasses.replace(cfg.optim, lr=...)``, used across the
stack, builds a validated copy.

:func:`load_config` validates defaults < a YAML or gin file < ``section.key=value`` overrides,
merged as plain dicts first (:mod:`train.config_sources`), so an override may fix a file that is
invalid on its own. No jax here: the CLI checks the config before JAX starts.
"""

import dataclasses
import functools
import os
import re
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Sequence, Tuple

import pydantic
import yaml
from pydantic import Field, Strict

from train import config_sources
from train.config_errors import ConfigError, one_line, short
from train.config_sources import override_keys

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "NVFP4Config",
           "OptimConfig", "RopeScaling", "SECTIONS", "TrainConfig", "apply_overrides", "from_dict", "load_config",
           "override_keys", "resolve_mesh_axes", "save_config", "to_dict", "to_yaml", "validate_for_devices"]


# Field types: strict (`layers: true` is not 1, `1` is not true); an int widens to a float.
Int = Annotated[int, Strict()]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, pydantic.BeforeValidator(lambda v: float(v) if type(v) is int else v), Strict(),
                  pydantic.AllowInfNan(False)]
Pos, NonNeg = Annotated[Int, Field(gt=0)], Annotated[Int, Field(ge=0)]
PosFloat, NonNegFloat = Annotated[Float, Field(gt=0)], Annotated[Float, Field(ge=0)]
Fraction = Annotated[Float, Field(ge=0, lt=1)]


def _section(cls):
    """``cls`` as a frozen pydantic dataclass refusing unknown keys, whose construction
    (``cls(...)``, ``dataclasses.replace``) raises :class:`ConfigError` instead of pydantic's
    multi-line report."""
    cls = pydantic.dataclasses.dataclass(frozen=True, config=pydantic.ConfigDict(extra="forbid"))(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except pydantic.ValidationError as e:
            # A mapping inside a section (model.rope_scaling) names its keys section.key.field.
            nested = cls.section and cls.section not in SECTIONS
            raise one_line(e, {cls.section: cls} if nested else SECTIONS, cls.section) from None

    cls.__init__ = __init__
    return cls


@_section
class RopeScaling:
    """Llama 3.x rotary scaling (transformers' ``rope_type: llama3``, ``_compute_llama3_parameters``):
    wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, those longer than ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, the ones between interpolate smoothly. Llama 3.1's: factor 8, low 1,
    high 4, original 8192."""

    section: ClassVar[str] = "model.rope_scaling"
    rope_type: Literal["llama3"] = "llama3"
    factor: Annotated[Float, Field(ge=1)] = 8.0
    low_freq_factor: PosFloat = 1.0
    high_freq_factor: PosFloat = 4.0
    original_max_position_embeddings: Pos = 8192

    def __post_init__(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor}: must be > "
                              f"model.rope_scaling.low_freq_factor={self.low_freq_factor}")


def _rope_scaling(value):
    """``model.rope_scaling``: null, or a mapping of :class:`RopeScaling`'s keys (its own
    one-line errors, ``model.rope_scaling.factor: ...``)."""
    if value is None or isinstance(value, RopeScaling):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.rope_scaling: expected a mapping (rope_type: llama3, factor, low_freq_factor, "
                          f"high_freq_factor, original_max_position_embeddings) or null, got {short(value)}")
    return RopeScaling(**value)


@_section
class ModelConfig:
    """A decoder-only transformer with the Llama architecture (pre-norm RMSNorm, rotary
    positions, grouped-query attention, SwiGLU MLP)."""

    section: ClassVar[str] = "model"
    vocab: Pos = 256
    d_model: Pos = 64
    layers: Pos = 2
    heads: Pos = 2
    kv_heads: NonNeg = 0  # key/value heads (grouped-query attention); 0 = model.heads
    mlp_hidden: Pos = 192
    seq_len: Pos = 64
    rope_theta: PosFloat = 10000.0
    # null: plain rotary positions; a mapping: Llama 3.x scaling (RopeScaling)
    rope_scaling: Annotated[Optional[RopeScaling], pydantic.BeforeValidator(_rope_scaling)] = None
    norm_eps: PosFloat = 1e-5
    tie_embeddings: Bool = False  # the head is the embedding matrix transposed
    attention: Literal["auto", "blockwise", "xla", "cudnn"] = "auto"
    init_std: PosFloat = 0.02

    def __post_init__(self):  # cross-field rules, run by pydantic after the fields validate
        if self.d_model % self.heads:
            raise ConfigError(f"model.d_model={self.d_model}: must be divisible by model.heads={self.heads}")
        if self.heads % self.n_kv_heads:
            raise ConfigError(f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads}")
        if self.head_dim % 2:  # rotary embeddings rotate pairs of channels within each head
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
    """Where tokens come from. ``batch_size`` is global: sequences per optimizer step."""

    section: ClassVar[str] = "data"
    source: Literal["markov", "file", "tokens"] = "markov"
    path: Optional[Str] = None
    val_path: Optional[Str] = None
    val_fraction: Fraction = 0.0
    batch_size: Pos = 16
    markov_states: Annotated[Int, Field(ge=2)] = 32
    seed: Annotated[Int, Field(ge=0, lt=2**31)] = 0  # the token files' shuffle takes a 31-bit seed

    def __post_init__(self):
        reads_file = self.source in ("file", "tokens")
        if reads_file and not self.path:
            raise ConfigError(f"data.path: required when data.source={self.source!r}")
        if not reads_file and self.path:  # ignored, the run would train on something else than asked
            raise ConfigError(f"data.path={self.path!r}: data.source={self.source!r} does not read a file; "
                              "set data.source=file or tokens to train on it (or data.path=null)")
        if self.val_path and self.val_fraction:
            raise ConfigError("data.val_fraction: set either data.val_path or data.val_fraction, not both")
        if self.val_path and self.path and os.path.abspath(self.val_path) == os.path.abspath(self.path):
            raise ConfigError(f"data.val_path={self.val_path!r}: is data.path, so validation would run on the "
                              "training data; give a held-out file or use data.val_fraction")
        if self.source == "markov" and (self.val_path or self.val_fraction):
            key = "data.val_path" if self.val_path else "data.val_fraction"
            raise ConfigError(f"{key}={self.val_path or self.val_fraction!r}: data.source='markov' draws validation "
                              "rows from its own stream and would ignore it; set data.source=file or tokens")


# Simulated CPU devices that still run a training step here (256 run a tiny step in ~50 s on 2
# cores; 1024 abort in XLA:CPU's collective rendezvous).
MAX_SIMULATED_DEVICES = 256


@_section
class MeshConfig:
    """Device mesh ``(data, tensor)``; -1 on one axis means "all remaining devices"."""

    section: ClassVar[str] = "mesh"
    data: Annotated[Int, Field(ge=-1)] = -1
    tensor: Annotated[Int, Field(ge=-1)] = 1
    layout: Literal["auto", "gb200"] = "auto"
    nvl_domain: Pos = 72
    racks: NonNeg = 0  # with layout gb200: the expected number of racks; 0 = whatever the devices span
    sharding: Literal["fsdp", "hsdp"] = "fsdp"
    simulate_devices: NonNeg = 8

    def __post_init__(self):
        if self.simulate_devices > MAX_SIMULATED_DEVICES:
            raise ConfigError(f"mesh.simulate_devices={self.simulate_devices}: at most {MAX_SIMULATED_DEVICES} "
                              "simulated CPU devices can run a step (XLA:CPU's collectives time out past that); "
                              "to see larger meshes compiled without running, use python -m benchmarks scale")
        for name in ("data", "tensor"):
            if getattr(self, name) == 0:
                raise ConfigError(f"mesh.{name}=0: must be a positive size or -1 (the rest)")
        for name, default in (("racks", 0), ("sharding", "fsdp")):  # only the gb200 layout has racks
            if self.layout != "gb200" and getattr(self, name) != default:
                raise ConfigError(f"mesh.{name}={getattr(self, name)!r}: only mesh.layout=gb200 has racks; "
                                  f"set mesh.layout=gb200 (or leave mesh.{name} at {default!r})")
        if self.data == -1 and self.tensor == -1:
            raise ConfigError("mesh.data=-1 and mesh.tensor=-1: at most one axis may be -1")


@_section
class OptimConfig:
    """The inner optax optimizer applied to the float32 master weights."""

    section: ClassVar[str] = "optim"
    name: Literal["adamw", "adam", "sgd", "lion"] = "adamw"
    lr: PosFloat = 3e-3
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    warmup_steps: NonNeg = 20
    weight_decay: NonNegFloat = 0.01
    b1: Fraction = 0.9
    b2: Fraction = 0.95
    clip_norm: NonNegFloat = 1.0  # global-norm clipping; 0 = off
    grad_accum: Annotated[Int, Field(ge=1)] = 1
    schedule_steps: NonNeg = 0


@_section
class NVFP4Config:
    """Which weights live in NVFP4 and how they move and compute."""

    section: ClassVar[str] = "nvfp4"
    weights: Literal["nvfp4", "bf16"] = "nvfp4"
    param_gather: Literal["packed", "dequantized"] = "packed"
    compute: Literal["dequant", "nvfp4"] = "dequant"
    keep_bf16: Tuple[Str, ...] = ("embed", "head", "norm")
    keep_first_blocks: NonNeg = 0
    keep_last_blocks: NonNeg = 0
    stochastic_rounding: Bool = False
    cast_master_bf16: Bool = False
    nonfinite: Literal["skip", "error"] = "skip"
    max_skipped_in_a_row: NonNeg = 10
    grad_reduce_dtype: Literal["grad", "float32"] = "grad"
    block: Literal["auto", "1d", "2d"] = "auto"
    # compute=nvfp4: the recipe's elements (jax_nvfp4.nn.Recipe), each on by default.
    grad_rounding: Literal["stochastic", "nearest"] = "stochastic"
    wgrad_hadamard: Bool = True
    activations: Literal["nvfp4", "bf16"] = "nvfp4"
    # q/k/v of a layer share one global amax, and gate/up one (as fused projections do).
    fused_amax: Bool = True

    def __post_init__(self):
        for i, pattern in enumerate(self.keep_bf16):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"nvfp4.keep_bf16[{i}]={pattern!r}: not a regex ({e})") from None

    def resolved_block(self) -> str:
        """``"1d"`` or ``"2d"``: the block the stored weights use (``auto`` resolved)."""
        if self.block != "auto":
            return self.block
        return "2d" if self.compute == "nvfp4" else "1d"


@_section
class TrainConfig:
    section: ClassVar[str] = "train"
    steps: Pos = 300
    log_every: Pos = 10
    eval_every: NonNeg = 0  # validation loss every N steps and at the end; 0 = none
    eval_batches: Pos = 4  # validation batches (of data.batch_size rows) per evaluation
    out_dir: Str = "runs/default"
    seed: Annotated[Int, Field(ge=0, lt=2**32 - 2)] = 0  # 32-bit JAX keys from seed, seed + 1, seed + 2
    init_from: Optional[Str] = None
    remat: Literal["nothing", "dots"] = "nothing"
    gpu_xla_flags: Bool = True


@_section
class CheckpointConfig:
    section: ClassVar[str] = "checkpoint"
    dir: Optional[Str] = None
    every: NonNeg = 0  # 0 = no periodic checkpoints
    keep: Pos = 3
    async_save: Bool = False
    fallback: Bool = False
    allow_change: Tuple[Str, ...] = ()

    def __post_init__(self):
        for key in self.allow_change:
            section, _, name = key.partition(".")
            if section not in SECTIONS or name not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
                raise ConfigError(f"checkpoint.allow_change: {key!r} is not a config key (section.key)")
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
        if self.train.eval_every and d.source != "markov" and not d.val_path and not d.val_fraction:
            raise ConfigError(f"train.eval_every={self.train.eval_every}: needs a held-out split "
                              "(data.val_path or data.val_fraction)")
        if d.source == "file" and m.vocab < 256:
            raise ConfigError(f"model.vocab={m.vocab}: data.source='file' yields byte tokens 0..255, "
                              "needs model.vocab >= 256")


# Section name -> class, in the order configs are printed.
SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
_GIN_SECTIONS = {cls.__name__: name for name, cls in SECTIONS.items()}  # gin: ModelConfig.layers = 2


# -- dicts, files and overrides <-> configs -----------------------------------------------------


def from_dict(raw: Mapping[str, Any] | None) -> Config:
    """A validated :class:`Config` from ``{section: {key: value}}``; missing keys take defaults."""
    if not isinstance(raw := {} if raw is None else raw, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Config.__pydantic_validator__.validate_python({k: {} if v is None else v for k, v in raw.items()})
    except pydantic.ValidationError as e:
        raise one_line(e, SECTIONS) from None


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict (tuples as lists), safe for YAML/JSON and for :func:`from_dict`."""
    return Config.__pydantic_serializer__.to_python(cfg, mode="json")


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, loadable by :func:`load_config`; also the log format."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(to_yaml(cfg))


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """The validated config from defaults, then ``path`` (YAML or gin), then ``overrides``; a
    :class:`ConfigError` names the offending key, file or override."""
    return from_dict(config_sources.read(path, overrides, _GIN_SECTIONS))


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with ``section.key=value`` overrides applied, validated as a whole."""
    return from_dict(config_sources.read(None, overrides, _GIN_SECTIONS, base=to_dict(cfg)))


# -- device-dependent checks --------------------------------------------------------------------


def resolve_mesh_axes(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """``{"data": d, "tensor": t}`` with ``d * t == n_devices``; a -1 takes the rest."""
    if n_devices < 1:
        raise ConfigError(f"mesh: need at least one device, got {n_devices}")
    data, tensor = mesh.data, mesh.tensor
    if -1 in (data, tensor):
        known_name, known = ("mesh.tensor", tensor) if data == -1 else ("mesh.data", data)
        if n_devices % known:
            raise ConfigError(f"{known_name}={known}: does not divide the {n_devices} devices")
        data, tensor = (n_devices // known, tensor) if data == -1 else (data, n_devices // known)
    if data * tensor != n_devices:
        raise ConfigError(f"mesh.data={data} x mesh.tensor={tensor} = {data * tensor}: "
                          f"must equal the {n_devices} devices")
    dom = mesh.nvl_domain
    if mesh.layout == "gb200" and (tensor > dom or dom % tensor):
        raise ConfigError(f"mesh.tensor={tensor}: must divide mesh.nvl_domain={dom} so each tensor group stays "
                          "inside one NVLink domain")
    if mesh.layout == "gb200" and n_devices > dom and n_devices % dom:
        raise ConfigError(f"mesh.nvl_domain={dom}: {n_devices} devices span several domains but are not a whole "
                          "number of them")
    return {"data": data, "tensor": tensor}


def validate_for_devices(cfg: Config, n_devices: int) -> dict[str, int]:
    """Checks the rules that need the device count; returns the resolved mesh axes."""
    axes = resolve_mesh_axes(cfg.mesh, n_devices)
    data, tensor, m = axes["data"], axes["tensor"], cfg.model
    per = data * cfg.optim.grad_accum
    if cfg.data.batch_size % per:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: must be divisible by mesh data axis "
                          f"({data}) x optim.grad_accum ({cfg.optim.grad_accum}) = {per}")
    if tensor == 1:
        return axes
    # 16 = the NVFP4 block: each tensor shard must hold whole blocks.
    widths = [("model.d_model", m.d_model), ("model.mlp_hidden", m.mlp_hidden)]
    if m.n_kv_heads % tensor == 0:  # split key/value heads (else replicated)
        widths.append(("model.kv_heads x head size", m.n_kv_heads * m.head_dim))
    for name, size in widths:
        if size % (16 * tensor):
            raise ConfigError(f"{name}={size}: must be divisible by 16 x mesh tensor axis ({tensor}) = {16 * tensor}")
    if m.heads % tensor:
        raise ConfigError(f"model.heads={m.heads}: must be divisible by the mesh tensor axis ({tensor}) "
                          "to shard attention heads")
    if m.n_kv_heads % tensor and tensor % m.n_kv_heads:
        raise ConfigError(f"model.kv_heads={m.n_kv_heads}: must be divisible by the mesh tensor axis "
                          f"({tensor}) to split key/value heads, or divide it to replicate them")
    if m.vocab % (16 * tensor):
        raise ConfigError(f"model.vocab={m.vocab}: must be divisible by 16 x mesh tensor axis ({tensor}) = "
                          f"{16 * tensor} to split the embedding and head over it")
    if m.seq_len % tensor:
        raise ConfigError(f"model.seq_len={m.seq_len}: must be divisible by the mesh tensor axis ({tensor}) "
                          "to split the sequence between blocks")
    return axes
