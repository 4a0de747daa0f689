"""Experiment configuration: frozen pydantic dataclasses, loaded from YAML or gin, validated on load.

A config is plain data; the classes below are the one source of its defaults (``default.yaml``
and ``default.gin`` spell them out, a test keeps them equal). pydantic checks every field (type,
choice, range; unknown keys are refused), a validator per class adds the rules that tie fields
together, and :func:`validate_for_devices` the rules that need the device count. Every failure is
a :class:`ConfigError` whose message is ONE line naming the offending key, so a typo in a
2000-GPU launch fails in the first second with a message that fits in a SLURM log line.

The classes are pydantic *dataclasses*, not ``BaseModel``: frozen and hashable (a config is part
of the compiled program's cache key), and ``dataclasses.replace(cfg.optim, lr=...)`` builds a
validated copy, as the rest of the stack does.

Sources, applied in order (later wins):

1. the defaults below (a small model that trains in minutes on 2 CPU cores);
2. a file: ``.yaml``/``.yml`` (``{section: {key: value}}``; ``base: other.yaml`` inherits, relative
   to the file) or ``.gin`` (bindings such as ``ModelConfig.layers = 2``);
3. overrides ``section.key=value``, values parsed as YAML (``optim.lr=1e-3``,
   ``nvfp4.keep_bf16=[embed,head]``, ``data.path=null``).

Merging happens on plain dicts before anything is constructed, so an override may fix a file
that is invalid on its own (e.g. lower ``model.layers`` and ``nvfp4.keep_last_blocks`` together).

This module does not import jax: the CLI loads and checks the config before JAX starts.
"""

import dataclasses
import functools
import math
import os
import re
import typing
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Sequence, Tuple

import pydantic
import yaml
from pydantic import Field, Strict

from train import config_sources
from train.config_sources import ConfigError, override_keys, short, suggest

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "NVFP4Config",
           "OptimConfig", "SECTIONS", "TrainConfig", "apply_overrides", "from_dict", "load_config", "override_keys",
           "resolve_mesh_axes", "save_config", "to_dict", "to_yaml", "validate_for_devices"]


# -- field types: strict (`layers: true` is not 1, `1` is not true), an int widens to a float ---

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
            raise _one_line(cls, e) from None

    cls.__init__ = __init__
    return cls


# -- sections -----------------------------------------------------------------------------------


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
    norm_eps: PosFloat = 1e-5
    tie_embeddings: Bool = False  # the head is the embedding matrix transposed
    # train.attention.attention: auto = cuDNN's fused kernel on a CUDA GPU, else blockwise
    # (O(sequence) memory); xla = XLA's attention (O(sequence^2) scores).
    attention: Literal["auto", "blockwise", "xla", "cudnn"] = "auto"
    init_std: PosFloat = 0.02

    @pydantic.model_validator(mode="after")
    def _check(self):
        if self.d_model % self.heads:
            raise ConfigError(f"model.d_model={self.d_model}: must be divisible by model.heads={self.heads}")
        if self.heads % self.n_kv_heads:
            raise ConfigError(f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads}")
        if (self.d_model // self.heads) % 2:
            # Rotary embeddings rotate pairs of channels within each head.
            raise ConfigError(f"model.heads={self.heads}: head size model.d_model/model.heads="
                              f"{self.d_model // self.heads} must be even for rotary embeddings")
        return self

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
    # file: any file, its bytes are the tokens; tokens: a token file from python -m train.prepare.
    path: Optional[Str] = None
    # Held-out data for the validation loss: a file of the same kind, or the last fraction of
    # data.path (then not trained on). The Markov source draws validation rows from its own stream.
    val_path: Optional[Str] = None
    val_fraction: Fraction = 0.0
    batch_size: Pos = 16
    # Size of the Markov chain's alphabet (tokens 0..states-1), see train.data.MarkovSource.
    markov_states: Annotated[Int, Field(ge=2)] = 32
    # Below 2**31: the token files' shuffle takes a 31-bit seed, so larger ones would alias smaller.
    seed: Annotated[Int, Field(ge=0, lt=2**31)] = 0

    @pydantic.model_validator(mode="after")
    def _check(self):
        reads_file = self.source in ("file", "tokens")
        if reads_file and not self.path:
            raise ConfigError(f"data.path: required when data.source={self.source!r}")
        if not reads_file and self.path:
            # The path would be ignored: the run would train on something else than asked.
            raise ConfigError(f"data.path={self.path!r}: data.source={self.source!r} does not read a file; "
                              "set data.source=file or tokens to train on it (or data.path=null)")
        if self.val_path and self.val_fraction:
            raise ConfigError("data.val_fraction: set either data.val_path or data.val_fraction, not both")
        if self.source == "markov" and (self.val_path or self.val_fraction):
            key = "data.val_path" if self.val_path else "data.val_fraction"
            raise ConfigError(f"{key}={self.val_path or self.val_fraction!r}: data.source='markov' draws validation "
                              "rows from its own stream and would ignore it; set data.source=file or tokens")
        return self


@_section
class MeshConfig:
    """Device mesh ``(data, tensor)``; -1 on one axis means "all remaining devices"."""

    section: ClassVar[str] = "mesh"
    data: Annotated[Int, Field(ge=-1)] = -1
    tensor: Annotated[Int, Field(ge=-1)] = 1
    # gb200: a rack axis across NVLink domains, data inside one, tensor groups inside one.
    layout: Literal["auto", "gb200"] = "auto"
    nvl_domain: Pos = 72
    racks: NonNeg = 0  # with layout gb200: the expected number of racks; 0 = whatever the devices span
    # With layout gb200: fsdp shards the state over racks and the data axis; hsdp shards it inside
    # a rack and replicates it across racks (weight gathers never leave a rack; R x the state).
    sharding: Literal["fsdp", "hsdp"] = "fsdp"
    # CPU only: simulated host devices to request when XLA_FLAGS does not say (0 = don't).
    simulate_devices: NonNeg = 8

    @pydantic.model_validator(mode="after")
    def _check(self):
        for name in ("data", "tensor"):
            if getattr(self, name) == 0:
                raise ConfigError(f"mesh.{name}=0: must be a positive size or -1 (the rest)")
        if self.layout != "gb200":
            # Racks and the sharding across them exist only in the gb200 layout.
            for name, default in (("racks", 0), ("sharding", "fsdp")):
                if getattr(self, name) != default:
                    raise ConfigError(f"mesh.{name}={getattr(self, name)!r}: only mesh.layout=gb200 has racks; "
                                      f"set mesh.layout=gb200 (or leave mesh.{name} at {default!r})")
        if self.data == -1 and self.tensor == -1:
            raise ConfigError("mesh.data=-1 and mesh.tensor=-1: at most one axis may be -1")
        return self


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
    # Length of the learning-rate schedule; 0 = train.steps. Stored in checkpoints: to extend
    # a finished run, raise train.steps and set this to the checkpoint's length.
    schedule_steps: NonNeg = 0


@_section
class NVFP4Config:
    """Which weights live in NVFP4 and how they move and compute."""

    section: ClassVar[str] = "nvfp4"
    weights: Literal["nvfp4", "bf16"] = "nvfp4"
    param_gather: Literal["packed", "dequantized"] = "packed"
    compute: Literal["dequant", "nvfp4"] = "dequant"
    # Regexes searched in parameter paths; matching leaves stay bf16. Kept layers (these, and the
    # first/last blocks) also run their GEMMs in bf16 under compute: nvfp4, as the published
    # recipe keeps its last layers and output projection.
    keep_bf16: Tuple[Str, ...] = ("embed", "head", "norm")
    keep_first_blocks: NonNeg = 0
    keep_last_blocks: NonNeg = 0
    stochastic_rounding: Bool = False
    cast_master_bf16: Bool = False
    nonfinite: Literal["skip", "error"] = "skip"
    # With nonfinite=skip: stop (exit 3) once this many steps in a row were skipped: a run
    # that skips every step has diverged. 0 = never stop.
    max_skipped_in_a_row: NonNeg = 10
    grad_reduce_dtype: Literal["grad", "float32"] = "grad"
    # The NVFP4 block of the stored weights: 1d (one E4M3 scale per 16 consecutive inputs of each
    # output; the lower error), 2d (one per 16x16 tile, which the transposed weight of
    # compute=nvfp4's backward GEMM needs); auto: 2d with compute=nvfp4, else 1d.
    block: Literal["auto", "1d", "2d"] = "auto"

    @pydantic.model_validator(mode="after")
    def _check(self):
        for i, pattern in enumerate(self.keep_bf16):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"nvfp4.keep_bf16[{i}]={pattern!r}: not a regex ({e})") from None
        if self.block == "1d" and self.compute == "nvfp4" and self.weights == "nvfp4":
            raise ConfigError("nvfp4.block=1d with nvfp4.compute=nvfp4: the recipe's backward GEMM reads the "
                              "transposed weight, which needs 16x16 tiles; set nvfp4.block=2d (or auto)")
        return self

    def resolved_block(self) -> str:
        """``"1d"`` or ``"2d"``: the block the stored weights use (``auto`` resolved)."""
        if self.block != "auto":
            return self.block
        return "2d" if self.compute == "nvfp4" else "1d"


@_section
class TrainConfig:
    section: ClassVar[str] = "train"
    steps: Pos = 300
    # The host reads the step metrics every N steps (metrics.jsonl, progress bar); steps in
    # between run without waiting.
    log_every: Pos = 10
    eval_every: NonNeg = 0  # validation loss every N steps and at the end; 0 = none
    eval_batches: Pos = 4  # validation batches (of data.batch_size rows) per evaluation
    out_dir: Str = "runs/default"
    # JAX keys take 32 bits and the run uses seed, seed + 1 and seed + 2: a larger seed would alias a smaller one.
    seed: Annotated[Int, Field(ge=0, lt=2**32 - 2)] = 0
    # A Hugging Face Llama checkpoint folder to start from instead of random weights
    # (train.hf_import; its config.json sets the model's shape).
    init_from: Optional[Str] = None
    # What a scanned layer keeps for its backward pass besides its input: nothing (recompute the
    # layer; memory flat in depth) or dots (its matmul outputs: less recompute, activation memory
    # grows with depth); never its gathered weights.
    remat: Literal["nothing", "dots"] = "nothing"
    # On a GPU, add the XLA flags that overlap the per-layer weight gathers and gradient sums with
    # compute (train/xla_flags.py); a flag already in XLA_FLAGS keeps its value.
    gpu_xla_flags: Bool = True


@_section
class CheckpointConfig:
    section: ClassVar[str] = "checkpoint"
    dir: Optional[Str] = None
    every: NonNeg = 0  # 0 = no periodic checkpoints
    keep: Pos = 3
    async_save: Bool = False
    # A corrupt newest checkpoint (content hash mismatch) is refused; true restores the newest
    # intact one instead (the corrupt ones are moved aside, not deleted).
    fallback: Bool = False
    # Config keys (section.key) allowed to differ from a checkpoint's when resuming it; the
    # run then continues with the new values (see train.checkpoint.check_resume).
    allow_change: Tuple[Str, ...] = ()

    @pydantic.model_validator(mode="after")
    def _check(self):
        for key in self.allow_change:
            section, _, name = key.partition(".")
            if section not in SECTIONS or name not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
                raise ConfigError(f"checkpoint.allow_change: {key!r} is not a config key (section.key)")
        if not self.dir:
            # Without a directory there are no checkpoints: a setting of them would be ignored.
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                if f.name != "dir" and value != f.default:
                    shown = str(value).lower() if isinstance(value, bool) else short(
                        list(value) if isinstance(value, tuple) else value)
                    raise ConfigError(f"checkpoint.{f.name}={shown}: no checkpoint.dir is set, so there are "
                                      "no checkpoints; set checkpoint.dir too")
        return self


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

    @pydantic.model_validator(mode="after")
    def _check(self):
        m, n, d = self.model, self.nvfp4, self.data
        if n.keep_first_blocks + n.keep_last_blocks > m.layers:
            raise ConfigError(f"nvfp4.keep_first_blocks={n.keep_first_blocks} + nvfp4.keep_last_blocks="
                              f"{n.keep_last_blocks}: exceeds model.layers={m.layers}")
        if d.source == "markov" and d.markov_states > m.vocab:
            raise ConfigError(f"data.markov_states={d.markov_states}: exceeds "
                              f"model.vocab={m.vocab} (Markov tokens are 0..states-1)")
        if self.train.eval_every and d.source != "markov" and not d.val_path and not d.val_fraction:
            raise ConfigError(f"train.eval_every={self.train.eval_every}: needs a held-out split "
                              "(data.val_path or data.val_fraction)")
        if d.source == "file" and m.vocab < 256:
            raise ConfigError(f"model.vocab={m.vocab}: data.source='file' yields byte "
                              "tokens 0..255, needs model.vocab >= 256")
        return self


# Section name -> class, in the order configs are printed.
SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
_GIN_SECTIONS = {cls.__name__: name for name, cls in SECTIONS.items()}  # gin: ModelConfig.layers = 2


# -- pydantic's errors as one line naming the key -----------------------------------------------

_UNKNOWN = ("unexpected_keyword_argument", "extra_forbidden")
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return type(args[0]).__name__
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return hint.__name__


def _one_line(cls: type, err: pydantic.ValidationError) -> ConfigError:
    """The first error pydantic found in constructing ``cls``, as a :class:`ConfigError`."""
    errors = err.errors(include_url=False)
    # An unknown key first: a misspelt key explains more than the errors it leads to.
    e = next((e for e in errors if e["type"] in _UNKNOWN), errors[0])
    kind, value, ctx = e["type"], e["input"], e.get("ctx") or {}
    if isinstance(ctx.get("error"), ConfigError):  # a cross-field rule of a validator above
        return ctx["error"]
    loc = ([cls.section] if cls.section else []) + list(e["loc"])
    if loc[0] not in SECTIONS:
        return ConfigError(f"unknown section {loc[0]!r}{suggest(str(loc[0]), list(SECTIONS))}; "
                           f"sections are {', '.join(SECTIONS)}")
    section, *rest = loc
    if not rest:
        return ConfigError(f"{section}: expected a mapping of keys, got {type(value).__name__} {short(value)}")
    name, *index = rest
    hints = typing.get_type_hints(SECTIONS[section], include_extras=True)
    if name not in hints or kind in _UNKNOWN:
        options = [f"{section}.{k}" for k in hints if k != "section"]
        return ConfigError(f"unknown key {section}.{name}{suggest(f'{section}.{name}', options)}")
    key, hint = f"{section}.{name}" + "".join(f"[{i}]" for i in index), hints[name]
    if index:
        hint = typing.get_args(typing.get_args(hint)[0])[0]  # Tuple[Str, ...] -> Str
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    if isinstance(value, float) and not math.isfinite(value):
        return ConfigError(f"{key}={value!r}: must be finite")
    if base is float and type(value) is int:
        value = float(value)  # as it would have been stored
    if kind == "literal_error" and isinstance(value, str):
        return ConfigError(f"{key}={value!r}: must be one of {', '.join(map(repr, typing.get_args(base)))}")
    if kind in _BOUNDS:
        return ConfigError(f"{key}={value!r}: must be {_BOUNDS[kind]} {next(iter(ctx.values()))}")
    if kind.endswith("_type") or kind == "literal_error":
        return ConfigError(f"{key}: expected {_type_name(hint)}, got {type(value).__name__} {short(value)}")
    return ConfigError(f"{key}={short(value)}: {e['msg']}")


# -- dicts <-> configs --------------------------------------------------------------------------


def from_dict(raw: Mapping[str, Any] | None) -> Config:
    """A validated :class:`Config` from ``{section: {key: value}}``; missing keys take defaults."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Config.__pydantic_validator__.validate_python({k: {} if v is None else v for k, v in raw.items()})
    except pydantic.ValidationError as e:
        raise _one_line(Config, e) from None


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


# -- loading ------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """The validated config from defaults, then ``path`` (YAML or gin), then ``overrides``.

    Raises:
      ConfigError: one line naming the offending key, file or override.
    """
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
    if data == -1 or tensor == -1:
        known_name, known = ("mesh.tensor", tensor) if data == -1 else ("mesh.data", data)
        if n_devices % known:
            raise ConfigError(f"{known_name}={known}: does not divide the {n_devices} devices")
        rest = n_devices // known
        data, tensor = (rest, tensor) if data == -1 else (data, rest)
    if data * tensor != n_devices:
        raise ConfigError(f"mesh.data={data} x mesh.tensor={tensor} = {data * tensor}: "
                          f"must equal the {n_devices} devices")
    dom = mesh.nvl_domain
    if mesh.layout == "gb200":
        if tensor > dom or dom % tensor:
            raise ConfigError(f"mesh.tensor={tensor}: must divide mesh.nvl_domain={dom} so "
                              "each tensor group stays inside one NVLink domain")
        if n_devices > dom and n_devices % dom:
            raise ConfigError(f"mesh.nvl_domain={dom}: {n_devices} devices span several "
                              "domains but are not a whole number of them")
    return {"data": data, "tensor": tensor}


def validate_for_devices(cfg: Config, n_devices: int) -> dict[str, int]:
    """Checks the rules that need the device count; returns the resolved mesh axes."""
    axes = resolve_mesh_axes(cfg.mesh, n_devices)
    data, tensor = axes["data"], axes["tensor"]
    per = data * cfg.optim.grad_accum
    if cfg.data.batch_size % per:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size}: must be divisible by mesh data axis "
            f"({data}) x optim.grad_accum ({cfg.optim.grad_accum}) = {per}")
    if tensor > 1:
        m = cfg.model
        # 16 = the NVFP4 block: each tensor shard must hold whole blocks.
        widths = [("model.d_model", m.d_model), ("model.mlp_hidden", m.mlp_hidden)]
        if m.n_kv_heads % tensor == 0:  # split key/value heads (else replicated)
            widths.append(("model.kv_heads x head size", m.n_kv_heads * m.head_dim))
        for name, size in widths:
            if size % (16 * tensor):
                raise ConfigError(f"{name}={size}: must be divisible by 16 x mesh tensor axis "
                                  f"({tensor}) = {16 * tensor}")
        if m.heads % tensor:
            raise ConfigError(f"model.heads={m.heads}: must be divisible by the mesh tensor "
                              f"axis ({tensor}) to shard attention heads")
        if m.n_kv_heads % tensor and tensor % m.n_kv_heads:
            raise ConfigError(f"model.kv_heads={m.n_kv_heads}: must be divisible by the mesh tensor axis "
                              f"({tensor}) to split key/value heads, or divide it to replicate them")
        if m.vocab % (16 * tensor):
            raise ConfigError(f"model.vocab={m.vocab}: must be divisible by 16 x mesh tensor axis "
                              f"({tensor}) = {16 * tensor} to split the embedding and head over it")
        if m.seq_len % tensor:
            raise ConfigError(f"model.seq_len={m.seq_len}: must be divisible by the mesh tensor "
                              f"axis ({tensor}) to split the sequence between blocks")
    return axes
