"""What the command lines say about themselves: ``--help`` texts and the GPU check."""

import pytest

from jax_nvfp4 import __main__ as nv_main


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
