"""What the command lines say about themselves: ``--help`` texts and the GPU check."""

import pytest

from jax_nvfp4 import __main__ as nv_main
from train import __main__ as train_main


def test_jax_nvfp4_help_prints_help_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(nv_main, "demo", lambda: pytest.fail("--help ran the demo"))
    with pytest.raises(SystemExit) as e:
        nv_main.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--check-gpu" in out and "python -m train --help" in out


def test_check_gpu_fails_in_one_line_without_a_gpu(capsys):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("runs on a GPU")
    assert nv_main.main(["--check-gpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("no GPU: ") and 'pip install -e ".[gpu]"' in err


def test_check_gpu_when_no_backend_starts(capsys, monkeypatch):
    # JAX_PLATFORMS=cuda with the CPU build of jaxlib: JAX fails with a bare AssertionError
    # when asked for its backend; the check says it in one line, not a traceback.
    import jax

    def no_backend():
        raise AssertionError()

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setattr(jax, "default_backend", no_backend)
    assert nv_main.main(["--check-gpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("no GPU: ") and "JAX_PLATFORMS=cuda (AssertionError)" in err


def test_train_help_is_plain_text_with_examples_and_every_config_key(capsys):
    import dataclasses

    from train import __main__ as train_main
    from train.config import SECTIONS, config_keys

    with pytest.raises(SystemExit) as e:
        train_main.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "::" not in out  # no reStructuredText markup
    examples = out[out.index("Examples:"):].split("\n\n")[0].splitlines()[1:]
    assert sum(l.strip().startswith("python -m train") for l in examples) >= 3
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"{name}.{f.name}=" in out, f"{name}.{f.name}"
    assert "model.layers=2 " in out and "nvfp4.keep_bf16=[embed,head,norm]" in out and "=False" not in out
    # Each key with its default, its description and what a change of it affects, from the classes.
    flat = " ".join(out.split())
    for k in config_keys():
        assert f"{' '.join(k.explained().split())} [{k.affects}]" in flat, k.key
    assert "model.rope_scaling=null " in out and "factor=8.0 (divides the frequency" in flat
    assert "trajectory = changes the training trajectory: a resume refuses a change unless checkpoint.allow_change" in flat


def test_overrides_apply_in_command_line_order_and_single_options_are_given_once():
    """A later value of a key wins whether it is a --set or a bare KEY=VALUE; a second --config or
    --out is an error, not a silent replacement."""
    from train.config import load_config

    args = train_main.parse_args(["model.layers=1", "--set", "model.layers=3", "--out", "x=y", "train.steps=9"])
    assert args.overrides == ["model.layers=1", "model.layers=3", "train.steps=9"] and args.out == "x=y"
    assert load_config(None, args.overrides).model.layers == 3
    args = train_main.parse_args(["--set", "model.layers=3", "model.layers=1"])
    assert load_config(None, args.overrides).model.layers == 1
    # After "--", the overrides as they are (no --set was read there as one).
    assert train_main.parse_args(["--set", "a.b=1", "--", "model.layers=0", "c.d=2"]).overrides == [
        "a.b=1", "model.layers=0", "c.d=2"]
    for flag in ("--config", "--out"):
        with pytest.raises(SystemExit) as e:
            train_main.parse_args([flag, "a", flag, "b"])
        assert e.value.code == 2


def test_command_line_errors_are_one_line(capsys):
    """argparse's errors (usage first, then the message) are one line like the CLI's others; a
    layout or calibration for an export that is not asked for is refused."""
    for argv, needle in ((["--bogus"], "unrecognized arguments: --bogus"),
                         (["--hf-format", "modelopt"], "--hf-format modelopt chooses the layout of an --export-hf"),
                         (["--calibrate", "2"], "--calibrate N calibrates an --export-hf export"),
                         (["--compare", "fp8"], "argument --compare: invalid choice")):
        with pytest.raises(SystemExit) as e:
            train_main.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert train_main.parse_args(["--export-hf", "x"]).hf_format == "compressed-tensors"
