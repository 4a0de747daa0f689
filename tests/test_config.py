"""train.config: YAML, gin, overrides, and one-line errors that name the key."""

import dataclasses
import os
import re
import textwrap
from typing import Annotated, ClassVar

import pytest
import yaml

from train import config as config_lib
from train.config import (
    SECTIONS,
    Config,
    ConfigError,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    config_keys,
    default_gin,
    default_yaml,
    from_dict,
    load_config,
    resolve_mesh_axes,
    save_config,
    setting,
    to_dict,
    to_yaml,
    validate_for_devices,
)

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "train", "configs")


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _error(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


# -- defaults and files -------------------------------------------------------------------------


def test_defaults():
    cfg = load_config(None, [])
    # The default job is sized to finish in 2 minutes on 2 CPU cores (README, set-up).
    assert (cfg.model.d_model, cfg.model.layers, cfg.model.mlp_hidden, cfg.model.seq_len) == (64, 2, 192, 64)
    assert cfg.nvfp4.keep_bf16 == ("embed", "head", "norm")
    assert cfg.data.batch_size == 16 and cfg.optim.lr == 3e-3 and cfg.mesh.simulate_devices == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.layers = 3


def test_shipped_configs_load():
    # default.yaml and default.gin, written from the classes, load as the defaults.
    assert load_config(os.path.join(CONFIGS, "default.yaml")) == Config()
    assert load_config(os.path.join(CONFIGS, "default.gin")) == Config()
    tiny = load_config(os.path.join(CONFIGS, "tiny.yaml"))
    assert (tiny.model.d_model, tiny.model.layers, tiny.train.steps) == (64, 2, 50)
    assert tiny.optim == Config().optim.__class__(warmup_steps=5)  # inherited from base
    # The benchmarks' "small" model keeps its shape whatever the default becomes.
    small = load_config(os.path.join(CONFIGS, "small.yaml"))
    assert (small.model.d_model, small.model.layers, small.model.heads, small.model.mlp_hidden,
            small.model.seq_len, small.data.batch_size, small.data.markov_states) == (128, 4, 4, 352, 128, 32, 64)


def test_default_yaml_lists_every_key_with_its_default():
    # default.yaml is the documented reference of every key, written from the classes.
    with open(os.path.join(CONFIGS, "default.yaml")) as f:
        text = f.read()
    listed = yaml.safe_load(text)
    assert list(listed) == list(SECTIONS)
    for name, cls in SECTIONS.items():
        assert list(listed[name]) == [f.name for f in dataclasses.fields(cls)], name
    assert from_dict(listed) == Config() and to_dict(Config()) == {k: dict(v) for k, v in listed.items()}
    flat = " ".join(text.replace("#", " ").split())
    for k in config_keys():  # each after its description and what a change of it affects
        assert f"{' '.join(k.explained().split())} [{k.affects}] {k.name}:" in flat, k.key


def test_default_files_are_current():
    # Regenerating them from the classes changes nothing (python -m train.config --write-defaults).
    for name, text in (("default.yaml", default_yaml()), ("default.gin", default_gin())):
        with open(os.path.join(CONFIGS, name)) as f:
            assert f.read() == text, f"train/configs/{name} is stale: run python -m train.config --write-defaults"
    assert config_lib.main(["--check"]) == 0


def test_every_key_is_declared_with_its_meaning_and_what_it_affects():
    keys = config_keys()
    assert [k.key for k in keys] == [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert all(k.description.strip() and k.affects in config_lib.AFFECTS for k in keys)
    # A host key is in no program; the trajectory keys are what a resume compares.
    assert not [k.key for k in keys if k.affects == "host" and k.program_key]
    assert config_lib.trajectory_keys() == tuple(k.key for k in keys if k.affects == "trajectory")
    with pytest.raises(TypeError, match=r"extra\.knob: declare it with Annotated\[type, setting"):
        @config_lib._section
        class Extra:
            section: ClassVar[str] = "extra"
            knob: config_lib.Int = 1
    with pytest.raises(ValueError, match="affects='sometimes'"):
        setting("sometimes", "A knob.")
    with pytest.raises(ValueError, match="host key"):
        setting("host", "A knob.", program_key=True)


def test_the_resume_check_keeps_its_hand_kept_history_on_trajectory_keys():
    from train import checkpoint as ckpt_lib

    trajectory = set(config_lib.trajectory_keys())
    assert set(ckpt_lib._RESOLVED) <= trajectory and set(ckpt_lib._BEFORE_RECORDED) <= trajectory
    assert {k.split(":")[0] for k in ckpt_lib._UNKNOWN_BEFORE} <= trajectory
    assert set(ckpt_lib.run_identity(Config())) == trajectory | {"train.steps"}


def test_a_key_declared_once_reaches_every_derived_list(monkeypatch, capsys, tmp_path):
    """A new key is one annotated field: it is listed in default.yaml, default.gin and --help
    with its default and description, a resume with another value of it is refused, and it is
    part of the program key."""
    from train import __main__ as train_main
    from train import checkpoint as ckpt_lib
    from train import programs

    @config_lib._section
    class Train(TrainConfig):
        label_smoothing: Annotated[config_lib.Fraction, setting(
            "trajectory", "Label smoothing of the loss's targets.")] = 0.0

    @config_lib._section
    class Extended(Config):
        train: Train = dataclasses.field(default_factory=Train)

    monkeypatch.setattr(config_lib, "Config", Extended)
    monkeypatch.setitem(SECTIONS, "train", Train)

    text = default_yaml()
    assert "  # Label smoothing of the loss's targets. [trajectory]\n  label_smoothing: 0.0\n" in text
    path = tmp_path / "default.yaml"
    path.write_text(text)
    assert load_config(path) == Extended() != Config()
    assert "Train.label_smoothing = 0.0\n" in default_gin()

    with pytest.raises(SystemExit):
        train_main.parse_args(["--help"])
    assert re.search(r"\n    train\.label_smoothing=0\.0 +Label smoothing of the loss's targets\. \[trajectory\]\n",
                     capsys.readouterr().out)

    assert "train.label_smoothing" in config_lib.trajectory_keys()
    base = load_config(None, [f"checkpoint.dir={tmp_path}"])
    meta = {"step": 2, "run": ckpt_lib.run_identity(base)}
    assert meta["run"]["train.label_smoothing"] == 0.0
    ckpt_lib.check_resume("ck/2", meta, base)
    smoothed = apply_overrides(base, ["train.label_smoothing=0.1"])
    with pytest.raises(ckpt_lib.CheckpointError, match=r"train\.label_smoothing"):
        ckpt_lib.check_resume("ck/2", meta, smoothed)
    ckpt_lib.check_resume("ck/2", meta, apply_overrides(smoothed, ["checkpoint.allow_change=[train.label_smoothing]"]))

    assert ("train.label_smoothing", 0.1) in programs.program_key(smoothed)
    assert programs.program_key(smoothed) != programs.program_key(base)


def test_yaml_base_inheritance_and_floats(tmp_path):
    _write(tmp_path, "base.yaml", """
        model: {layers: 6, heads: 8, d_model: 256}
        optim: {lr: 1e-3}
        """)
    os.mkdir(tmp_path / "sub")
    path = _write(tmp_path, "sub/run.yaml", """
        base: ../base.yaml
        model: {layers: 2}
        train: {steps: 70}
        """)
    cfg = load_config(path, [])
    assert (cfg.model.layers, cfg.model.heads, cfg.model.d_model) == (2, 8, 256)
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)  # YAML 1.1 would say "1e-3"
    assert cfg.train.steps == 70


def test_scalars_read_as_yaml_1_2_and_merge_keys_merge(tmp_path):
    """PyYAML's YAML 1.1 would read 010 as octal 8, 1_000 and 1:30 as numbers, on/yes as true."""
    assert load_config(None, ["data.seed=010"]).data.seed == 10
    assert load_config(None, ["data.seed=0o10"]).data.seed == 8
    assert load_config(None, ["optim.lr=-.5e-2", "optim.lr=.5e-2"]).optim.lr == 0.005
    for value in ("1_000", "1:30", "0b11"):
        assert _error([f"data.seed={value}"]) == f"data.seed: expected int, got str '{value}'"
    for value in ("on", "yes"):
        assert _error([f"model.tie_embeddings={value}"]).startswith("model.tie_embeddings")
    path = _write(tmp_path, "merge.yaml", """
        model: &shape {layers: 3, heads: 4, d_model: 128}
        optim: {lr: 1e-3}
        """)
    assert load_config(path, []).model.layers == 3
    path = _write(tmp_path, "merged.yaml", """
        model:
          <<: {layers: 3, heads: 4}
          heads: 8
        """)
    assert (load_config(path, []).model.layers, load_config(path, []).model.heads) == (3, 8)


def test_an_empty_section_of_a_child_changes_nothing_of_its_base(tmp_path):
    # `model:` with its keys commented out reads as null: the base's section stays, as without it.
    _write(tmp_path, "base.yaml", "model: {layers: 6, mlp_hidden: 176}\n")
    path = _write(tmp_path, "run.yaml", """
        base: base.yaml
        model:
          # layers: 3
        train: {steps: 70}
        """)
    cfg = load_config(path, [])
    assert (cfg.model.layers, cfg.model.mlp_hidden, cfg.train.steps) == (6, 176, 70)
    assert load_config(path, ["model.rope_scaling=null"]).model.rope_scaling is None  # a null key still replaces


def test_an_empty_base_is_named(tmp_path):
    assert _error(path=_write(tmp_path, "e.yaml", 'base: ""\n')).endswith("e.yaml: base: expected a file name, got ''")


def test_yaml_base_cycle(tmp_path):
    _write(tmp_path, "a.yaml", "base: b.yaml\n")
    _write(tmp_path, "b.yaml", "base: a.yaml\n")
    assert "loops" in _error(path=str(tmp_path / "a.yaml"))


def test_gin(tmp_path):
    path = _write(tmp_path, "run.gin", """
        ModelConfig.layers = 2
        OptimConfig.lr = 1e-3
        NVFP4Config.weights = "bf16"
        NVFP4Config.keep_bf16 = ("embed",)
        CheckpointConfig.dir = "/tmp/ck"
        """)
    cfg = load_config(path, ["model.layers=3"])
    assert cfg.model.layers == 3  # overrides come after the file
    assert cfg.optim.lr == 1e-3 and cfg.nvfp4.weights == "bf16"
    assert cfg.nvfp4.keep_bf16 == ("embed",) and cfg.checkpoint.dir == "/tmp/ck"
    # Bindings do not leak into the next load.
    assert load_config(_write(tmp_path, "empty.gin", "# nothing\n"), []) == Config()


def test_gin_key_bound_twice_is_an_error(tmp_path):
    # Refused under either name of the configurable, naming the key and both lines.
    path = _write(tmp_path, "dup.gin", """
        ModelConfig.layers = 2
        OptimConfig.lr = 1e-3
        train.config.ModelConfig.layers = \\
            8
        """)
    msg = _error(path=path)
    assert msg.startswith(f"{path}: ") and re.search(r"ModelConfig\.layers .*line 2 .*line 4", msg), msg
    assert load_config(_write(tmp_path, "ok.gin", "ModelConfig.layers = 2\nTrainConfig.steps = 2\n")).model.layers == 2


def test_gin_errors(tmp_path):
    # A scoped binding would configure nothing the stack reads.
    msg = _error(path=_write(tmp_path, "s.gin", "ModelConfig.heads = 2\nscope/ModelConfig.layers = 3\n"))
    assert msg.endswith("line 2: scope/ModelConfig.layers is a scoped binding, which no section reads; bind "
                        "ModelConfig.layers"), msg
    msg = _error(path=_write(tmp_path, "a.gin", "ModelConfig.layer = 2\n"))
    assert "model.layer" in msg and "model.layers" in msg
    msg = _error(path=_write(tmp_path, "b.gin", "ModelConfg.layers = 2\n"))
    assert "ModelConfg" in msg and "ModelConfig" in msg
    msg = _error(path=_write(tmp_path, "c.gin", "ModelConfig.layers = \"four\"\n"))
    assert msg.startswith("model.layers: expected int")
    assert "c.gin" in _error(path=_write(tmp_path, "c.gin", "ModelConfig.layers = 2 +\n"))


def test_gin_includes_are_files_beside_the_includer_checked_like_it(tmp_path):
    """``include`` names a file relative to the including one (as YAML's ``base:``), whose own
    bindings are checked (a key bound twice there too); the includer may rebind what it includes.
    Imports (which would run code) and references to configurables are refused by line."""
    os.mkdir(tmp_path / "sub")
    _write(tmp_path, "sub/shape.gin", "ModelConfig.heads = 4\nSTEPS = 7\n")
    cfg = load_config(_write(tmp_path, "run.gin", 'include "sub/shape.gin"\nModelConfig.heads = 8\n'
                                                  "ModelConfig.layers = 3\nTrainConfig.steps = %STEPS\n"))
    assert (cfg.model.heads, cfg.model.layers, cfg.train.steps) == (8, 3, 7)
    _write(tmp_path, "sub/dup.gin", "ModelConfig.layers = 3\nModelConfig.layers = 4\n")
    assert "sub/dup.gin: ModelConfig.layers is bound twice, on line 1 and line 2" in _error(
        path=_write(tmp_path, "inc.gin", 'include "sub/dup.gin"\n'))
    assert _error(path=_write(tmp_path, "cycle.gin", 'include "cycle.gin"\n')).startswith("gin include cycle: ")
    # A key two includes bind, or one bound before the include that binds it again: the include would win.
    _write(tmp_path, "sub/again.gin", "ModelConfig.heads = 2\n")
    for text in ('include "sub/shape.gin"\ninclude "sub/again.gin"\n',
                 'ModelConfig.heads = 8\ninclude "sub/shape.gin"\n'):
        assert "binds ModelConfig.heads again" in _error(path=_write(tmp_path, "twice.gin", text))
    _write(tmp_path, "sub/broken.gin", "ModelConfig.heads = (2,\n")
    broken = _error(path=_write(tmp_path, "b.gin", 'include "sub/broken.gin"\n'))
    assert broken.startswith(f"{tmp_path}/sub/broken.gin: ")
    assert _error(path=_write(tmp_path, "none.gin", 'include "nothere.gin"\n')).endswith(
        f"include 'nothere.gin': no such file {tmp_path}/nothere.gin")
    assert ": line 1: import this: a config file imports nothing" in _error(path=_write(tmp_path, "i.gin", "import this\n"))
    assert ": line 1: ModelConfig.layers is bound to a configurable" in _error(
        path=_write(tmp_path, "r.gin", "ModelConfig.layers = @ModelConfig()\n"))
    for text in ('NVFP4Config.keep_bf16 = ["embed", @ModelConfig]\n', 'ModelConfig.rope_scaling = {"factor": @X}\n'):
        assert ": line 1: " in (e := _error(path=_write(tmp_path, "n.gin", text))) and "bound to a configurable" in e
    assert ": line 1: ModelConfig.layers is bound to %gin.REQUIRED, which no section takes" in _error(
        path=_write(tmp_path, "q.gin", "ModelConfig.layers = %gin.REQUIRED\n"))
    assert "a macro (%NAME) that is not defined" in _error(path=_write(tmp_path, "m.gin", "ModelConfig.layers = %X\n"))
    assert "a macro (%NAME) that refers to itself" in _error(
        path=_write(tmp_path, "c.gin", "A = %B\nB = %A\nModelConfig.layers = %A\n"))
    # gin's own parse errors in words (they had been Python's: "<ast.Name object at 0x...>", "('EOF in ...', (2, 0))").
    assert _error(path=_write(tmp_path, "f.gin", 'OptimConfig.lr = float("nan")\n')).endswith(
        "a value that is not a Python literal (a number, 'string', True/False/None or a list of them), line 1")
    assert _error(path=_write(tmp_path, "o.gin", "OptimConfig.lr = (1,\n")).endswith(
        "a bracket or quote left open at the end of the file (line 2)")


def test_overrides():
    cfg = load_config(None, ["model.layers=2", "nvfp4.weights=bf16", "optim.lr=1e-3",
                             "nvfp4.keep_bf16=[embed,head]", "data.path=null",
                             "checkpoint.dir=ck", "checkpoint.async_save=true", "optim.clip_norm=0"])
    assert cfg.model.layers == 2 and cfg.nvfp4.weights == "bf16" and cfg.optim.lr == 1e-3
    assert cfg.nvfp4.keep_bf16 == ("embed", "head") and cfg.data.path is None
    assert cfg.checkpoint.async_save is True
    assert cfg.optim.clip_norm == 0.0 and isinstance(cfg.optim.clip_norm, float)  # int -> float
    # Overrides merge before validation: together they may fix what each alone breaks.
    cfg = load_config(None, ["nvfp4.keep_first_blocks=2", "nvfp4.keep_last_blocks=2",
                             "model.layers=4"])
    assert cfg.nvfp4.keep_first_blocks == 2
    assert apply_overrides(Config(), ["train.steps=5"]).train.steps == 5


def test_round_trip(tmp_path):
    cfg = load_config(None, ["model.layers=2", "nvfp4.keep_bf16=[x, y]", "data.source=file", "data.path=/d"])
    path = str(tmp_path / "out" / "config.yaml")
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert from_dict(to_dict(cfg)) == cfg
    assert yaml.safe_load(to_yaml(cfg))["nvfp4"]["keep_bf16"] == ["x", "y"]
    assert list(to_dict(cfg)) == list(SECTIONS)


# -- every class of error names its key ---------------------------------------------------------


# One case per class of error, its whole message: what a user reads.
@pytest.mark.parametrize("overrides, message", [
    (["modle.layers=2"], "unknown section 'modle' (did you mean model?); sections are model, data, mesh, optim, nvfp4, "
                         "train, checkpoint"),
    (["model.layer=2"], "unknown key model.layer (did you mean model.layers?)"),
    (["model=3"], "override 'model=3': expected section.key=value (or section.key.field=value for a mapping such as "
                  "model.rope_scaling), e.g. model.layers=4"),
    (["model.layers=four"], "model.layers: expected int, got str 'four'"),
    (["data.source=web"], "data.source='web': must be one of 'markov', 'file', 'tokens'"),
    (["optim.b2=1"], "optim.b2=1.0: must be < 1"),
    (["model.d_model=130", "model.heads=4"], "model.d_model=130: must be divisible by model.heads=4"),
    (["checkpoint.every=50"], "checkpoint.every=50: no checkpoint.dir is set, so there are no checkpoints; set "
                              "checkpoint.dir too"),
])
def test_each_class_of_error_is_one_line_naming_the_key(overrides, message):
    assert _error(overrides) == message


# Every rule: refused, in one line that starts with the key it concerns (its wording is the class's above).
@pytest.mark.parametrize("overrides, key", [
    # types
    (["optim.learning_rate=1"], "unknown key optim.learning_rate"),
    (["model.layers=2.5"], "model.layers:"),
    (["model.layers=true"], "model.layers:"),
    (["train.out_dir=3"], "train.out_dir:"),
    (["optim.lr=fast"], "optim.lr:"),
    (["nvfp4.stochastic_rounding=1"], "nvfp4.stochastic_rounding:"),
    (["nvfp4.keep_bf16=embed"], "nvfp4.keep_bf16:"),
    (["nvfp4.keep_bf16=[1]"], "nvfp4.keep_bf16[0]:"),
    (["data.path=5"], "data.path:"),
    # choices
    (["mesh.layout=nvl"], "mesh.layout="),
    (["optim.name=adagrad"], "optim.name="),
    (["optim.schedule=step"], "optim.schedule="),
    (["nvfp4.weights=fp8"], "nvfp4.weights="),
    (["nvfp4.param_gather=x"], "nvfp4.param_gather="),
    (["nvfp4.compute=x"], "nvfp4.compute="),
    (["nvfp4.nonfinite=ignore"], "nvfp4.nonfinite="),
    (["nvfp4.grad_reduce_dtype=bf16"], "nvfp4.grad_reduce_dtype="),
    (["nvfp4.keep_bf16=['(']"], "nvfp4.keep_bf16[0]="),
    (["nvfp4.block=16x16"], "nvfp4.block="),
    (["nvfp4.grad_rounding=up"], "nvfp4.grad_rounding="),
    (["nvfp4.activations=fp8"], "nvfp4.activations="),
    # ranges
    (["model.vocab=0"], "model.vocab="),
    (["model.layers=0"], "model.layers="),
    (["model.mlp_hidden=0"], "model.mlp_hidden="),
    (["model.seq_len=-1"], "model.seq_len="),
    (["data.batch_size=0"], "data.batch_size="),
    (["optim.lr=0"], "optim.lr="),
    (["optim.lr=.nan"], "optim.lr="),
    (["optim.lr=1" + "0" * 400], "optim.lr=1000000000"),  # an int past float's range: OverflowError before
    (["model.rope_scaling.factor=-1" + "0" * 400], "model.rope_scaling.factor=-1000000000"),
    (["optim.grad_accum=0"], "optim.grad_accum="),
    (["optim.clip_norm=-1"], "optim.clip_norm="),
    (["optim.schedule_steps=-1"], "optim.schedule_steps="),
    (["train.steps=0"], "train.steps="),
    (["checkpoint.keep=0"], "checkpoint.keep="),
    (["mesh.data=0"], "mesh.data="),
    (["mesh.tensor=-2"], "mesh.tensor="),
    (["mesh.tensor=-1"], "mesh.data=-1 and mesh.tensor=-1"),
    (["nvfp4.max_skipped_in_a_row=-1"], "nvfp4.max_skipped_in_a_row="),
    (["mesh.simulate_devices=1024"], "mesh.simulate_devices="),
    (["model.layers=99999999999999999999999"], "model.layers=99999999999999999999999: must be < 2147483648"),
    (["model.vocab=2147483648"], "model.vocab="),
    # keys that alias: JAX keys take 32 bits, the token files' shuffle a 31-bit seed
    (["train.seed=4294967296"], "train.seed="),
    (["data.seed=2147483648"], "data.seed="),
    # cross-field rules
    (["model.d_model=12", "model.heads=4"], "model.heads="),
    (["model.layers=4", "nvfp4.keep_first_blocks=3", "nvfp4.keep_last_blocks=2"], "nvfp4.keep_first_blocks="),
    (["data.source=file"], "data.path:"),
    (["data.source=file", "data.path=x", "model.vocab=100"], "model.vocab="),
    (["data.markov_states=300"], "data.markov_states="),
    (["optim.warmup_steps=50", "train.steps=5"], "optim.warmup_steps="),
    (["data.source=file", "data.path=a.txt", "data.val_path=./a.txt"], "data.val_path="),
    # settings that would be ignored
    (["data.path=corpus.txt"], "data.path="),
    (["mesh.racks=4"], "mesh.racks="),
    (["mesh.sharding=hsdp"], "mesh.sharding="),
    (["checkpoint.async_save=true"], "checkpoint.async_save="),
    (["checkpoint.fallback=true"], "checkpoint.fallback="),
    (["checkpoint.allow_change=[data.seed]"], "checkpoint.allow_change="),
    (["checkpoint.dir=ck", "checkpoint.allow_change=[mesh.data]"], "checkpoint.allow_change: 'mesh.data' is not "
                                                                      "compared on resume (a program key"),
    (["checkpoint.dir=ck", "checkpoint.allow_change=[train.log_every]"], "checkpoint.allow_change: 'train.log_every'"),
    (["data.val_fraction=0.1"], "data.val_fraction="),
    (["data.val_path=held_out.txt"], "data.val_path="),
])
def test_every_rule_names_its_key(overrides, key):
    assert _error(overrides).startswith(key)


def test_duplicate_yaml_keys_are_errors(tmp_path):
    # A key given twice in one mapping is refused, naming the file and both lines.
    err = _error(path=_write(tmp_path, "dup.yaml", "model:\n  layers: 2\n  heads: 2\n  layers: 8\n"))
    assert "duplicate key 'layers' on line 4 (first on line 2)" in err and "dup.yaml" in err and "\n" not in err
    assert "duplicate key 'model'" in _error(path=_write(tmp_path, "dup2.yaml", "model: {}\nmodel: {layers: 2}\n"))
    assert "duplicate key" in _error(["model.layers={a: 1, a: 2}"])
    assert "invalid YAML" not in _error(path=_write(tmp_path, "dup3.yaml", "model: {}\nmodel: {}\n"))
    # An explicit tag whose constructor fails on the value: one line (they were IndexError, KeyError... tracebacks).
    for value in ("!!float", "!!bool x", "!!timestamp x", "!!set [1]", "!!int 0b11"):
        assert "invalid YAML: a value its explicit tag (!!...) cannot construct" in _error([f"optim.lr={value}"])
    assert load_config(_write(tmp_path, "ok.yaml", "model:\n  layers: 2\ntrain:\n  steps: 3\n")).model.layers == 2


def test_nvfp4_block_auto_is_1d_unless_the_gemm_needs_tiles():
    # Weights-only (bf16 GEMMs): a scale per 16 inputs, the lower quantization error; the
    # recipe's FP4 backward GEMM reads the transposed weight, which 16x16 tiles give for free.
    assert load_config(None, []).nvfp4.resolved_block() == "1d"
    assert load_config(None, ["nvfp4.compute=nvfp4"]).nvfp4.resolved_block() == "2d"
    assert load_config(None, ["nvfp4.block=2d"]).nvfp4.resolved_block() == "2d"
    # 1D weights under the recipe (an ablation: dgrad re-quantizes the weight along its outputs).
    assert load_config(None, ["nvfp4.block=1d", "nvfp4.compute=nvfp4"]).nvfp4.resolved_block() == "1d"


def test_schedule_length_defaults_to_the_steps():
    assert load_config(None, ["train.steps=30"]).schedule_steps() == 30
    assert load_config(None, ["train.steps=30", "optim.schedule_steps=20"]).schedule_steps() == 20


def test_file_errors(tmp_path):
    assert "not found" in _error(path=str(tmp_path / "missing.yaml"))
    assert "unknown extension" in _error(path=_write(tmp_path, "c.toml", "x = 1\n"))
    assert "invalid YAML" in _error(path=_write(tmp_path, "bad.yaml", "model: [1,\n"))
    assert "expected a mapping" in _error(path=_write(tmp_path, "list.yaml", "- 1\n"))
    assert "model: expected a mapping" in _error(path=_write(tmp_path, "s.yaml", "model: 3\n"))
    msg = _error(path=_write(tmp_path, "k.yaml", "model:\n  dmodel: 64\n"))
    assert re.match(r"unknown key model\.dmodel\b.*model\.d_model", msg), msg


def test_sections_validate_on_construction():
    with pytest.raises(ConfigError, match="model.heads=3"):
        ModelConfig(d_model=128, heads=3)
    with pytest.raises(ConfigError, match="optim.lr"):
        dataclasses.replace(Config().optim, lr=-1.0)


# -- device-dependent checks --------------------------------------------------------------------


def test_resolve_mesh_axes():
    mesh = Config().mesh
    assert resolve_mesh_axes(mesh, 8) == {"data": 8, "tensor": 1}
    m = dataclasses.replace(mesh, tensor=2)
    assert resolve_mesh_axes(m, 8) == {"data": 4, "tensor": 2}
    m = dataclasses.replace(mesh, data=2, tensor=-1)
    assert resolve_mesh_axes(m, 8) == {"data": 2, "tensor": 4}
    assert resolve_mesh_axes(dataclasses.replace(mesh, data=4, tensor=2), 8) == {
        "data": 4, "tensor": 2}


@pytest.mark.parametrize("overrides, n, expect", [
    (["mesh.tensor=3"], 8, "mesh.tensor=3: does not divide the 8 devices"),
    (["mesh.data=3", "mesh.tensor=-1"], 8, "mesh.data=3: does not divide the 8 devices"),
    (["mesh.data=4", "mesh.tensor=4"], 8, "mesh.data=4 x mesh.tensor=4 = 16: must equal the 8"),
    (["data.batch_size=36"], 8, "data.batch_size=36: must be divisible by mesh data axis (8)"),
    (["data.batch_size=32", "optim.grad_accum=8"], 8, "data.batch_size=32: must be divisible by mesh data axis (8) "
                                "x optim.grad_accum (8) = 64"),
    (["mesh.layout=gb200", "mesh.nvl_domain=6", "mesh.tensor=4"], 8, "mesh.tensor=4: must divide"
                                                                     " mesh.nvl_domain=6"),
    (["mesh.layout=gb200", "mesh.nvl_domain=4", "mesh.tensor=8"], 8, "mesh.tensor=8"),
    (["mesh.layout=gb200", "mesh.nvl_domain=3"], 8, "mesh.nvl_domain=3"),
    (["mesh.tensor=4", "model.heads=4", "model.mlp_hidden=352"], 8, "model.mlp_hidden=352: must be divisible by 16 x mesh tensor axis "
                           "(4) = 64"),
    (["mesh.tensor=2", "model.d_model=120", "model.heads=2"], 8, "model.d_model=120"),
    (["mesh.tensor=2", "model.heads=1"], 8, "model.heads=1: must be divisible by the mesh"),
])
def test_device_errors(overrides, n, expect):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        validate_for_devices(cfg, n)
    assert expect in str(info.value) and "\n" not in str(info.value)


def test_device_checks_pass():
    assert validate_for_devices(Config(), 8) == {"data": 8, "tensor": 1}
    cfg = load_config(None, ["mesh.tensor=2", "mesh.layout=gb200", "data.batch_size=8",
                             "optim.grad_accum=2"])
    assert validate_for_devices(cfg, 8) == {"data": 4, "tensor": 2}
    cfg = load_config(None, ["mesh.tensor=4", "mesh.layout=gb200", "model.heads=4", "model.mlp_hidden=384",
                             "data.batch_size=72"])
    assert validate_for_devices(cfg, 144) == {"data": 36, "tensor": 4}


def test_one_field_of_a_mapping_key_can_be_overridden():
    """``section.key.field=value`` sets one field of a mapping-valued key (model.rope_scaling),
    merged with what the files gave; the others keep their values."""
    from train.config import load_config

    assert load_config(None, ["model.rope_scaling.factor=4"]).model.rope_scaling.factor == 4.0
    c = load_config(None, ["model.rope_scaling={rope_type: llama3, original_max_position_embeddings: 256}",
                           "model.rope_scaling.factor=2"])
    assert (c.model.rope_scaling.factor, c.model.rope_scaling.original_max_position_embeddings) == (2.0, 256)
    with pytest.raises(ConfigError, match="model.rope_scaling.factor=0.5: must be >= 1"):
        load_config(None, ["model.rope_scaling.factor=0.5"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["model.rope_scaling.factor.x=1"])


def test_a_validation_file_linked_to_the_training_file_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    os.symlink(tmp_path / "a.txt", tmp_path / "link.txt")
    os.link(tmp_path / "a.txt", tmp_path / "hard.txt")
    for other in ("link.txt", "hard.txt"):
        err = _error(["data.source=file", f"data.path={tmp_path / 'a.txt'}", f"data.val_path={tmp_path / other}"])
        assert err.startswith("data.val_path=") and "validation would run on the training data" in err
