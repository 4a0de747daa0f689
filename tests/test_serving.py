"""``python -m benchmarks serving``: every row gets the same budget, the fine-tune continues
the bf16 run, the W4A4 rows serve their rows' params with calibrated activations (a few tiny
runs), and the report's gap arithmetic (``test_hf_import`` covers the import the rows go
through, ``test_calibrate`` the calibration)."""

import json

import numpy as np
import pytest

from benchmarks import convergence_text as ct
from benchmarks import serving


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return ct.build_corpus(str(tmp_path_factory.mktemp("serving")), max_bytes=100_000)


def test_every_row_has_the_same_budget(corpus, tmp_path):
    specs = serving.specs("default", 2000, [0, 1], str(tmp_path), corpus)
    assert [s["row"] for s in specs] == ["bf16", "native", "qat", "ptq", "ptq_w4a4", "native_w4a4", "qat_w4a4"] * 2
    for seed in (0, 1):
        bf16, native, qat, ptq, ptq_w4a4, native_w4a4, qat_w4a4 = (s for s in specs if s["seed"] == seed)
        # The W4A4 rows serve their rows' params: the ptq import, the runs' final checkpoints.
        assert ptq_w4a4["source"] == ptq["source"] and ptq_w4a4["of"] == "ptq"
        for w, of in ((native_w4a4, native), (qat_w4a4, qat)):
            assert w["of"] == of["row"] and w["steps"] == of["steps"] and w["extra"] == of["extra"]
            assert f"checkpoint.dir={w['checkpoint']}" in of["extra"]
        assert len({s["name"] for s in specs}) == len(specs)
        assert bf16["steps"] == native["steps"] == 2000 and qat["steps"] == 200
        # The fine-tune starts from the bf16 run's export after the other 1800 steps; the PTQ
        # row quantizes its final export.
        assert sorted(bf16["export_hf"]) == [1800, 2000]
        assert f"train.init_from={bf16['export_hf'][1800]}" in qat["extra"]
        assert ptq["source"] == bf16["export_hf"][2000]
        cfg, _ = ct.run_config(qat["size"], qat["steps"], seed, qat["variant"], corpus, qat["extra"])
        assert (cfg.nvfp4.weights, cfg.train.steps, cfg.optim.schedule, cfg.data.seed) == ("nvfp4", 200, "constant",
                                                                                            seed + 1000)
        # Same batches for the bf16 and native runs of a seed.
        a, _ = ct.run_config("default", 2000, seed, "bf16", corpus)
        b, _ = ct.run_config("default", 2000, seed, "nvfp4", corpus)
        assert a.data == b.data and a.train.seed == b.train.seed
    # The fine-tune's learning rate is the bf16 schedule's over its last 200 steps: between the
    # cosine's final value (0.1 x lr) and its value at step 1800.
    lr = serving.tail_lr("default", 2000, 200, corpus)
    assert 0.1 * 3e-3 < lr < 0.13 * 3e-3


def test_gaps_report_and_plot(tmp_path):
    seeds = [0, 1, 2]
    specs = [{"row": r, "seed": s, "steps": 200 if r == "qat" else 2000, "name": f"{r}-{s}"}
             for s in seeds for r in serving.ROWS]
    vals = {"bf16": [2.0, 2.1, 2.2], "ptq": [2.1, 2.2, 2.3], "native": [2.02, 2.1, 2.24], "qat": [2.04, 2.12, 2.2],
            "ptq_w4a4": [2.2, 2.31, 2.42], "native_w4a4": [2.04, 2.142, 2.266], "qat_w4a4": [2.06, 2.12, 2.2]}
    state = {"sha256": "ab" * 32, "git_commit": "cd" * 20, "dirty": False}
    results = {f"{r}-{s}": {"final_val_loss": vals[r][s], "val_history": [[200, vals[r][s] + 0.5], [2000, vals[r][s]]],
                            **({"source_state": state} if "w4a4" in r else {"source": state})}
               for r in serving.ROWS for s in seeds}
    agg = serving.aggregate(results, specs, seeds)
    assert agg["rows"]["bf16"]["gap_pct"]["mean"] == 0
    assert agg["rows"]["ptq"]["per_seed"][0]["gap_pct"] == pytest.approx(5.0)
    assert agg["rows"]["native"]["gap_pct"]["min"] == pytest.approx(0.0)
    # native - ptq, paired: (1 - 5), (0 - 4.76), (1.82 - 4.55) percentage points.
    assert agg["pairs"]["native-ptq"]["max"] < 0
    # W4A4 rows: gaps against the same seed's bf16 run, as every row's.
    assert agg["rows"]["ptq_w4a4"]["gap_pct"]["mean"] == pytest.approx(10.0)
    assert agg["rows"]["native_w4a4"]["per_seed"][1]["gap_pct"] == pytest.approx(2.0)
    assert agg["rows"]["native_w4a4"]["gap_nats"]["max"] == pytest.approx(0.066)
    # What quantizing the activations costs each row, paired: native (2.04 - 2.02) / 2.0 ...
    assert agg["pairs"]["native_w4a4-native"]["min"] == pytest.approx(1.0)
    assert agg["pairs"]["native_w4a4-native"]["max"] == pytest.approx(2.0)
    assert agg["pairs"]["qat_w4a4-qat"]["mean"] == pytest.approx(1 / 3)
    assert agg["pairs"]["native_w4a4-ptq_w4a4"]["max"] < 0
    meta = {"command": "python -m benchmarks serving", "where": "here", "git_commit": None, "wall_min": 1.0,
            "runs_done": 12, "runs_total": 12, "size": "default", "model": "m", "steps": 2000, "tail_steps": 200,
            "tokens_per_step": "16 x 64", "seeds": seeds, "calibration_batches": 16}
    path = serving.report({"meta": meta, "aggregate": agg, "runs": results}, str(tmp_path))
    text = open(path).read()
    assert "`abababababab` (21 runs; commit `cdcdcdcdcd`). Every gap compares runs of that one state." in text
    assert "| bf16 training, then round-to-nearest NVFP4" in text and "+5.00" in text
    assert "| ptq, W4A4: activations NVFP4 too (calibrated) | 2.3100 | +10.00 |" in text
    assert "- native_w4a4 - native: mean +1.39" in text
    assert "amax calibrated on 16 other held-out batches (the validation stream's next 16 after the 32 evaluated)" in text
    serving.plot(agg, str(tmp_path / "serving.png"), 2000)
    assert (tmp_path / "serving.png").stat().st_size > 10_000
    json.dumps(agg)


@pytest.mark.slow
def test_w4a4_rows_serve_the_rows_params(corpus, tmp_path, monkeypatch):
    """Tiny runs of 10 steps: the W4A4 evaluation of the native run (its final checkpoint) and
    of the ptq import, calibrated on validation batches that are not the evaluated ones."""
    from train import data as data_lib

    monkeypatch.setattr(serving, "CALIBRATION_BATCHES", 2)
    cache, quiet = str(tmp_path), lambda _: None
    specs = {s["row"]: s for s in serving.specs("tiny", 10, [0], cache, corpus)}
    short = ["train.eval_batches=2"]
    for row in ("bf16", "native", "native_w4a4"):
        specs[row]["extra"] = [*specs[row].get("extra", ()), *short]
    bf16 = ct.run_one(specs["bf16"], corpus, cache, log=quiet)
    native = ct.run_one(specs["native"], corpus, cache, log=quiet)
    ptq = serving.ptq_one(specs["ptq"], corpus, cache, quiet)
    nw = serving.w4a4_one(specs["native_w4a4"], corpus, cache, quiet)
    pw = serving.w4a4_one(specs["ptq_w4a4"], corpus, cache, quiet)
    # Weight-only, the W4A4 evaluations recompute their rows' validation losses (same params,
    # same batches); with the activations quantized the loss moves.
    assert nw["w4a16_val_loss"] == pytest.approx(native["final_val_loss"], rel=1e-4)
    assert pw["w4a16_val_loss"] == pytest.approx(ptq["final_val_loss"], rel=1e-4)
    for w in (nw, pw):
        assert np.isfinite(w["final_val_loss"]) and w["final_val_loss"] != w["w4a16_val_loss"]
        assert len(w["input_amax"]) == 7 and all(a > 0 for v in w["input_amax"].values() for a in v)
    # The native run's float32 masters are served in bf16 too; an HF import has none.
    assert nw["master_bf16_val_loss"] is not None and pw["master_bf16_val_loss"] is None
    # Calibration: the validation stream's batches after the evaluated ones.
    cfg, _ = ct.run_config("tiny", 10, 0, "nvfp4", corpus, specs["native"]["extra"])
    evaluated, calibration = serving.w4a4_batches(cfg, 2)
    expect = data_lib.eval_batches(cfg, data_lib.make_source(cfg.data, cfg.model, split="val"))
    assert len(evaluated) == 2 and len(calibration) == 2
    assert all(np.array_equal(a, b) for a, b in zip(evaluated, expect))
    assert not any(np.array_equal(c, e) for c in calibration for e in evaluated)
    # Cached like a run; the report's rows take the W4A4 loss.
    assert serving.w4a4_one(specs["native_w4a4"], corpus, cache, quiet) == nw
    results = {s["name"]: r for s, r in ((specs["bf16"], bf16), (specs["native"], native), (specs["ptq"], ptq),
                                          (specs["native_w4a4"], nw), (specs["ptq_w4a4"], pw))}
    agg = serving.aggregate(results, list(specs.values()), [0])
    b = bf16["final_val_loss"]
    assert agg["rows"]["native_w4a4"]["per_seed"][0]["gap_pct"] == pytest.approx(100 * (nw["final_val_loss"] - b) / b)
    assert "qat_w4a4" not in agg["rows"]
